"""The engine's thread for the HTTP server: it alone touches the engine. Requests reach it as
commands on a queue (submit, cancel, close, snapshot); after every engine step it hands each
request's newly sampled tokens to that request's asyncio queue (`Job.post`), and it keeps the
server's Prometheus metrics (`Metrics`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path

from serve.engine import TurnCancelled

log = logging.getLogger("serve.http")

__all__ = ["EngineWorker", "Job", "Metrics", "QueueFull", "SessionBusy", "ShuttingDown"]


# ---- the engine thread ----------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request's turn, as the engine thread tracks it."""

    prompt: list[int]
    sampling: object  # SamplingParams
    mode: object  # Mode
    session_key: str | None  # None: a session of its own, closed when the turn ends
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    directives: list = dataclasses.field(default_factory=list)  # in `prompt`'s coordinates
    move: bool = False  # MOVE for this turn (`Engine.submit_prompt`)
    lineage: str | None = None  # a new session's lineage (`Engine.open_session`)
    incremental: bool = True  # tokens as each step samples them (else once, at the end)
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    request: object = None  # the engine's Request, once submitted
    sid: int | None = None
    sent: int = 0
    cancelled: bool = False
    done: bool = False

    def post(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


class QueueFull(RuntimeError):
    """As many requests are in flight as the server takes."""


class ShuttingDown(RuntimeError):
    """The server stops: the turn did not finish (retry later, after the restart)."""


class SessionBusy(RuntimeError):
    """A session with a turn in flight cannot be closed."""


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "leyline_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.turns = Counter(
            "leyline_turns", "Turns the engine ended, by outcome", ["outcome"], registry=r
        )
        self.prompt_tokens = Counter(
            "leyline_prompt_tokens",
            "Prompt tokens of finished turns, by where their KV came from",
            ["source"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "leyline_completion_tokens", "Generated tokens", registry=r
        )
        self.hit_rate = Gauge(
            "leyline_cache_hit_rate",
            "(reused + spliced) / prompt tokens over all finished turns",
            registry=r,
        )
        self.queue_depth = Gauge("leyline_queue_depth", "Turns waiting for admission", registry=r)
        self.running = Gauge("leyline_running_turns", "Turns running", registry=r)
        self.free_pages = Gauge("leyline_free_pages", "Free KV pages in the pool", registry=r)
        self.sessions = Gauge("leyline_sessions", "Open engine sessions", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram(
            "leyline_ttft_seconds", "Arrival to first token", buckets=buckets, registry=r
        )
        self.step = Histogram(
            "leyline_step_seconds", "One engine step", buckets=buckets, registry=r
        )
        self.latency = Histogram(
            "leyline_turn_seconds", "Arrival to the turn's end", buckets=buckets, registry=r
        )
        self._prompt = self._cached = 0

    def turn_done(self, job: Job) -> None:
        st = job.request.stats
        self.prompt_tokens.labels("reused").inc(st.reused_tokens)
        self.prompt_tokens.labels("spliced").inc(st.spliced_tokens)
        self.prompt_tokens.labels("prefilled").inc(st.prefilled_tokens)
        self.completion_tokens.inc(len(job.request.output))
        self._prompt += st.prompt_tokens
        self._cached += st.reused_tokens + st.spliced_tokens
        self.hit_rate.set(self._cached / self._prompt if self._prompt else 0.0)
        if st.first_token_s is not None:
            self.ttft.observe(st.first_token_s - job.arrived)
        if st.finished_s is not None:
            self.latency.observe(st.finished_s - job.arrived)


class EngineWorker:
    """The thread that owns the engine. Everything else talks to it through `commands`."""

    def __init__(self, engine, metrics: Metrics, max_queue: int = 64):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.commands: queue.Queue = queue.Queue()
        self.sessions: dict[str, int] = {}  # HTTP session id -> engine session
        self.jobs: list[Job] = []  # submitted, not yet ended (engine thread only)
        self.pending = 0  # jobs accepted and not yet ended (guarded by _lock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="leyline-engine", daemon=True)

    # -- called from the HTTP side ------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the step in flight (waits for it: a step ends); turns still in flight
        fail with `ShuttingDown`, their sessions keeping what they did."""
        self._stop.set()
        self.commands.put(("wake",))
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stop.is_set()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.pending >= self.max_queue:
                raise QueueFull(f"{self.pending} requests in flight (the limit)")
            self.pending += 1
        self.commands.put(("submit", job))

    def cancel(self, job: Job) -> None:
        if not job.done:
            job.cancelled = True
            self.commands.put(("cancel", job))

    def close_session(self, key: str, loop, fut) -> None:
        self.commands.put(("close", key, loop, fut))

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                block = eng.idle() and not self.jobs
                cmd = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
                self._handle(cmd)
                while True:
                    self._handle(self.commands.get_nowait())
            except queue.Empty:
                pass
            try:
                if not eng.idle():
                    t0 = time.perf_counter()
                    eng.step()
                    self.metrics.step.observe(time.perf_counter() - t0)
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

    def _fail_all(self, error: Exception) -> None:
        for job in list(self.jobs):
            if job.request is not None and not job.request.finished:
                self.engine.cancel(job.request)
            self._end(job, ("error", error))

    def _handle(self, cmd) -> None:
        """One command; whatever goes wrong fails that command alone (its caller gets the
        error), never the thread."""
        kind, fut = cmd[0], None
        try:
            if kind == "submit":
                if self._stop.is_set():
                    self._end(cmd[1], ("error", ShuttingDown("the server is shutting down")),
                              submitted=False)  # fmt: skip
                else:
                    self._submit(cmd[1])
            elif kind == "cancel":
                job = cmd[1]
                if job.request is not None and not job.done:
                    self.engine.cancel(job.request)
            elif kind == "close":
                _, key, loop, fut = cmd
                sid = self.sessions.get(key)
                if sid is None:
                    result = KeyError(key)
                elif any(j.sid == sid for j in self.jobs):
                    result = SessionBusy(f"session {key!r} has a turn in flight")
                else:
                    self.engine.close_session(sid)
                    del self.sessions[key]
                    result = None
                self._resolve(loop, fut, result)
            elif kind == "snapshot":
                _, root, extra, loop, fut = cmd
                self._resolve(loop, fut, self.snapshot(root, extra))
        except Exception as e:
            log.exception("command %s failed", kind)
            if fut is not None:
                self._resolve(cmd[-2], fut, e)
            elif kind == "submit":
                self._end(cmd[1], ("error", e), submitted=False)

    @staticmethod
    def _resolve(loop, fut, result) -> None:
        def set_():
            if not fut.done():
                fut.set_result(result)

        try:
            loop.call_soon_threadsafe(set_)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    def snapshot(self, root, extra: dict) -> tuple[Path, int]:
        """Save the engine's sessions under `root` (`serve.snapshot.save`), with the HTTP
        sessions' names and `extra`; (its directory, how many HTTP sessions). On the engine
        thread between steps, or once it stopped."""
        from serve import snapshot

        names = dict(self.sessions)
        return snapshot.save(self.engine, root, {**extra, "http_sessions": names}), len(names)

    def request_snapshot(self, root, extra: dict, loop, fut) -> None:
        self.commands.put(("snapshot", root, extra, loop, fut))

    def _submit(self, job: Job) -> None:
        eng = self.engine
        if job.cancelled:
            self._end(job, ("error", TurnCancelled("the turn was cancelled")), submitted=False)
            return
        new = job.session_key is None or job.session_key not in self.sessions
        job.sid = eng.open_session(lineage=job.lineage) if new else self.sessions[job.session_key]
        try:
            job.request = eng.submit_prompt(
                job.sid,
                job.prompt,
                mode=job.mode,
                sampling=job.sampling,
                directives=job.directives,
                move=job.move,
            )
        except (ValueError, KeyError) as e:
            if new:  # nothing of the session exists yet: do not keep an empty one
                eng.close_session(job.sid)
                job.sid = None
            self._end(job, ("error", e), submitted=False)
            return
        if new and job.session_key is not None:
            self.sessions[job.session_key] = job.sid
        self.jobs.append(job)

    def _publish(self) -> None:
        eng = self.engine
        for job in list(self.jobs):
            r = job.request
            if len(r.output) > job.sent and (job.incremental or r.finished):
                job.post("tokens", list(r.output[job.sent :]))
                job.sent = len(r.output)
            if r.finished:
                if r.error is None:
                    self.metrics.turn_done(job)
                self._end(job, ("error", r.error) if r.error else ("done", r.stats))
        running = sum(1 for j in self.jobs if j.request.status in ("prefill", "decode"))
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(len(self.jobs) - running)
        from leyline_jax import allocator

        self.metrics.free_pages.set(len(allocator.free_pages(eng.state)))
        self.metrics.sessions.set(len(eng.sessions))

    def _end(self, job: Job, event, submitted: bool = True) -> None:
        if job.done:
            return
        job.done = True
        if job in self.jobs:
            self.jobs.remove(job)
        outcome = event[0] if event[0] == "done" else type(event[1]).__name__
        self.metrics.turns.labels(outcome).inc()
        if job.session_key is None and job.sid is not None:
            try:
                self.engine.close_session(job.sid)  # its pages back; clean prefix stays
            except (KeyError, ValueError):
                log.exception("closing session %s", job.sid)
        with self._lock:
            self.pending -= 1
        job.post(*event)
