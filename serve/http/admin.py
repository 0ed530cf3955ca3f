"""The routes around the turns: `GET /health`, `GET /metrics` (Prometheus text), `GET
/v1/models` and `GET /v1/models/{id}`, `DELETE /v1/sessions/{id}` (close a session: 404
unknown, 409 a turn in flight), `POST /v1/snapshot` (save every session now, as at
shutdown; 409 without `--snapshot-dir`) and `POST /v1/sessions/import` (`snapshot_dir`:
another server's snapshot, its sessions taken beside these, with their KV: a drained
replica's sessions moved here; a name already here keeps its own); the last two need an admin
key when the server has keys (`serve.http.auth`). A session is the caller's tenant's:
another tenant's of the same name is not found."""

from __future__ import annotations

import asyncio

from fastapi import Path as PathParam
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from serve.http import body
from serve.http.auth import scoped
from serve.http.commands import Answer, Close, Import, Snapshot
from serve.http.errors import APIError, unavailable
from serve.http.extensions import SESSION_ID, Closed
from serve.http.worker import SessionBusy
from serve.multihost import Lockstep


async def engine_call(worker, make) -> object:
    """Run a command on the engine thread (`make(answer)` builds it) and await its result.
    The engine answers between steps; a worker that stopped meanwhile is a 503."""
    if not worker.alive:
        raise unavailable()
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    worker.commands.put(make(Answer(loop, fut)))
    while True:
        done, _ = await asyncio.wait({fut}, timeout=1.0)
        if done:
            return fut.result()
        if not worker.thread.is_alive():
            raise unavailable()


class ImportBody(Closed):
    snapshot_dir: str = Field(min_length=1, max_length=4096)  # a snapshot another server took


def add_routes(app, backend) -> None:
    worker, metrics = backend.worker, backend.metrics

    @app.get("/health")
    async def health():
        if not worker.alive:
            why = "the engine is not running"
            return APIError(503, why, None, "server_error", headers={"Retry-After": "5"}).response()
        warming = worker.warming  # None once every shape is compiled
        if warming is not None:
            st = warming.status()
            why = f"warming up: {st['compiled']} of {st['total']} shapes compiled"
            return APIError(503, why, None, "server_error", headers={"Retry-After": "5"}).response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model() -> dict:
        return {
            "id": backend.model_name,
            "object": "model",
            "created": backend.created,
            "owned_by": "leyline-jax",
            "max_model_len": backend.max_seq_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str = PathParam(min_length=1, max_length=256)):
        if model_id != backend.model_name:
            why = f"model {model_id!r} does not exist; this server serves {backend.model_name!r}"
            raise APIError(404, why, "model", "not_found_error", code="model_not_found")
        return model()

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(request: Request, session_id: str = PathParam(**SESSION_ID)):
        key = scoped(request.state.tenant, session_id)
        err = await engine_call(worker, lambda answer: Close(key, answer))
        if isinstance(err, KeyError):
            why = f"no session {session_id!r}"
            raise APIError(404, why, "session_id", "not_found_error", code="session_not_found")
        if isinstance(err, SessionBusy):
            raise APIError(409, str(err), "session_id", code="session_busy")
        if err is not None:
            raise APIError(500, f"closing the session failed: {err}", None, "server_error")
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/snapshot")
    async def take_snapshot(request: Request):
        backend.tenants.check_admin(request.headers.get("authorization"))
        if backend.snapshot_dir is None:
            why = "this server was started without --snapshot-dir"
            raise APIError(409, why, "snapshot_dir", code="no_snapshot_dir")
        root = backend.snapshot_dir
        result = await engine_call(worker, lambda answer: Snapshot(root, answer))
        if isinstance(result, BaseException):
            raise APIError(500, f"the snapshot failed: {result}", None, "server_error")
        path, sessions = result
        return {"object": "snapshot", "path": str(path), "sessions": sessions}

    @app.post("/v1/sessions/import", openapi_extra=body.documented(app, ImportBody))
    async def import_sessions(request: Request):
        received = await body.received(request)
        req = await body.in_thread(received.parse, ImportBody)  # off the event loop
        backend.tenants.check_admin(request.headers.get("authorization"))
        if isinstance(worker.engine, Lockstep):  # the followers' engines would not follow
            why = "a multi-process group does not import another server's snapshot"
            raise APIError(409, why, "snapshot_dir", code="no_snapshot_dir")
        result = await engine_call(worker, lambda answer: Import(req.snapshot_dir, answer))
        if isinstance(result, BaseException):
            why = f"snapshot_dir: cannot import: {result}"
            raise APIError(400, why, "snapshot_dir", code="import_failed")
        return {"object": "session.import", "sessions": result}
