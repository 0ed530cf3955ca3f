"""What one engine step passes between its parts, as values: the scheduler's `Batch` to the
runner, the runner's `Ran` (what happened) to post-processing (`serve.engine.postprocess`).

A step is `schedule() -> Batch`, `execute(Batch) -> Ran`, `postprocess(Batch, Ran)`. The batch
says which edits to apply (the KV splices and MOVE of the turns admitted in this step, in
order) and which turns feed how many tokens (a decode row its last token; a prefill row the
next `count` tokens of its prompt still to feed). The runner does exactly that on the device
and reports, per edit, what it did, the tokens each row fed and the tokens it drew.
"""

from __future__ import annotations

import dataclasses

from leyline_jax.directives import Applied, Directive
from serve.engine.types import Request


@dataclasses.dataclass(frozen=True)
class Edit:
    """An admitted turn's edit of its session's KV, applied before the step's rows run. The
    scheduler has already made room, given the session a sequence slot, cut its KV (a FORGET)
    or opened it on a cached prefix: the KV holds `prompt[:kept]` once `splices` (AMORTIZE
    and MOVE, the session's coordinates) are applied; `move`: then MOVE the tokens the turn
    would prefill from where the session or its lineage holds them (`planner.move_plan`)."""

    request: Request
    prompt: list[int]  # the turn's whole prompt
    directives: list[Directive]  # the turn's validated batch, for its pins and statistics
    splices: list[Directive]
    reused: int  # prompt tokens whose KV is kept as it is (a cached prefix, or before the cut)
    clean: int  # the session's clean prefix once the edit is applied
    kept: int
    move: bool


@dataclasses.dataclass(frozen=True)
class Row:
    """One turn's part of the ragged step: a prefill row feeds the next `count` tokens of its
    prompt (fewer if an edit's MOVE left fewer to feed); a decode row its last token."""

    request: Request
    count: int
    prefill: bool


@dataclasses.dataclass(frozen=True)
class Batch:
    edits: tuple[Edit, ...] = ()
    rows: tuple[Row, ...] = ()


@dataclasses.dataclass(frozen=True)
class EditDone:
    """What an edit did: the KV then holds prompt[:cached]; its splices' report (None: it had
    none) and its MOVE (None: none found; `skipped`: the pool could not hold it now, so its
    tokens are prefilled)."""

    cached: int
    applied: Applied | None
    move: Directive | None = None
    moved: int = 0
    skipped: bool = False


@dataclasses.dataclass(frozen=True)
class Sample:
    """The token a row drew (its prompt is done), with its log-probability and the most
    likely alternatives when its turn asked (`SamplingParams.logprobs`)."""

    row: int
    token: int
    logprob: tuple[float, tuple[tuple[int, float], ...]] | None


@dataclasses.dataclass(frozen=True)
class Ran:
    """What the runner did with a batch: per edit what it did (None: the pool could not hold
    its splices now; nothing changed and the turn waits again), per row the tokens it fed
    (none: its turn's edit was not applied), and the rows that drew a token."""

    edits: tuple[EditDone | None, ...]
    fed: tuple[tuple[int, ...], ...]
    samples: tuple[Sample, ...]
