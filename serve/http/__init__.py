"""An OpenAI-compatible HTTP server over the engine, with the edit channel: `python -m
serve.http` (`serve.http.server.main`; `ServerThread` runs it in a thread).

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses` and
Anthropic's `POST /v1/messages` (SSE streaming or not; `POST /v1/messages/count_tokens`), `POST
/tokenize` and `/detokenize`, `GET /v1/models`, `GET /health`, `GET /metrics`, `DELETE
/v1/sessions/{id}`, `POST /v1/snapshot`, `POST /v1/sessions/import`. A request names its
conversation with `session_id` in the body or an `X-Session-Id` header (the response repeats it
in both places); a request without one runs in a session of its own, closed when it ends (it
gets the radix cache's clean prefixes and never another session's spliced KV).

Threads. The engine runs on one thread that owns the device (`worker.EngineWorker`): requests
reach it as typed commands on a queue; after every engine step it hands each request's newly
sampled tokens to that request's asyncio queue. The HTTP side (FastAPI on uvicorn's event loop)
never touches the engine.

The package: a module per route (`chat_completions`, `completions`, `responses`, `messages`,
`tokens`, `admin`) over the one turn path (`turn`); around them the request bodies (`schema`,
`extensions`, `responses_input`, `messages_input`, `body`), `errors` (OpenAI's error JSON, and
Anthropic's on its routes: 4xx naming the field),
`sessions` (the one owner of per-session HTTP state), `history` and `text` (a session's replies
and context edits; tool calls and stop strings in the output), `worker`, `metrics`, `backend`
(model, tokenizer, engine), `app` (wiring, restore and save) and `server` (running it). Each
name is imported from its own module: this package exports none.
"""
