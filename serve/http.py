"""An OpenAI-compatible HTTP server over the engine, with the edit channel.

    python -m serve.http --model PATH|tiny|smollm2 [--port 8000] [--host 127.0.0.1]
                         [--num-pages 512] [--page-size 16] [--max-seqs 16] [--kv-dtype bf16]
                         [--max-queue 64] [--warmup] [--compile-cache DIR|off]
                         [--snapshot-dir DIR]

Endpoints: `POST /v1/chat/completions` (SSE streaming or not; `tools` rendered in the model's
chat layout by `serve.chat.render`, tool calls in the output parsed back into `tool_calls`),
`POST /v1/completions` (text or token ids), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus text), `DELETE /v1/sessions/{id}`, `POST /v1/snapshot`.

Threads. The engine runs on one thread that owns the device (`EngineWorker`): requests reach it
through a queue of commands (submit, cancel, close); after every engine step it hands each
request's newly sampled tokens to that request's asyncio queue, so streaming is real (a token
leaves as soon as the step that sampled it ends). The HTTP side (FastAPI on uvicorn's event
loop) never touches the engine.

Sessions and the edit channel. A request names its conversation with `session_id` in the body
or an `X-Session-Id` header (the response repeats it in both places). The harness re-sends the
whole history as usual; the server renders it and the engine diffs it against the session's
tokens (`Engine.submit_prompt`, `serve.edits`): an unmodified harness that edits its own
history (clears a tool output, say) gets a splice instead of a re-prefill from the edit on:
AMORTIZE by default, FORGET with `"leyline": {"mode": "forget"}`. A request without a session
runs in a session of its own, closed when it ends: it gets the radix cache's clean prefixes
(what a fresh prefill would give) and never another session's spliced KV (the engine's lineage
rule, `serve.lineage`, unchanged over HTTP).

Usage, in every response (streams: the chunk that finishes, or the extra chunk
`stream_options.include_usage` asks for): `prompt_tokens`, `completion_tokens`,
`prompt_tokens_details.cached_tokens` (reused + spliced), and ours: `reused_tokens`,
`spliced_tokens`, `prefilled_tokens` (cached + prefilled = prompt).

Bad input: OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`) with the
offending field in `param`: 400 for an invalid body, an unknown model, a prompt over the
context limit, token ids outside the vocabulary; 429 with `Retry-After` when the engine's queue
is full, 503 with `Retry-After` while the engine is not running. A client that disconnects
mid-stream (or before a non-streaming answer) cancels its turn: the engine stops working on it
at the next step and a session of its own is closed (its pages go back to the pool).

Explicit directives (`leyline.directives`, message-granular: `MessageDirective`) become token
directives in the rendered history's coordinates (`token_directives`), each spliced in its own
mode; `context_management` (Anthropic's `clear_tool_uses_20250919`) is applied to the history
by `ContextEditor` (`serve.policies.ClearToolUses` over the session's record of what it
cleared) before rendering, and reported in `context_management.applied_edits`.

Durable sessions (`--snapshot-dir`): restored when the app is built; saved on `POST
/v1/snapshot` by the engine thread between steps, and at shutdown (SIGTERM, SIGINT,
`ServerThread.stop`) by the main thread once the worker has stopped; through `serve.snapshot`,
with the HTTP layer's own per-session data (`server_extra`).

Tokenizers. A checkpoint gets `serve.chat.tokenizer_for(path)` (a GGUF file: its own tokenizer
and ChatML; anything else: DeepSeek's tokenizer and layout). A model whose vocabulary is smaller
than its tokenizer's, such as the embedded tiny default (256 ids) with DeepSeek's tokenizer
(129,280), gets `ModVocabTokenizer`: every id the tokenizer makes is taken modulo the model's
vocabulary. The chat layout and its exact per-message spans are kept (DeepSeek's BOS and EOS,
ids 0 and 1, are the tiny model's own); text decodes through the tokenizer's first ids (bytes
and a few specials). Good for exercising the server; the text itself is of course noise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Header, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve import chat
from serve.conversation import (
    ContextEditor,
    ModVocabTokenizer,
    OutputText,
    ReplyMemory,
    edit_messages,
    parse_tool_calls,
    token_directives,
    tool_markers,
)
from serve.engine import TurnCancelled
from serve.openai_api import (
    SESSION_ID,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_param,
)
from serve.worker import EngineWorker, Job, Metrics, QueueFull, SessionBusy, ShuttingDown

log = logging.getLogger("serve.http")

__all__ = ["APIError", "Backend", "ServerThread", "build_app", "free_port", "load_backend", "main"]

DEFAULT_MAX_TOKENS = 256  # chat completions without max_tokens: this, within the context
# the X-Session-Id header: names the conversation, like the body's `session_id`
SessionHeader = Annotated[str | None, Header(**SESSION_ID)]


# ---- the backend: model, tokenizer, engine, worker --------------------------------------------
@dataclasses.dataclass
class Backend:
    """What the app serves: the engine's worker, the tokenizer, the model's public name."""

    worker: EngineWorker
    tokenizer: object
    model_name: str
    max_seq_len: int
    vocab_size: int
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    request_timeout_s: float = 600.0
    snapshot_dir: str | None = None  # durable sessions: restored at start, saved at shutdown
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def metrics(self) -> Metrics:
        return self.worker.metrics

    @classmethod
    def for_engine(cls, engine, tokenizer, model_name: str, *, max_queue: int = 64, **kw):
        vocab = engine.model.config.vocab_size
        if tokenizer.vocab_size > vocab:
            tokenizer = ModVocabTokenizer(tokenizer, vocab)
        worker = EngineWorker(engine, Metrics(), max_queue=max_queue)
        return cls(worker, tokenizer, model_name, engine.state.max_seq_len, vocab, **kw)


def parse_mesh(text: str):
    """ "DATAxMODEL" -> a `leyline_jax.MeshConfig` over the first DATA*MODEL devices."""
    import leyline_jax as ll

    data, sep, model = text.lower().partition("x")
    if not sep or not data.isdigit() or not model.isdigit():
        raise ValueError(f"mesh {text!r} must be DATAxMODEL, e.g. 2x4")
    return ll.MeshConfig.create(data=int(data), model=int(model))


def load_backend(
    model: str = "tiny",
    *,
    root: str = ".checkpoints",
    name: str | None = None,
    num_pages: int = 512,
    page_size: int = 16,
    max_seqs: int = 16,
    kv_dtype: str = "bf16",
    prefill_chunk: int = 256,
    max_queue: int = 64,
    warmup: bool = False,
    mesh: str | None = None,
    **kw,
) -> Backend:
    """Load a model ("tiny": the embedded default, written under `root`; "smollm2"; a
    checkpoint directory or .gguf file), its tokenizer and an engine (not started).
    `mesh`: "DATAxMODEL" (e.g. "2x4") to serve over that device mesh (None: one device)."""
    import jax.numpy as jnp

    import leyline_jax as ll
    from serve.engine import Engine

    if model == "tiny":
        from checkpoints.tiny import ensure_default_checkpoints

        path = str(ensure_default_checkpoints(root)["deepseek_v3"])
        tokenizer = chat.ChatTokenizer()
    else:
        path = chat.model_path(model)
        tokenizer = chat.tokenizer_for(path)
    grid = None if mesh is None else parse_mesh(mesh)
    m = ll.load_model(path, mesh=grid)  # each param placed on its shards as it is read
    dtypes = {
        "bf16": jnp.bfloat16,
        "fp32": jnp.float32,
        "float32": jnp.float32,
        "bfloat16": jnp.bfloat16,
    }
    engine = Engine(
        m,
        num_pages=num_pages,
        page_size=page_size,
        max_seqs=max_seqs,
        kv_dtype=dtypes[kv_dtype],
        prefill_chunk=prefill_chunk,
        mesh=grid,
    )
    if warmup:
        engine.warmup()
    served = name or (model if model in ("tiny", "smollm2") else Path(path).name)
    return Backend.for_engine(engine, tokenizer, served, max_queue=max_queue, **kw)


# ---- the app --------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers


def _usage(stats, completion: int) -> dict:
    cached = stats.reused_tokens + stats.spliced_tokens
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": stats.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "reused_tokens": stats.reused_tokens,
        "spliced_tokens": stats.spliced_tokens,
        "prefilled_tokens": stats.prefilled_tokens,
    }


class _CountRequests:
    """ASGI middleware counting requests by route and status (pure ASGI: streaming and
    disconnects pass through untouched)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 0}

        async def send_(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(path, str(status["code"])).inc()


@dataclasses.dataclass
class Turn:
    """A chat request as the engine runs it."""

    prompt: list[int]  # the rendered history as sent (replies' sampled ids in place)
    directives: list  # explicit edits, token directives in `prompt`'s coordinates
    use_tools: bool
    applied_edits: list[dict] | None  # context_management's report (None: not asked)

    @property
    def final(self) -> list[int]:
        """The prompt the model runs: `prompt` with the directives applied."""
        from leyline_jax.directives import apply_to_list

        return apply_to_list(self.prompt, self.directives)


@dataclasses.dataclass
class Outcome:
    """What a turn's event stream gave its handler (`deltas`)."""

    output: list[int] = dataclasses.field(default_factory=list)  # the generated token ids
    stats: object = None  # TurnStats, once the turn ended
    gone: bool = False  # the client went away first


def server_extra(app) -> dict:
    """The HTTP layer's own per-session data a snapshot keeps (event-loop thread): each
    session's replies' sampled ids and what context editing cleared."""
    return {
        "replies": app.state.replies.export(),
        "cleared": {k: sorted(v) for k, v in app.state.context.cleared.items()},
    }


def restore_sessions(app) -> int:
    """Restore the sessions of the snapshot in `backend.snapshot_dir`, if there is one, into
    the app's engine (not yet serving): engine sessions (`serve.snapshot.restore`: a snapshot
    of another model or layout is refused with ValueError), their HTTP names, replies and
    context-editing records. Engine sessions no HTTP session names (a sessionless request's,
    in flight when the snapshot was taken) are closed. Returns the sessions restored."""
    from serve import snapshot

    b = app.state.backend
    engine = b.worker.engine
    extra = snapshot.restore(engine, b.snapshot_dir)
    if extra is None:
        return 0
    names = {str(k): int(v) for k, v in extra.get("http_sessions", {}).items()}
    for sid in [sid for sid in engine.sessions if sid not in names.values()]:
        engine.close_session(sid)
    b.worker.sessions = names
    app.state.replies.load(extra.get("replies", {}))
    app.state.context.cleared = {str(k): set(v) for k, v in extra.get("cleared", {}).items()}
    log.info("restored %d sessions from %s", len(names), b.snapshot_dir)
    return len(names)


def save_at_shutdown(app) -> Path | None:
    """Snapshot the sessions once the engine worker has stopped (`ServerThread.stop`, and
    `main` after uvicorn returns, on SIGTERM or SIGINT). None without a snapshot dir."""
    b = app.state.backend
    if b.snapshot_dir is None:
        return None
    if b.worker.thread.is_alive():
        raise RuntimeError("stop the engine worker before the shutdown snapshot")
    path = b.worker.snapshot(b.snapshot_dir, server_extra(app))
    log.info("saved %d sessions to %s", len(b.worker.sessions), path)
    return path


def build_app(backend: Backend):
    """The FastAPI app serving `backend` (start its worker before serving: `ServerThread` and
    `main` do)."""
    from leyline_jax.directives import Mode
    from serve.engine import RequestError
    from serve.sampling import SamplingParams

    app = FastAPI(title="Leyline-JAX", version="0.1.0")
    app.state.backend = backend
    tok, metrics, worker = backend.tokenizer, backend.metrics, backend.worker
    replies = app.state.replies = ReplyMemory()
    context = app.state.context = ContextEditor(lambda text: len(tok.encode(text)))
    if backend.snapshot_dir is not None:
        restore_sessions(app)

    def error_response(
        status, message, param=None, type_="invalid_request_error", code=None, headers=None
    ):
        return JSONResponse(
            error_body(message, param=param, type_=type_, code=code),
            status_code=status,
            headers=headers,
        )

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.type, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": ("body",), "msg": "invalid body"}
        param = validation_param(first.get("loc", ("body",)))
        if first.get("type") == "json_invalid":  # the location is a character offset
            param = "body"
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        return error_response(400, f"{param}: {msg}{more}", param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # what the framework refused before any field was read: the path (no such
        # endpoint), the method, or the body itself (not JSON, not UTF-8)
        param = {404: "path", 405: "method"}.get(e.status_code, "body")
        return error_response(
            e.status_code, str(e.detail), param, type_, headers=getattr(e, "headers", None)
        )

    app.add_middleware(_CountRequests, metrics=metrics)

    # -- helpers ------------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != backend.model_name:
            raise APIError(
                400,
                f"model {name!r} does not exist; this server serves {backend.model_name!r}",
                "model",
                code="model_not_found",
            )

    def session_key(body_id: str | None, header_id: str | None) -> str | None:
        if body_id is not None and header_id is not None and body_id != header_id:
            raise APIError(
                400, "session_id and the X-Session-Id header name different sessions", "session_id"
            )
        return body_id if body_id is not None else header_id

    def sampling_for(req, prompt_len: int, asked: int | None, field: str) -> SamplingParams:
        room = backend.max_seq_len - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"the prompt is {prompt_len} tokens; this model's context is {backend.max_seq_len}",
                "messages" if field != "prompt" else "prompt",
                code="context_length_exceeded",
            )
        if asked is None:
            asked = min(backend.default_max_tokens, room)
        elif asked > room:
            raise APIError(
                400,
                f"{field}={asked} with a {prompt_len}-token prompt exceeds "
                f"the context of {backend.max_seq_len} tokens",
                field,
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_new_tokens=asked,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed or 0,
            stop_tokens=() if req.ignore_eos else tok.stop_tokens,
        )

    def unavailable(why: str = "the engine is not running") -> APIError:
        return APIError(
            503, why, None, "server_error", code="unavailable", headers={"Retry-After": "5"}
        )

    def require_engine() -> None:
        if not worker.alive:
            raise unavailable()

    async def engine_call(put) -> object:
        """Run a command on the engine thread (`put(loop, fut)` queues it); its result. The
        engine answers between steps; a worker that stopped meanwhile is a 503."""
        require_engine()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        put(loop, fut)
        while True:
            done, _ = await asyncio.wait({fut}, timeout=1.0)
            if done:
                return fut.result()
            if not worker.thread.is_alive():
                raise unavailable()

    def start_job(prompt, sampling, req, key, directives=()) -> Job:
        mode = Mode[req.options.mode.upper()]
        loop = asyncio.get_running_loop()
        job = Job(prompt, sampling, mode, key, loop, asyncio.Queue(), list(directives))
        job.move, job.lineage = req.options.move, req.options.lineage
        job.incremental = req.stream or bool(req.stops)  # else nothing to do before the end
        require_engine()
        try:
            worker.submit(job)
        except QueueFull as e:
            raise APIError(
                429,
                f"the server is busy ({e}); retry later",
                None,
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from e
        return job

    def engine_error(e: BaseException, field: str) -> APIError:
        if isinstance(e, TurnCancelled):
            return APIError(499, "the request was cancelled", None, code="cancelled")
        if isinstance(e, ShuttingDown):
            return unavailable(str(e))
        if isinstance(e, (RequestError, ValueError, KeyError)):
            return APIError(400, str(e), field, code="invalid_request")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", None, "server_error")

    async def events(job: Job, request: Request) -> AsyncIterator[tuple]:
        """The job's events; cancels the turn when the client goes away or time runs out."""
        deadline = job.arrived + backend.request_timeout_s
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except TimeoutError:
                    if await request.is_disconnected():
                        worker.cancel(job)
                        yield ("gone",)
                        return
                    if not worker.thread.is_alive():  # events come from it alone
                        raise unavailable() from None
                    if time.perf_counter() > deadline:
                        worker.cancel(job)
                        raise APIError(
                            504, "the request timed out", None, "server_error", code="timeout"
                        ) from None
                    continue
                yield ev
                if ev[0] in ("done", "error"):
                    return
        finally:
            if not job.done:
                worker.cancel(job)

    async def deltas(job: Job, request: Request, text: OutputText, field: str, out: Outcome):
        """The text a turn's output may send so far, delta by delta, as its tokens arrive
        (`out` collects the tokens and the turn's stats). A stop string ends the turn here;
        an engine error raises the APIError for `field`; a client gone sets `out.gone`."""
        async for ev in events(job, request):
            if ev[0] == "tokens":
                out.output += ev[1]
                delta = text.update(out.output)
                if text.stopped:
                    worker.cancel(job)
                if delta:
                    yield delta
            elif ev[0] == "done":
                out.stats = ev[1]
            elif ev[0] == "gone":
                out.gone = True
                return
            elif not (text.stopped and isinstance(ev[1], TurnCancelled)):
                raise engine_error(ev[1], field)
        if out.stats is None:  # cut by a stop string: the engine has ended the turn
            out.stats = job.request.stats

    def sse_error(e: APIError) -> list[dict]:
        """A stream's last events after an error: the error object, then [DONE]."""
        body = error_body(e.message, param=e.param, type_=e.type, code=e.code)
        return [{"data": json.dumps(body)}, {"data": "[DONE]"}]

    def render_chat(req: ChatCompletionRequest, key: str | None) -> Turn:
        """The request's history as the engine gets it: server-side context editing first
        (`context_management`), then the rendered history and the explicit directives
        (`leyline.directives`) as token directives in its coordinates."""
        messages = [m.as_chat_dict() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        applied = None
        if req.context_management is not None:
            applied = []
            for edit in req.context_management.edits:
                messages, report = context.apply(key, messages, edit)
                if report["cleared_tool_uses"]:
                    applied.append(report)
        mds = req.options.directives
        for k, d in enumerate(mds):
            if d.messages[1] >= len(messages):
                raise APIError(
                    400,
                    f"leyline.directives.{k}.messages: {list(d.messages)} is out of range for "
                    f"{len(messages)} messages",
                    f"leyline.directives.{k}.messages",
                )
        try:
            r = chat.render(tok, messages, tools)
            edited = edit_messages(messages, mds) if mds else messages
            final = chat.render(tok, edited, tools) if mds else r
        except (KeyError, ValueError, TypeError) as e:
            raise APIError(400, f"messages: cannot render: {e}", "messages") from e
        prompt = replies.substitute(key, messages, r)
        ds = []
        if mds:
            target = replies.substitute(key, edited, final)
            ds = token_directives(prompt, target, mds, Mode[req.options.mode.upper()])
        use_tools = bool(req.tools) and req.tool_choice != "none"
        return Turn(prompt.tokens, ds, use_tools, applied)

    def remember_reply(key, text: OutputText, output, calls) -> None:
        """Keep the reply's sampled ids for the session's next render (a reply cut by a stop
        string or carrying tool calls is re-sent otherwise: not kept)."""
        if key is None or calls or text.stopped:
            return
        ids = list(output[:-1] if output and output[-1] in tok.stop_tokens else output)
        replies.remember(key, text.text, ids)

    def leyline_extra(req, key, prompt, output, turn: Turn | None = None) -> dict:
        extra = {"session_id": key}
        if turn is not None and turn.directives:
            extra["directives"] = [
                {
                    "start": d.start,
                    "end": d.end,
                    "replacement_tokens": len(d.replacement),
                    "mode": d.mode.name.lower(),
                }
                for d in turn.directives
            ]
        if req.options.return_token_ids:
            extra["prompt_token_ids"] = list(prompt)
            extra["output_token_ids"] = list(output)
        return extra

    def session_headers(key):
        return {"X-Session-Id": key} if key is not None else {}

    # -- endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not worker.alive:
            return error_response(
                503, "the engine is not running", None, "server_error", headers={"Retry-After": "5"}
            )
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": backend.model_name,
                    "object": "model",
                    "created": backend.created,
                    "owned_by": "leyline-jax",
                    "max_model_len": backend.max_seq_len,
                }
            ],
        }

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(session_id: str = PathParam(**SESSION_ID)):
        err = await engine_call(lambda loop, fut: worker.close_session(session_id, loop, fut))
        if isinstance(err, KeyError):
            raise APIError(
                404,
                f"no session {session_id!r}",
                "session_id",
                "not_found_error",
                code="session_not_found",
            )
        if isinstance(err, SessionBusy):
            raise APIError(409, str(err), "session_id", code="session_busy")
        if err is not None:
            raise APIError(500, f"closing the session failed: {err}", None, "server_error")
        replies.forget(session_id)
        context.forget(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/snapshot")
    async def take_snapshot():
        """Save every session now (as at shutdown): admin."""
        if backend.snapshot_dir is None:
            raise APIError(
                409,
                "this server was started without --snapshot-dir",
                "snapshot_dir",
                code="no_snapshot_dir",
            )
        extra = server_extra(app)
        result = await engine_call(
            lambda loop, fut: worker.request_snapshot(backend.snapshot_dir, extra, loop, fut)
        )
        if isinstance(result, BaseException):
            raise APIError(500, f"the snapshot failed: {result}", None, "server_error")
        path, sessions = result
        return {"object": "snapshot", "path": str(path), "sessions": sessions}

    @app.post("/v1/chat/completions")
    async def chat_completions(
        req: ChatCompletionRequest,
        request: Request,
        x_session_id: SessionHeader = None,
    ):
        check_model(req.model)
        key = session_key(req.session_id, x_session_id)
        if (why := req.tool_choice_error()) is not None:
            raise APIError(400, why, "tool_choice")
        turn = render_chat(req, key)
        prompt, use_tools = turn.final, turn.use_tools
        asked, field = req.max_new
        sampling = sampling_for(req, len(prompt), asked, field)
        job = start_job(turn.prompt, sampling, req, key, turn.directives)
        text = OutputText(tok, tok.stop_tokens, req.stops, tool_markers(tok) if use_tools else ())
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": backend.model_name,
        }

        def finish_reason(output, calls) -> str:
            if calls:
                return "tool_calls"
            if text.stopped or (output and output[-1] in tok.stop_tokens):
                return "stop"
            return "length"

        if not req.stream:
            out = Outcome()
            async for _ in deltas(job, request, text, "messages", out):
                pass
            if out.gone:
                raise APIError(499, "the client went away", None, code="cancelled")
            output, stats = out.output, out.stats
            text.update(output, final=True)
            content, calls = parse_tool_calls(text.text) if use_tools else (text.text, [])
            remember_reply(key, text, output, calls)
            message = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            body = {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": backend.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": finish_reason(output, calls),
                    }
                ],
                "usage": _usage(stats, len(output)),
                "session_id": key,
                "leyline": leyline_extra(req, key, prompt, output, turn),
            }
            if turn.applied_edits is not None:
                body["context_management"] = {"applied_edits": turn.applied_edits}
            return JSONResponse(body, headers=session_headers(key))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta, finish=None, usage=None, choices=True) -> dict:
            c = dict(base)
            c["choices"] = (
                [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
                if choices
                else []
            )
            if usage is not None:
                c["usage"] = usage
            return {"data": json.dumps(c, ensure_ascii=False)}

        async def stream():
            out = Outcome()
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for delta in deltas(job, request, text, "messages", out):
                    yield chunk({"content": delta})
            except APIError as e:
                for ev in sse_error(e):
                    yield ev
                return
            if out.gone:
                return
            output, stats = out.output, out.stats
            delta = text.update(output, final=True)
            if delta:
                yield chunk({"content": delta})
            calls = []
            if use_tools:
                _, calls = parse_tool_calls(text.text)
                if calls:
                    yield chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]})
                elif len(text.text) > text.sent:  # held back at a marker, but no call parsed:
                    yield chunk({"content": text.text[text.sent :]})  # content, as unstreamed
            remember_reply(key, text, output, calls)
            usage = _usage(stats, len(output))
            fin = finish_reason(output, calls)
            if include_usage:
                yield chunk({}, fin)
                last = chunk({}, usage=usage, choices=False)
            else:
                last = chunk({}, fin, usage=usage)
            d = json.loads(last["data"])
            d["leyline"] = leyline_extra(req, key, prompt, output, turn)
            if turn.applied_edits is not None:
                d["context_management"] = {"applied_edits": turn.applied_edits}
            yield {"data": json.dumps(d, ensure_ascii=False)}
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), headers=session_headers(key), ping=15)

    @app.post("/v1/completions")
    async def completions(
        req: CompletionRequest,
        request: Request,
        x_session_id: SessionHeader = None,
    ):
        check_model(req.model)
        key = session_key(req.session_id, x_session_id)
        if isinstance(req.prompt, str):
            prompt = tok.encode(req.prompt)
            if not prompt:
                raise APIError(400, "prompt: the text encodes to no token", "prompt")
        else:
            prompt = list(req.prompt)
            bad = [t for t in prompt if t >= backend.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"prompt: token id {bad[0]} is outside the vocabulary "
                    f"[0, {backend.vocab_size})",
                    "prompt",
                )
        sampling = sampling_for(req, len(prompt), req.max_tokens, "max_tokens")
        job = start_job(prompt, sampling, req, key)
        text = OutputText(tok, tok.stop_tokens, req.stops, ())
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def finish_reason(output) -> str:
            if text.stopped or (output and output[-1] in tok.stop_tokens):
                return "stop"
            return "length"

        def body(choices, usage=None, extra=None) -> dict:
            b = {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": backend.model_name,
                "choices": choices,
            }
            if usage is not None:
                b["usage"] = usage
            if extra is not None:
                b["session_id"] = key
                b["leyline"] = extra
            return b

        def choice(t, finish=None):
            return {"index": 0, "text": t, "logprobs": None, "finish_reason": finish}

        if not req.stream:
            out = Outcome()
            async for _ in deltas(job, request, text, "prompt", out):
                pass
            if out.gone:
                raise APIError(499, "the client went away", None, code="cancelled")
            output = out.output
            text.update(output, final=True)
            return JSONResponse(
                body(
                    [choice(text.text, finish_reason(output))],
                    _usage(out.stats, len(output)),
                    leyline_extra(req, key, prompt, output),
                ),
                headers=session_headers(key),
            )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream():
            out = Outcome()
            try:
                async for delta in deltas(job, request, text, "prompt", out):
                    yield {"data": json.dumps(body([choice(delta)]))}
            except APIError as e:
                for ev in sse_error(e):
                    yield ev
                return
            if out.gone:
                return
            output = out.output
            usage = _usage(out.stats, len(output))
            extra = leyline_extra(req, key, prompt, output)
            delta = text.update(output, final=True)
            fin = finish_reason(output)
            if include_usage:
                yield {"data": json.dumps(body([choice(delta, fin)]))}
                yield {"data": json.dumps(body([], usage, extra))}
            else:
                yield {"data": json.dumps(body([choice(delta, fin)], usage, extra))}
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), headers=session_headers(key), ping=15)

    return app


# ---- running it -----------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `backend` in a thread of this process (tests, benchmarks); the engine
    worker starts with it and stops with it."""

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        self.backend, self.host = backend, host
        self.port = port or free_port(host)
        self.app = build_app(backend)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=self.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.backend.worker.start()
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > timeout or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.backend.worker.stop()
        save_at_shutdown(self.app)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (the embedded default), smollm2, a checkpoint dir or .gguf file",
    )
    ap.add_argument("--served-model-name", default=None, help="the model's id in the API")
    ap.add_argument("--root", default=".checkpoints", help="where the tiny default lives")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument(
        "--max-queue", type=int, default=64, help="requests in flight before 429 (Retry-After)"
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="a chat completion's budget when the request sets none",
    )
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--warmup", action="store_true", help="compile every step shape first")
    ap.add_argument(
        "--mesh",
        default=None,
        help="serve over a DATAxMODEL device mesh, e.g. 2x4 (default: one device)",
    )
    ap.add_argument(
        "--snapshot-dir",
        default=None,
        help="durable sessions: restore them from DIR at start, save them there on shutdown "
        "(SIGTERM, SIGINT) and on POST /v1/snapshot",
    )
    ap.add_argument(
        "--compile-cache",
        default=None,
        help="keep compiled programs in DIR (default: serve.compile_cache's; off)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from serve import compile_cache

    compile_cache.enable(args.compile_cache)
    backend = load_backend(
        args.model,
        root=args.root,
        name=args.served_model_name,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_seqs=args.max_seqs,
        kv_dtype=args.kv_dtype,
        prefill_chunk=args.prefill_chunk,
        max_queue=args.max_queue,
        warmup=args.warmup,
        mesh=args.mesh,
        default_max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        snapshot_dir=args.snapshot_dir,
    )
    import uvicorn

    app = build_app(backend)
    backend.worker.start()
    log.info(
        "serving %s on http://%s:%d (pid %d)", backend.model_name, args.host, args.port, os.getpid()
    )
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, puts back the handlers it found and
    # raises the signal again: these handlers then let the shutdown snapshot run and the
    # process exit 0 (a signal during the snapshot itself is ignored: it completes)
    stops: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stops.append(signum))
    try:
        # requests still running get 10 s to finish, then the worker fails what is left (503)
        uvicorn.run(
            app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=10
        )
    finally:
        backend.worker.stop()
        save_at_shutdown(app)


if __name__ == "__main__":
    main()
