"""The FastAPI app: `build_app` wires the error handlers, the request counter and the routes
(each in a module of its own), and restores durable sessions; `restore_sessions` and
`save_at_shutdown` are the two ends of a restart.

Durable sessions (`--snapshot-dir`): restored when the app is built; saved on `POST
/v1/snapshot` by the engine thread between steps, and at shutdown (SIGTERM, SIGINT,
`ServerThread.stop`) once the worker has stopped; through `serve.snapshot`, with the HTTP
sessions' own state (`HttpSessions.export`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI

from serve import forgotten
from serve.http import (
    admin,
    chat_completions,
    completions,
    errors,
    messages,
    responses,
    tokens,
)
from serve.http.auth import Authenticate
from serve.http.backend import Backend
from serve.http.limits import LimitBody
from serve.http.metrics import CountRequests
from serve.http.turn import Turns

log = logging.getLogger("serve.http")


def build_app(backend: Backend) -> FastAPI:
    """The app serving `backend` (start its worker before serving: `ServerThread` and `main`
    do)."""
    app = FastAPI(title="Leyline-JAX", version="0.1.0")
    app.state.backend = backend
    _ = backend.grammars  # built now, before serving (`Backend.grammars`)
    if backend.snapshot_dir is not None:
        restore_sessions(backend)
        # every FORGET logged beside the snapshots: an older snapshot never brings it back
        backend.worker.engine.on_forget = forgotten.Log(backend.snapshot_dir).append
    errors.install(app)
    limits = dict(max_bytes=backend.max_body_bytes, timeout_s=backend.body_timeout_s)
    app.add_middleware(LimitBody, **limits)
    app.add_middleware(Authenticate, tenants=backend.tenants)  # before any body is read
    app.add_middleware(CountRequests, metrics=backend.metrics)  # outermost: counts 401s too
    turns = Turns(backend)
    admin.add_routes(app, backend)
    chat_completions.add_route(app, turns)
    completions.add_route(app, turns)
    responses.add_route(app, turns)
    messages.add_routes(app, turns)
    tokens.add_routes(app, backend)
    return app


def restore_sessions(backend: Backend) -> int:
    """Restore the sessions of the snapshot in `backend.snapshot_dir`, if there is one, into
    its engine (not yet serving): engine sessions (`serve.snapshot.restore`: a snapshot of
    another model or layout is refused with ValueError) and the HTTP sessions' state. Engine
    sessions no HTTP session names (a sessionless request's, in flight when the snapshot was
    taken) are closed. Returns the sessions restored."""
    from serve import snapshot

    engine = backend.worker.engine
    extra = snapshot.restore(engine, backend.snapshot_dir)
    if extra is None:
        return 0
    names = backend.sessions.load(extra)
    for sid in [sid for sid in engine.sessions if sid not in names.values()]:
        engine.close_session(sid)
    log.info("restored %d sessions from %s", len(names), backend.snapshot_dir)
    return len(names)


def save_at_shutdown(backend: Backend) -> Path | None:
    """Snapshot the sessions once the engine worker has stopped (`ServerThread.stop`, and
    `main` after uvicorn returns, on SIGTERM or SIGINT). None without a snapshot dir."""
    if backend.snapshot_dir is None:
        return None
    if backend.worker.thread.is_alive():
        raise RuntimeError("stop the engine worker before the shutdown snapshot")
    path, n = backend.worker.snapshot(backend.snapshot_dir)
    log.info("saved %d sessions to %s", n, path)
    return path
