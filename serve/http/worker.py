"""The engine's thread for the HTTP server: it alone touches the engine.

Requests reach it as typed commands on a queue (`Submit`, `Cancel`, `Close`, `Snapshot`,
`Import`: `serve.http.commands`); after every engine step it hands each request's newly sampled
tokens to that request's asyncio queue as typed events (`Job.post`: `Tokens`, then `Done` or
`Failed`), and it keeps the server's metrics. A command that fails fails alone (its
caller gets the error), never the thread; an engine step that raises fails what is in flight
and the thread keeps serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from serve.engine import TurnCancelled
from serve.http.auth import SaltChanged
from serve.http.commands import (
    Answer,
    Cancel,
    Close,
    Done,
    Failed,
    Import,
    Job,
    Snapshot,
    Submit,
    Tokens,
    Wake,
)
from serve.http.metrics import Metrics
from serve.http.sessions import HttpSessions, TooManySessions

log = logging.getLogger("serve.http")


class QueueFull(RuntimeError):
    """As many requests are in flight as the server takes."""


class ShuttingDown(RuntimeError):
    """The server stops: the turn did not finish (retry later, after the restart)."""


class SessionBusy(RuntimeError):
    """A session with a turn in flight cannot be closed."""


class EngineWorker:
    """The thread that owns the engine. Everything else talks to it through `commands`."""

    def __init__(self, engine, metrics: Metrics, sessions: HttpSessions, max_queue: int = 64):
        self.engine, self.metrics, self.sessions = engine, metrics, sessions
        self.max_queue = max_queue
        self.commands: queue.Queue = queue.Queue()
        self.jobs: list[Job] = []  # submitted, not yet ended (engine thread only)
        self.pending = 0  # jobs accepted and not yet ended (guarded by _lock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.warming = None  # shapes to compile (`Engine.warmup_plan`), one at a time when idle
        self._next_expiry = 0.0  # when `_expire` looks at the sessions next
        self.warmed = None  # called once the warmup ends (`serve.http.server.freeze_heap`)
        self.thread = threading.Thread(target=self._run, name="leyline-engine", daemon=True)

    # -- called from the HTTP side ------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the step in flight (waits for it: a step ends); turns still in flight
        fail with `ShuttingDown`, their sessions keeping what they did."""
        self._stop.set()
        self.commands.put(Wake())
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stop.is_set()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.pending >= self.max_queue:
                raise QueueFull(f"{self.pending} requests in flight (the limit)")
            self.pending += 1
        self.commands.put(Submit(job))

    def cancel(self, job: Job, *, stop: bool = False) -> None:
        """End the job's turn: cancelled, or (`stop`: a stop string was found) finished."""
        if not job.done:
            job.cancelled = not stop
            self.commands.put(Cancel(job, stop))

    def snapshot(self, root, answer: Answer | None = None) -> tuple[Path, int] | None:
        """Save the engine's sessions under `root` with the HTTP sessions' own state; (its
        directory, how many HTTP sessions). On the engine thread between steps, or once it
        stopped. With `answer`: captured now (`serve.snapshot.capture`), written on a thread
        of its own while the engine steps on, the result to `answer`."""
        from serve import snapshot

        extra = self.sessions.export()
        write, n = snapshot.capture(self.engine, root, extra), len(extra["http_sessions"])
        if answer is None:
            return write(), n

        def run():
            try:
                answer((write(), n))
            except Exception as e:
                answer(e)

        threading.Thread(target=run, name="leyline-snapshot").start()
        return None

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                block = eng.idle() and not self.jobs and self.warming is None
                cmd = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
                self._handle(cmd)
                while True:
                    self._handle(self.commands.get_nowait())
            except queue.Empty:
                pass
            try:
                self._expire()
                if not eng.idle():
                    t0 = time.perf_counter()
                    eng.step()
                    self.metrics.step.observe(time.perf_counter() - t0)
                elif self.warming is not None:
                    self._warm()
                self._publish()
            except Exception as e:  # an engine bug: fail what is in flight, keep serving
                log.exception("engine step failed")
                self.error = e
                self._fail_all(e)
        self._fail_all(ShuttingDown("the server is shutting down; retry later"))
        while True:  # answer what is still queued, so no caller waits for ever
            try:
                self._handle(self.commands.get_nowait())
            except queue.Empty:
                break

    def _warm(self) -> None:
        try:  # a shape that fails ends the warmup: serving compiles the shapes it meets
            self.warming.step()
        except Exception:
            log.exception("warmup failed")
            self.warming = None
        if self.warming is not None and self.warming.finished:
            self.warming = None
            if self.warmed is not None:
                self.warmed()

    def _fail_all(self, error: Exception) -> None:
        for job in list(self.jobs):
            if job.request is not None and not job.request.finished:
                self.engine.cancel(job.request)
            self._end(job, Failed(error))

    def _handle(self, cmd) -> None:
        """One command; whatever goes wrong fails that command alone."""
        try:
            match cmd:
                case Submit(job) if self._stop.is_set():
                    self._end(job, Failed(ShuttingDown("the server is shutting down")))
                case Submit(job):
                    self._submit(job)
                case Cancel(job, stop) if job.request is not None and not job.done:
                    self.engine.cancel(job.request, stop=stop)
                case Close(name, answer):
                    answer(self._close(name))
                case Snapshot(root, answer):
                    self.snapshot(root, answer)
                case Import(root, answer):
                    answer(self.sessions.take_snapshot(self.engine, root))
        except Exception as e:
            log.exception("command %s failed", type(cmd).__name__)
            if isinstance(cmd, (Close, Snapshot, Import)):
                cmd.answer(e)
            elif isinstance(cmd, Submit):
                self._end(cmd.job, Failed(e))

    def _close(self, name: str):
        sid = self.sessions.engine_session(name)
        if sid is None:
            return KeyError(name)
        if any(j.sid == sid for j in self.jobs):
            return SessionBusy("the session has a turn in flight")
        self.engine.close_session(sid)
        self.sessions.drop(name)
        return None

    def _submit(self, job: Job) -> None:
        eng = self.engine
        if job.cancelled:
            return self._end(job, Failed(TurnCancelled("the turn was cancelled")))
        known = None if job.session_key is None else self.sessions.engine_session(job.session_key)
        if known is not None and eng.sessions[known].salt != job.salt:
            return self._end(job, Failed(SaltChanged()))
        if known is None and job.session_key is not None:  # a new session: within the caps
            try:
                victims = self.sessions.room_for(job.session_key, self._busy())
            except TooManySessions as e:
                return self._end(job, Failed(e))
            for name in victims:
                self._retire(name, "cap")
        job.sid = eng.open_session(lineage=job.lineage, salt=job.salt) if known is None else known
        try:
            job.request = eng.submit_prompt(
                job.sid,
                job.prompt,
                mode=job.mode,
                sampling=job.sampling,
                directives=job.directives,
                move=job.move,
                recompute=job.recompute,
            )
        except (ValueError, KeyError) as e:
            if known is None:  # nothing of the session exists yet: do not keep an empty one
                eng.close_session(job.sid)
                job.sid = None
            return self._end(job, Failed(e))
        if known is None and job.session_key is not None:
            self.sessions.bind(job.session_key, job.sid)
        self.jobs.append(job)

    def _busy(self) -> set[str]:
        return {j.session_key for j in self.jobs if j.session_key is not None}

    def _expire(self) -> None:
        """Close the named sessions idle past their TTL (looked at once a second at most)."""
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 1.0
            for name in self.sessions.expired(self._busy()):
                self._retire(name, "ttl")

    def _retire(self, name: str, reason: str) -> None:
        sid = self.sessions.engine_session(name)
        if sid is not None and sid in self.engine.sessions:
            self.engine.close_session(sid)  # its clean prefix stays in the radix cache
        self.sessions.drop(name)
        self.metrics.sessions_closed.labels(reason).inc()

    def _publish(self) -> None:
        for job in list(self.jobs):
            r = job.request
            if len(r.output) > job.sent and (job.incremental or r.finished):
                job.post(Tokens(r.output[job.sent :], r.logprobs[job.sent :]))
                job.sent = len(r.output)
            if r.finished:
                if r.error is None:
                    self.metrics.turn_done(job)
                self._end(job, Failed(r.error) if r.error else Done(r.stats))
        self.metrics.gauges(self.engine, [j.request for j in self.jobs])

    def _end(self, job: Job, event: Done | Failed) -> None:
        if job.done:
            return
        job.done = True
        if job in self.jobs:
            self.jobs.remove(job)
        outcome = "done" if isinstance(event, Done) else type(event.error).__name__
        self.metrics.turns.labels(outcome).inc()
        if job.session_key is None and job.sid is not None:
            try:
                self.engine.close_session(job.sid)  # its pages back; clean prefix stays
            except (KeyError, ValueError):
                log.exception("closing session %s", job.sid)
        with self._lock:
            self.pending -= 1
        job.post(event)
