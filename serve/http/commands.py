"""What passes between the event loop and the engine thread, all defined here: a request's turn
(`Job`), the typed commands the engine thread takes (`Submit`, `Cancel`, `Close`, `Snapshot`,
`Import`, `Wake`), `Answer` (where a command's result goes: a future of the event loop that
waits for it), and the typed events a job's queue receives (`Tokens`, `Done`, `Failed`; and
`Gone`, the route's own when its client went away), matched by type, never by a tag.

A job's events: `Tokens` as its tokens are sampled (none, one or many), then exactly one of
`Done` or `Failed`, its last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time


def call_soon(loop, fn, *args) -> None:
    """`fn(*args)` on the event loop `loop`, from any thread (nothing once the loop is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is gone (shutdown)
        pass


# ---- a job's events -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Tokens:
    """Tokens the turn sampled since its last `Tokens`, each with its log-probabilities."""

    ids: list[int]
    logprobs: list  # one entry per id (`Request.logprobs`'), None where not asked


@dataclasses.dataclass(frozen=True)
class Done:
    """The turn finished; `stats`: its `TurnStats`. The job's last event."""

    stats: object


@dataclasses.dataclass(frozen=True)
class Failed:
    """The turn ended with `error` (cancelled, refused, the server stopping, an engine bug).
    The job's last event."""

    error: BaseException


@dataclasses.dataclass(frozen=True)
class Gone:
    """The client went away (posted by the route that follows the job, not by the engine)."""


Event = Tokens | Done | Failed | Gone


@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request's turn, as the engine thread tracks it."""

    prompt: list[int]
    sampling: object  # SamplingParams
    mode: object  # Mode
    session_key: str | None  # None: a session of its own, closed when the turn ends
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # of `Event`s, put on the event loop (`post`)
    directives: list = dataclasses.field(default_factory=list)  # in `prompt`'s coordinates
    move: bool = False  # MOVE for this turn (`Engine.submit_prompt`)
    recompute: float | None = None  # its splices' budget (`Engine.submit_prompt`)
    lineage: str | None = None  # a new session's lineage (`Engine.open_session`)
    salt: str = ""  # its radix cache's salt (`Engine.open_session`); the session's, if known
    incremental: bool = True  # tokens as each step samples them (else once, at the end)
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    request: object = None  # the engine's Request, once submitted
    sid: int | None = None
    sent: int = 0
    cancelled: bool = False
    done: bool = False

    def post(self, event: Event) -> None:
        """Queue `event` for the route, from any thread."""
        call_soon(self.loop, self.events.put_nowait, event)


# ---- the engine thread's commands -----------------------------------------------------------
@dataclasses.dataclass
class Answer:
    """Where a command's result goes: a future of the event loop that waits for it."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def __call__(self, result) -> None:
        def set_():
            if not self.future.done():
                self.future.set_result(result)

        call_soon(self.loop, set_)


@dataclasses.dataclass
class Submit:
    job: Job


@dataclasses.dataclass
class Cancel:
    job: Job
    stop: bool = False  # a stop string ended it: it finishes (`Engine.cancel`)


@dataclasses.dataclass
class Close:
    name: str
    answer: Answer  # None, KeyError (no such session) or SessionBusy


@dataclasses.dataclass
class Snapshot:
    root: str
    answer: Answer  # (its directory, how many HTTP sessions), or the error


@dataclasses.dataclass
class Import:
    root: str
    answer: Answer  # how many HTTP sessions were taken, or the error


@dataclasses.dataclass
class Wake:
    pass
