"""Multi-controller serving: one process per host over one global device mesh, on JAX's
distributed runtime (`jax.distributed.initialize`; on CPU its gloo collectives).

Every process runs the same jitted programs on its own shards, so every process must make the
same engine calls in the same order. The leader (process 0) owns HTTP and scheduling: its
engine is wrapped in a `Lockstep`, which applies each call that changes the engine at once and
records it; `Lockstep.step()` first broadcasts the record to every process
(`jax.experimental.multihost_utils.broadcast_one_to_all`), then steps. A follower runs
`follow(engine)`: it receives each record, makes the same calls on its own engine (a call that
failed on the leader fails the same way here: the engines stay equal), and steps. The engine's
host side is deterministic given its calls, and a step's sampled tokens are one replicated
array: the engines never diverge.

A snapshot reads the pools, spread over every process: `Lockstep.read_pages` broadcasts the
record with the pages to read (no step follows it), and every process gathers them at once
(`leyline_jax.paged.read_pages`); the leader writes the snapshot. At start every process
restores the same snapshot (a directory each reads: shared storage), so the engines start
equal.

A process that dies ends the group: the runtime's heartbeats find it within `heartbeat_s`
seconds and abort every other process with an error naming it (`follow` returns only on the
leader's `stop()`). Records are pickled engine
calls (a turn's `SamplingParams` with its grammar as the grammar's text, rebuilt against the
follower's own `Grammars`), padded to a power of two so that the broadcast compiles a few
shapes only.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import numpy as np

_STOP, _READ = "stop", "read_pages"
_MIN_BYTES = 256


def initialize(
    coordinator: str, num_processes: int, process_id: int, heartbeat_s: int = 10
) -> None:
    """Join the group (before any other jax call): `coordinator` "host:port" (process 0's),
    `num_processes`, this one's `process_id`. On CPU the collectives are gloo's. A process
    that sends no heartbeat for `heartbeat_s` seconds (it died) ends every other: the runtime
    aborts them, naming the dead task (a collective waiting on it would wait for ever)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only
    jax.distributed.initialize(
        coordinator, num_processes=num_processes, process_id=process_id,
        heartbeat_timeout_seconds=heartbeat_s,
    )  # fmt: skip


def _broadcast(payload: bytes | None) -> bytes:
    """The leader's `payload` on every process (followers pass None)."""
    from jax.experimental import multihost_utils

    n = np.array([0 if payload is None else len(payload)], np.int64)
    n = int(multihost_utils.broadcast_one_to_all(n)[0])
    size = max(_MIN_BYTES, 1 << (n - 1).bit_length())
    buf = np.zeros(size, np.uint8)
    if payload is not None:
        buf[:n] = np.frombuffer(payload, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n].tobytes()


def _wire(sampling):
    """A turn's `SamplingParams` as sent: its grammar as the grammar's text."""
    if sampling is None or sampling.grammar is None:
        return sampling, None
    return dataclasses.replace(sampling, grammar=None), sampling.grammar.text


def _collectives_at_start(engine) -> None:
    """What a snapshot computes over the whole mesh besides its pages, made once by every
    process as the group starts (memoized): the params' checksum in its layout."""
    from checkpoints.layout import params_checksum

    params_checksum(engine.model)


class Lockstep:
    """The leader's engine. Each engine method says how it is kept in lockstep (its
    `serve.engine.lockstep` mark): a "read" passes through; a "replay" (sessions, pins, the
    prefix cache's reset) is applied and recorded; the "own" ones are this class's methods
    (turns, cancels, steps, reads of the pools); a "setup" one, or one not marked, is refused
    (every process makes a setup call itself, before the group serves). `step()` broadcasts
    the record, then steps; `stop()` releases the followers."""

    def __init__(self, engine):
        _collectives_at_start(engine)
        self.engine = engine
        self._record: list[tuple] = []
        self._turns: dict[int, tuple[int, object]] = {}  # id(Request) -> (its number, it)
        self._made = 0  # turns made, as the followers count them

    def __getattr__(self, name):
        attr = getattr(self.engine, name)
        method = getattr(type(self.engine), name, None)
        if not inspect.isfunction(method):
            return attr  # an attribute or a property: reading it
        kind = getattr(method, "lockstep", None)
        if kind == "read":
            return attr
        if kind != "replay":
            raise AttributeError(
                f"Engine.{name} ({kind or 'not marked'}) cannot be called on a group's leader: "
                "its followers would not make it (serve.engine.lockstep)"
            )

        def recorded(*args, **kw):
            self._record.append((name, args, kw))
            return attr(*args, **kw)

        return recorded

    def _turn(self, name, session, tokens, kw):
        sampling, grammar = _wire(kw.get("sampling"))
        self._record.append((name, (session, list(tokens)), dict(kw, sampling=sampling), grammar))
        try:
            req = getattr(self.engine, name)(session, tokens, **kw)
        except Exception:
            self._record[-1] += ("failed",)  # followers expect it to fail too
            raise
        self._turns[id(req)] = (self._made, req)
        self._made += 1
        return req

    def submit(self, session, tokens, **kw):
        return self._turn("submit", session, tokens, kw)

    def submit_prompt(self, session, prompt, **kw):
        return self._turn("submit_prompt", session, prompt, kw)

    def cancel(self, request, *, stop: bool = False) -> bool:
        number = self._turns.get(id(request), (None,))[0]
        self._record.append(("cancel", (number,), {"stop": stop}))
        return self.engine.cancel(request, stop=stop)

    def read_pages(self, ids):
        """`Engine.read_pages` on every process at once: the record so far and the ids are
        broadcast (no step follows), then each process reads its part of the gather."""
        record, self._record = self._record, []
        _broadcast(pickle.dumps((_READ, list(ids), record)))
        return self.engine.read_pages(ids)

    def step(self) -> None:
        record, self._record = self._record, []
        _broadcast(pickle.dumps(record))
        self.engine.step()
        self._turns = {k: v for k, v in self._turns.items() if not v[1].finished}

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.engine.idle():
                return
            self.step()
        raise RuntimeError("the engine did not go idle")

    def stop(self) -> None:
        _broadcast(pickle.dumps(_STOP))


def follow(engine, grammars=None) -> int:
    """A follower's loop: each record from the leader applied to `engine`, then a step; returns
    the steps taken when the leader stops. `grammars`: the model's `serve.grammar.Grammars`
    (turns with a grammar need it)."""
    from serve.grammar import Grammar

    _collectives_at_start(engine)
    turns: dict = {}  # a turn's number -> it (unfinished ones: as the leader keeps them)
    made = steps = 0
    while True:
        record = pickle.loads(_broadcast(None))
        if record == _STOP:
            return steps
        read = record[:2] if isinstance(record, tuple) else None  # (_READ, ids): no step
        for call in record[2] if read else record:
            name, args, kw = call[:3]
            if name == "cancel":
                if args[0] in turns:
                    engine.cancel(turns[args[0]], **kw)
                continue
            if name in ("submit", "submit_prompt"):
                if call[3] is not None:
                    kw["sampling"] = dataclasses.replace(
                        kw["sampling"], grammar=Grammar(grammars, call[3])
                    )
                try:
                    req = getattr(engine, name)(*args, **kw)
                except Exception:
                    if "failed" not in call[4:]:
                        raise
                    continue
                turns[made] = req
                made += 1
                continue
            try:
                getattr(engine, name)(*args, **kw)
            except Exception:
                pass  # it failed on the leader too (its caller got the error)
        if read:
            engine.read_pages(read[1])
            continue
        engine.step()
        steps += 1
        turns = {k: r for k, r in turns.items() if not r.finished}
