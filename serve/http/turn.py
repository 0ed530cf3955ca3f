"""The one turn path every generating route shares (`Turns`): check the model, size the token
budget, hand the turn to the engine thread, follow its events, and answer, whole (JSON) or
streamed (SSE: a token leaves as soon as the step that sampled it ends). A route supplies the
prompt and a `Reply` (`serve.http.reply`), which words the answer in its own objects.

A client that disconnects mid-stream (or before a non-streaming answer) cancels its turn: the
engine stops working on it at the next step. Past `request_timeout_s` the turn is cancelled and
the answer is a 504. A stop string ends the turn where it is found.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Header, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from leyline_jax.directives import Mode
from serve.engine import RequestError, SamplingParams, TurnCancelled
from serve.http import auth
from serve.http.auth import Caller
from serve.http.commands import Done, Event, Failed, Gone, Job, Tokens
from serve.http.errors import APIError, unavailable
from serve.http.extensions import SESSION_ID
from serve.http.reply import Outcome, Reply
from serve.http.sessions import TooManySessions
from serve.http.worker import QueueFull, ShuttingDown

# the X-Session-Id header: names the conversation, like the body's `session_id`
SessionHeader = Annotated[str | None, Header(**SESSION_ID)]


def session_headers(key: str | None) -> dict:
    return {"X-Session-Id": key} if key is not None else {}


class Turns:
    def __init__(self, backend):
        self.backend, self.worker = backend, backend.worker

    def session(self, req, header: str | None, tenant: str) -> Caller:
        """Check the request's model; `tenant` asking and the session it names (`session_id`
        or the header)."""
        if req.model != self.backend.model_name:
            served = self.backend.model_name
            why = f"model {req.model!r} does not exist; this server serves {served!r}"
            raise APIError(400, why, "model", code="model_not_found")
        if req.session_id is not None and header is not None and req.session_id != header:
            why = "session_id and the X-Session-Id header name different sessions"
            raise APIError(400, why, "session_id")
        name = req.session_id if req.session_id is not None else header
        return Caller(tenant, name)

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
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
        )

    def start(self, prompt, sampling, req, caller: Caller, directives=()) -> Job:
        """Hand the turn to the engine thread (429 when its queue is full, 503 when it is not
        running). A new session's lineage and salt are the caller's tenant's."""
        loop = asyncio.get_running_loop()
        mode = Mode[req.options.mode.upper()]
        job = Job(prompt, sampling, mode, caller.key, loop, asyncio.Queue(), list(directives))
        job.move, job.lineage = req.options.move, auth.scoped(caller.tenant, req.options.lineage)
        job.recompute = req.options.recompute
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
        to stream) `reply`'s events as SSE, then its `end` (`[DONE]`); an error mid-stream is
        the stream's last event before its end."""
        if not reply.req.stream:
            out = Outcome()
            async for _ in self.deltas(job, request, reply, out):
                pass
            if out.gone:
                raise APIError(499, "the client went away", None, code="cancelled")
            return JSONResponse(reply.body(out), headers=session_headers(reply.key))

        async def events():
            out = Outcome()
            for ev in reply.opening():
                yield ev
            try:
                async for delta in self.deltas(job, request, reply, out):
                    for ev in reply.deltas(delta, out):
                        yield ev
            except APIError as e:
                for ev in [reply.error(e), *reply.end()]:
                    yield ev
                return
            if out.gone:
                return
            for ev in [*reply.closing(out), *reply.end()]:
                yield ev

        return EventSourceResponse(events(), headers=session_headers(reply.key), ping=15)

    async def _events(self, job: Job, request: Request) -> AsyncIterator[Event]:
        """The job's events through its last (`Done`, `Failed`, or `Gone` when the client went
        away); cancels the turn when the client goes away or time runs out."""
        deadline = job.arrived + self.backend.request_timeout_s
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except TimeoutError:
                    if await request.is_disconnected():
                        self.worker.cancel(job)
                        yield Gone()
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
                if isinstance(ev, (Done, Failed)):
                    return
        finally:
            if not job.done:
                self.worker.cancel(job)

    async def deltas(self, job: Job, request: Request, reply: Reply, out: Outcome):
        """The text a turn's output may send so far, delta by delta, as its tokens arrive
        (`out` collects the tokens and the turn's stats). A stop string ends the turn here;
        an engine error raises the APIError for `reply.field`; a client gone sets `out.gone`."""
        text = reply.text
        async for ev in self._events(job, request):
            match ev:
                case Tokens(ids, logprobs):
                    out.output += ids
                    out.logprobs += logprobs
                    delta = text.update(out.output)
                    if text.stopped:
                        self.worker.cancel(job, stop=True)
                    if delta:
                        yield delta
                case Done(stats):
                    out.stats = stats
                case Gone():
                    out.gone = True
                    return
                case Failed(error) if not (text.stopped and isinstance(error, TurnCancelled)):
                    raise self._engine_error(error, reply.field)
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
