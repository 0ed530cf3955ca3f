"""What the engine's parts pass between them: a turn (`Request`) and its statistics, a session,
their statuses, and the errors a turn fails with. Plain data (host only)."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterator

import numpy as np

from leyline_jax.directives import Mode


def lockstep(kind: str):
    """Mark an `Engine` method with how a multi-host group keeps every process's engine equal
    (`serve.multihost.Lockstep`, which refuses a method not marked):
    - "read": it changes nothing; the leader's call passes through;
    - "replay": it changes the engine; the leader records the call, every follower makes it;
    - "own": `Lockstep` has a method of its own for it (a turn, a cancel, a step, a read of
      the pools: each needs more than a replay);
    - "setup": every process makes it itself before the group serves (warmup, a snapshot's
      restore); `Lockstep` refuses it while serving."""
    if kind not in LOCKSTEP_KINDS:
        raise ValueError(f"kind {kind!r} is not one of {LOCKSTEP_KINDS}")

    def mark(fn):
        fn.lockstep = kind
        return fn

    return mark


LOCKSTEP_KINDS = ("read", "replay", "own", "setup")


class RequestError(RuntimeError):
    """A turn that cannot be served (it never fits the pool or the sequence bound)."""


class TurnCancelled(RuntimeError):
    """A turn ended by `Engine.cancel` before it finished."""


class Status(enum.StrEnum):
    """Where a turn stands: queued -> prefill -> decode -> done | failed."""

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"
    FAILED = "failed"


class Admission(enum.Enum):
    """What admission made of a queued turn."""

    ADMITTED = "admitted"  # its edit is applied and it runs from the next step
    WAIT = "wait"  # no room now: it (and every later turn) waits for running turns to end
    FAILED = "failed"  # it can never run: it failed alone, its session stays usable


@dataclasses.dataclass
class TurnStats:
    prompt_tokens: int = 0  # the turn's whole prompt: the session's tokens after its edits
    reused_tokens: int = 0  # ... whose KV was already cached and kept as is
    spliced_tokens: int = 0  # ... whose KV AMORTIZE moved and rotated
    prefilled_tokens: int = 0  # ... run through the model in this turn
    moved_tokens: int = 0  # of spliced_tokens, those MOVE copied from another position
    recomputed_tokens: int = 0  # run through the model again after the splice (a budget)
    scratch_tokens: int = 0  # SCRATCH tokens spliced out of the session when the turn ended
    submitted_s: float = 0.0  # perf_counter() times, and the two spans measured from them
    first_token_s: float | None = None
    finished_s: float | None = None
    ttft_s: float | None = None  # submission to first token
    latency_s: float | None = None  # submission to finish (or failure)

    def first_token(self, now: float) -> None:
        self.first_token_s, self.ttft_s = now, now - self.submitted_s

    def finished(self, now: float) -> None:
        self.finished_s, self.latency_s = now, now - self.submitted_s


class Request:
    """One turn of a session: new tokens (and directives) in, generated tokens out."""

    def __init__(self, engine, session, tokens, directives, sampling):
        self.engine, self.session = engine, session
        self.new_tokens = [int(t) for t in tokens]
        self.directives = list(directives)
        self.sampling = sampling
        grammar = getattr(sampling, "grammar", None)
        self.matcher = None if grammar is None else grammar.matcher()  # its parse state
        self.status = Status.QUEUED
        self.output: list[int] = []
        # per generated token, when its sampling asks (`SamplingParams.logprobs` = k): (its
        # log-probability, ((id, log-probability) of the k most likely tokens, most likely first))
        self.logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = []
        self.error: Exception | None = None
        self.stats = TurnStats(submitted_s=time.perf_counter())
        self.pending: list[int] = []  # prompt tokens not yet in the KV
        self.fed = 0  # generated tokens whose KV is cached
        self.prompt: list[int] | None = None  # a whole prompt (submit_prompt), diffed at admission
        self.mode = Mode.AMORTIZE
        self.scratch: list[tuple[int, int]] = []  # SCRATCH spans of the turn's prompt
        self.scratch_tags: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.move: bool | None = None  # MOVE for this turn (None: the engine's default)
        self.recompute: int | float | None = None  # its splices' budget (None: the engine's)
        self.decays: list | None = None  # the directives with DECAY resolved, once
        self.order = -1  # its place in submission order, once queued

    @property
    def finished(self) -> bool:
        return self.status in (Status.DONE, Status.FAILED)

    def fail(self, error: Exception) -> None:
        self.status, self.error = Status.FAILED, error
        self.stats.finished(time.perf_counter())

    def result(self) -> list[int]:
        """Run the engine until this turn finishes; its generated tokens (raises its error)."""
        while not self.finished:
            self.engine.step()
        if self.error is not None:
            raise self.error
        return list(self.output)

    def stream(self) -> Iterator[int]:
        """Yield generated tokens as the engine produces them (drives the engine)."""
        sent = 0
        while True:
            while sent < len(self.output):
                yield self.output[sent]
                sent += 1
            if self.finished:
                if self.error is not None:
                    raise self.error
                return
            self.engine.step()


@dataclasses.dataclass(eq=False)
class Session:
    """A conversation, as plain data. `serve.engine.sessions.SessionTable` is the one writer
    of every field; `cached` is read from the KV state itself."""

    id: int
    _tokens: list[int] | np.ndarray = dataclasses.field(default_factory=list)  # see `tokens`
    seq: int | None = None  # sequence slot, while the session holds KV
    clean: int = 0  # tokens[:clean] have the KV a fresh prefill would give
    active: Request | None = None  # its turn admitted and not yet ended
    last_used: float = 0.0
    pins: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # PIN spans
    lineage: str = ""  # radix pages it inserted may be MOVE sources for this lineage only
    salt: str = ""  # the radix cache it shares: that of sessions with the same salt only
    private: bool = False  # it ran MOVE: its non-clean KV is cached for its lineage only
    # its KV holds KV moved from radix pages (another session's history): its non-clean KV
    # then stays its own (never cached for the lineage) until the KV starts again
    foreign: bool = False
    pool: object = dataclasses.field(default=None, repr=False)  # the engine's `Pool`

    @property
    def cached(self) -> int:
        """tokens[:cached] are in the KV: the length of its sequence slot (0 without one)."""
        return 0 if self.seq is None else int(self.pool.state.lengths[self.seq])

    @property
    def tokens(self) -> list[int]:
        """The conversation so far: a list (a packed session's ids become one again)."""
        if not isinstance(self._tokens, list):
            self._tokens = self._tokens.tolist()
        return self._tokens

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        self._tokens = value

    def pack(self) -> None:
        """Hold the ids as 4 bytes each (int32) until `tokens` is next read: an idle session
        without KV (a list costs 8 bytes a token, 36 for an id past Python's small ints)."""
        self._tokens = np.asarray(self._tokens, np.int32)

    def token_list(self) -> list[int]:
        """A copy of `tokens` that leaves a packed session packed."""
        return self._tokens.tolist() if isinstance(self._tokens, np.ndarray) else list(self._tokens)
