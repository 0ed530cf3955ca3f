"""The one turn path every generating route shares (`Turns`): check the model, size the token
budget, hand the turn to the engine thread, follow its events, and answer, whole (JSON) or
streamed (SSE: a token leaves as soon as the step that sampled it ends). A route supplies the
prompt and a `Reply`, which words the answer in its own objects (chat or text completion).

A client that disconnects mid-stream (or before a non-streaming answer) cancels its turn: the
engine stops working on it at the next step. Past `request_timeout_s` the turn is cancelled and
the answer is a 504. A stop string ends the turn where it is found.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Header, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from leyline_jax.directives import Mode
from serve.engine import RequestError, SamplingParams, TurnCancelled
from serve.http import auth
from serve.http.errors import APIError, unavailable
from serve.http.extensions import SESSION_ID
from serve.http.sessions import TooManySessions
from serve.http.text import OutputText
from serve.http.worker import Job, QueueFull, ShuttingDown

# the X-Session-Id header: names the conversation, like the body's `session_id`
SessionHeader = Annotated[str | None, Header(**SESSION_ID)]


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who asks (the key's tenant: `serve.http.auth`) and the session it names (None: a
    session of its own for this turn)."""

    tenant: str
    name: str | None

    @property
    def key(self) -> str | None:
        """The session's key in `HttpSessions` (its name within the tenant's)."""
        return auth.scoped(self.tenant, self.name)


@dataclasses.dataclass
class Outcome:
    """What a turn's events gave its route."""

    output: list[int] = dataclasses.field(default_factory=list)  # the generated token ids
    stats: object = None  # TurnStats, once the turn ended
    gone: bool = False  # the client went away first
    logprobs: list = dataclasses.field(default_factory=list)  # `Request.logprobs`, if asked
    logprobs_sent: int = 0  # ... of them in the answer so far (a stream's)

    def fresh_logprobs(self) -> tuple[list[int], list]:
        """(the tokens, their log-probability entries) not yet in the answer, now counted in."""
        a = self.logprobs_sent
        self.logprobs_sent = len(self.logprobs)
        return self.output[a : self.logprobs_sent], self.logprobs[a:]


class Reply:
    """How a route words a turn's answer (subclassed per route). `field`: the request field
    an engine error names; `text`, `req` and `key`: the turn's output text, request and
    session name (the `caller`'s), which every answer reports; `head`: the fields every object
    of the answer opens with (`prefix`: its id's, `kind`: its `object`)."""

    field = "messages"
    prefix = kind = ""

    def __init__(self, req, caller: Caller, text: OutputText, model_name: str):
        self.req, self.caller, self.key, self.text = req, caller, caller.name, text
        self.head = {
            "id": f"{self.prefix}-{uuid.uuid4().hex}",
            "object": self.kind,
            "created": int(time.time()),
            "model": model_name,
        }

    def finish_reason(self, output: list[int]) -> str:
        """ "stop" for a stop string or token (not with `ignore_eos`), else "length"."""
        eos = bool(output) and output[-1] in self.text.stop_ids and not self.req.ignore_eos
        stopped = self.text.stopped or eos
        return "stop" if stopped else "length"

    def leyline(self, prompt, output, directives=()) -> dict:
        """The answer's `leyline` object: the session, the token directives the turn carried
        and, when asked, the prompt's and the output's token ids."""
        extra: dict = {"session_id": self.key}
        if directives:
            extra["directives"] = [
                {
                    "start": d.start,
                    "end": d.end,
                    "replacement_tokens": len(d.replacement),
                    "mode": d.mode.name.lower(),
                }
                for d in directives
            ]
        if self.req.options.return_token_ids:
            extra["prompt_token_ids"] = list(prompt)
            extra["output_token_ids"] = list(output)
        return extra

    def opening(self) -> list[dict]:  # SSE events before the first delta
        return []

    def delta(self, text: str, out: Outcome | None = None) -> dict:  # the SSE event carrying
        raise NotImplementedError  # new text (and, where asked, `out`'s fresh log-probabilities)

    def closing(self, out: Outcome) -> list[dict]:  # SSE events after the last delta
        raise NotImplementedError

    def body(self, out: Outcome) -> dict:  # the whole answer
        raise NotImplementedError


def usage(stats, completion: int) -> dict:
    """OpenAI's usage, with ours: reused + spliced = cached, cached + prefilled = prompt."""
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


def session_headers(key: str | None) -> dict:
    return {"X-Session-Id": key} if key is not None else {}


def data(obj) -> dict:
    """One SSE event carrying `obj` as JSON."""
    return {"data": json.dumps(obj, ensure_ascii=False)}


class Turns:
    def __init__(self, backend):
        self.backend, self.worker = backend, backend.worker

    def session(self, req, header: str | None, request: Request) -> Caller:
        """Check the request's model; who asks and the session it names (`session_id` or the
        header)."""
        if req.model != self.backend.model_name:
            served = self.backend.model_name
            why = f"model {req.model!r} does not exist; this server serves {served!r}"
            raise APIError(400, why, "model", code="model_not_found")
        if req.session_id is not None and header is not None and req.session_id != header:
            why = "session_id and the X-Session-Id header name different sessions"
            raise APIError(400, why, "session_id")
        name = req.session_id if req.session_id is not None else header
        return Caller(request.state.tenant, name)

    def sampling(
        self, req, prompt_len: int, asked: int | None, field: str, grammar=None
    ) -> SamplingParams:
        """The turn's sampling, its budget `asked` (None: the server's default, within the
        context) checked against the context left after a `prompt_len`-token prompt."""
        limit = self.backend.max_seq_len
        room = limit - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"the prompt is {prompt_len} tokens; this model's context is {limit}",
                req.prompt_field,
                code="context_length_exceeded",
            )
        if asked is None:
            asked = min(self.backend.default_max_tokens, room)
        elif asked > room:
            raise APIError(
                400,
                f"{field}={asked} with a {prompt_len}-token prompt exceeds the context of "
                f"{limit} tokens",
                field,
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_new_tokens=asked,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed or 0,
            stop_tokens=() if req.ignore_eos else self.backend.tokenizer.stop_tokens,
            grammar=grammar,
            logprobs=req.logprobs_k,
        )

    def start(self, prompt, sampling, req, caller: Caller, directives=()) -> Job:
        """Hand the turn to the engine thread (429 when its queue is full, 503 when it is not
        running). A new session's lineage and salt are the caller's tenant's."""
        loop = asyncio.get_running_loop()
        mode = Mode[req.options.mode.upper()]
        job = Job(prompt, sampling, mode, caller.key, loop, asyncio.Queue(), list(directives))
        job.move, job.lineage = req.options.move, auth.scoped(caller.tenant, req.options.lineage)
        job.salt = auth.salt(caller.tenant, req.cache_salt)
        job.incremental = req.stream or bool(req.stops)  # else nothing to do before the end
        if not self.worker.alive:
            raise unavailable()
        try:
            self.worker.submit(job)
        except QueueFull as e:
            why, retry = f"the server is busy ({e}); retry later", {"Retry-After": "1"}
            raise APIError(429, why, None, "rate_limit_error", "queue_full", retry) from e
        return job

    async def respond(self, job: Job, request: Request, reply: Reply):
        """Follow the turn to its end and answer: `reply.body` as JSON, or (the request asked
        to stream) `reply`'s events as SSE, then `[DONE]`; an error mid-stream is the stream's
        last event before `[DONE]`."""
        if not reply.req.stream:
            out = Outcome()
            async for _ in self._deltas(job, request, reply, out):
                pass
            if out.gone:
                raise APIError(499, "the client went away", None, code="cancelled")
            return JSONResponse(reply.body(out), headers=session_headers(reply.key))

        async def events():
            out = Outcome()
            for ev in reply.opening():
                yield ev
            try:
                async for delta in self._deltas(job, request, reply, out):
                    yield reply.delta(delta, out)
            except APIError as e:
                yield data(e.body())
                yield {"data": "[DONE]"}
                return
            if out.gone:
                return
            for ev in reply.closing(out):
                yield ev
            yield {"data": "[DONE]"}

        return EventSourceResponse(events(), headers=session_headers(reply.key), ping=15)

    async def _events(self, job: Job, request: Request) -> AsyncIterator[tuple]:
        """The job's events; cancels the turn when the client goes away or time runs out."""
        deadline = job.arrived + self.backend.request_timeout_s
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except TimeoutError:
                    if await request.is_disconnected():
                        self.worker.cancel(job)
                        yield ("gone",)
                        return
                    if not self.worker.thread.is_alive():  # events come from it alone
                        raise unavailable() from None
                    if time.perf_counter() > deadline:
                        self.worker.cancel(job)
                        raise APIError(
                            504, "the request timed out", None, "server_error", code="timeout"
                        ) from None
                    continue
                yield ev
                if ev[0] in ("done", "error"):
                    return
        finally:
            if not job.done:
                self.worker.cancel(job)

    async def _deltas(self, job: Job, request: Request, reply: Reply, out: Outcome):
        """The text a turn's output may send so far, delta by delta, as its tokens arrive
        (`out` collects the tokens and the turn's stats). A stop string ends the turn here;
        an engine error raises the APIError for `reply.field`; a client gone sets `out.gone`."""
        text = reply.text
        async for ev in self._events(job, request):
            if ev[0] == "tokens":
                out.output += ev[1]
                out.logprobs += ev[2]
                delta = text.update(out.output)
                if text.stopped:
                    self.worker.cancel(job, stop=True)
                if delta:
                    yield delta
            elif ev[0] == "done":
                out.stats = ev[1]
            elif ev[0] == "gone":
                out.gone = True
                return
            elif not (text.stopped and isinstance(ev[1], TurnCancelled)):
                raise self._engine_error(ev[1], reply.field)
        if out.stats is None:  # cut by a stop string: the engine has ended the turn
            out.stats = job.request.stats

    @staticmethod
    def _engine_error(e: BaseException, field: str) -> APIError:
        if isinstance(e, TurnCancelled):
            return APIError(499, "the request was cancelled", None, code="cancelled")
        if isinstance(e, ShuttingDown):
            return unavailable(str(e))
        if isinstance(e, TooManySessions):
            retry = {"Retry-After": "1"}
            return APIError(429, str(e), None, "rate_limit_error", "too_many_sessions", retry)
        if isinstance(e, (RequestError, ValueError, KeyError)):
            return APIError(400, str(e), getattr(e, "param", field), code="invalid_request")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", None, "server_error")
