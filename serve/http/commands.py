"""The engine thread's typed commands (`Submit`, `Cancel`, `Close`, `Snapshot`, `Wake`) and
`Answer`, where a command's result goes: a future of the event loop that waits for it."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve.http.worker import Job


def call_soon(loop, fn, *args) -> None:
    """`fn(*args)` on the event loop `loop`, from any thread (nothing once the loop is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is gone (shutdown)
        pass


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
