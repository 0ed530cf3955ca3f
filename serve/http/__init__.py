"""An OpenAI-compatible HTTP server over the engine, with the edit channel.

Endpoints: `POST /v1/chat/completions` and `POST /v1/completions` (SSE streaming or not),
`GET /v1/models`, `GET /health`, `GET /metrics`, `DELETE /v1/sessions/{id}`, `POST
/v1/snapshot`. A request names its conversation with `session_id` in the body or an
`X-Session-Id` header (the response repeats it in both places); a request without one runs in a
session of its own, closed when it ends (it gets the radix cache's clean prefixes and never
another session's spliced KV).

Threads. The engine runs on one thread that owns the device (`worker.EngineWorker`): requests
reach it as typed commands on a queue; after every engine step it hands each request's newly
sampled tokens to that request's asyncio queue. The HTTP side (FastAPI on uvicorn's event loop)
never touches the engine.

The package, by route: `chat_completions` and `completions` (each a route over the one turn
path, `turn.Turns`), `admin` (health, metrics, models, sessions, snapshots); around them
`schema` and `extensions` (the request bodies), `errors` (OpenAI's error JSON: 4xx naming the
field), `sessions` (the one owner of per-session HTTP state), `history` and `text` (a session's
replies and context edits; tool calls and stop strings in the output), `worker`, `metrics`,
`backend` (model, tokenizer, engine), `app` (wiring, restore and save), `server` (running it).
"""

from serve.http.app import build_app
from serve.http.backend import Backend, load_backend, parse_mesh
from serve.http.errors import APIError
from serve.http.server import ServerThread, free_port, main

__all__ = [
    "APIError",
    "Backend",
    "ServerThread",
    "build_app",
    "free_port",
    "load_backend",
    "main",
    "parse_mesh",
]
