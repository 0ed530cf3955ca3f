"""`Warmup`: every shape the engine's steps can take, compiled one at a time, with progress.

The shapes are listed up front (`Runner.warmup_plan`: each step shape with the sampling of its
rows, then each edit shape), smallest first, so a server that warms up while it serves
(`serve.http`'s worker runs one between steps) has the decode shapes first. Each one runs once
on padding that changes nothing. With the persistent compilation cache on
(`serve.compile_cache`) a later process loads the compiled programs instead of compiling them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("serve.engine")


class Warmup:
    def __init__(self, items: list[tuple[str, Callable[[], None]]]):
        self.items = list(items)  # (what, compile it)
        self.done, self.seconds = 0, 0.0

    @property
    def total(self) -> int:
        return len(self.items)

    @property
    def finished(self) -> bool:
        return self.done == self.total

    def names(self) -> list[str]:
        return [name for name, _ in self.items]

    def status(self) -> dict:
        """Shapes compiled of the total and the seconds spent (what /health reports)."""
        return {"compiled": self.done, "total": self.total, "seconds": round(self.seconds, 1)}

    def step(self) -> None:
        """Compile the next shape and log the progress."""
        name, compile_it = self.items[self.done]
        t0 = time.perf_counter()
        compile_it()
        self.seconds += time.perf_counter() - t0
        self.done += 1
        log.info("warmup %d/%d: %s (%.1f s in all)", self.done, self.total, name, self.seconds)

    def run(self) -> int:
        """Compile every shape left; how many there are in all."""
        while not self.finished:
            self.step()
        return self.total
