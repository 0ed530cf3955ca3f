"""Directives: edit a cached sequence in place (AMORTIZE) or re-prefill after the edit (FORGET).

A directive `(start, end, replacement, mode)` is in token coordinates of the sequence as it is
now; a batch of directives is atomic, non-overlapping, all in pre-batch coordinates. Semantics are
docs/design.md. This module owns what a directive means: the types, validation, the list
semantics (`apply_to_list`), DECAY's resolution, and `apply_directives`, which runs a batch in
three steps, each its own module's: the pages (`leyline_jax.allocator.plan_edit`, on the host),
then the device (`leyline_jax.splice.run_edit`: zero what FORGET evicts, one fused
move+rotate pass, the prefill of what is new).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from leyline_jax import allocator, importance, paged, recompute, splice
from leyline_jax.allocator import OutOfPagesError, SequenceError
from leyline_jax.hf_config import is_int
from leyline_jax.kv_state import PagedKVState
from leyline_jax.model import CausalLM


class DirectiveError(ValueError):
    """An invalid directive or batch. Raised before any state changes."""


class Mode(enum.Enum):
    AMORTIZE = "amortize"  # splice in place: downstream keeps its moved band, rotated band by delta
    FORGET = "forget"  # truncate at start and re-prefill replacement + tokens[end:]
    DECAY = "decay"  # AMORTIZE keeping the span's `budget` most-attended tokens ahead of it
    MOVE = "move"  # AMORTIZE whose replacement's `sources` are moved from the sequence's slots


SPLICED = (Mode.AMORTIZE, Mode.MOVE)  # the modes a splice applies (DECAY resolves to MOVE)


def _ints(obj, names, what: str = "") -> None:
    for name in names:
        v = getattr(obj, name)
        if not is_int(v):
            raise DirectiveError(f"{what}{name} must be an int, got {v!r}")
        object.__setattr__(obj, name, int(v))


def _tuple(items, what: str) -> tuple:
    try:
        return tuple(items)
    except TypeError as e:
        raise DirectiveError(f"{what}: {e}") from e


@dataclasses.dataclass(frozen=True)
class Source:
    """`replacement[offset:offset + length]` is `tokens[position:position + length]` of the
    sequence (pre-batch coordinates): MOVE copies that KV, rotated to its new position,
    instead of prefilling it.

    With `pages`, the KV is read from those pages instead of the sequence's own: pages[k]
    holds positions (position // page_size + k) * page_size onwards, cached by a fresh
    prefill of their path (the engine passes clean radix-cache pages whose tokens it matched;
    the caller vouches for the tokens, which the state does not record for such pages)."""

    offset: int
    position: int
    length: int
    pages: tuple[int, ...] = ()

    def __post_init__(self):
        _ints(self, ("offset", "position", "length"), "source ")
        if self.offset < 0 or self.position < 0 or self.length < 1:
            raise DirectiveError(f"source {self} needs offset >= 0, position >= 0 and length >= 1")
        pages = _tuple(self.pages, "source pages must be a sequence of page ids")
        if any(not is_int(p) or p < 0 for p in pages):
            raise DirectiveError(f"source pages must be page ids, got {pages!r}")
        object.__setattr__(self, "pages", tuple(int(p) for p in pages))


@dataclasses.dataclass(frozen=True)
class Directive:
    """Replace tokens [start, end) of a sequence by `replacement`.

    DECAY needs `budget` (how many of the span's tokens to keep); MOVE needs `sources` (which
    parts of the replacement come from the sequence's own KV). `override_pin`: the directive
    may cut into a span its session pinned (checked by the engine, which owns pins).
    `recompute` (AMORTIZE and MOVE): after the splice, this many of the downstream tokens (an
    int), or this fraction of them (a float in [0, 1]), are run through the model again
    (`leyline_jax.recompute`); 0 is the splice alone, the whole downstream FORGET's KV. Not a
    redaction: the tokens not chosen keep KV computed with the evicted span."""

    start: int
    end: int
    replacement: tuple[int, ...] = ()
    mode: Mode = Mode.AMORTIZE
    budget: int | None = None
    sources: tuple[Source, ...] = ()
    override_pin: bool = False
    recompute: int | float = 0

    def __post_init__(self):
        _ints(self, ("start", "end"))
        rep = _tuple(self.replacement, "replacement must be a sequence of token ids")
        for t in rep:
            if not is_int(t):
                raise DirectiveError(f"replacement token {t!r} is not an int")
        object.__setattr__(self, "replacement", tuple(int(t) for t in rep))
        if not isinstance(self.mode, Mode):
            raise DirectiveError(
                f"unknown mode {self.mode!r}: use Mode.AMORTIZE, FORGET, DECAY or MOVE"
            )
        if not isinstance(self.override_pin, bool):
            raise DirectiveError(f"override_pin must be a bool, got {self.override_pin!r}")
        if self.mode is Mode.DECAY:
            if not is_int(self.budget) or self.budget < 0:
                raise DirectiveError(f"DECAY needs budget >= 0 (an int), got {self.budget!r}")
            object.__setattr__(self, "budget", int(self.budget))
        elif self.budget is not None:
            raise DirectiveError(f"budget is DECAY's; a {self.mode.name} directive has none")
        self._check_recompute()
        srcs = _tuple(self.sources, "sources must be a sequence of Source")
        if any(not isinstance(x, Source) for x in srcs):
            raise DirectiveError(f"sources must be Source items, got {srcs!r}")
        object.__setattr__(self, "sources", srcs)
        if (self.mode is Mode.MOVE) != bool(srcs):
            raise DirectiveError(
                "a MOVE directive needs sources, and only a MOVE directive has them"
            )
        covered = 0
        for x in srcs:
            if x.offset < covered or x.offset + x.length > len(rep):
                raise DirectiveError(
                    f"source {x} overlaps another or leaves the replacement of {len(rep)} tokens "
                    "(sources go left to right, inside the replacement)"
                )
            covered = x.offset + x.length

    def _check_recompute(self) -> None:
        object.__setattr__(self, "recompute", check_recompute(self.recompute))
        if self.recompute and self.mode not in SPLICED:
            raise DirectiveError(
                f"recompute is AMORTIZE's and MOVE's; a {self.mode.name} directive has none"
            )

    @property
    def delta(self) -> int:
        """Δ = len(replacement) - (end - start) (DECAY: once resolved, see `resolve_decay`)."""
        return len(self.replacement) - (self.end - self.start)

    @property
    def is_noop(self) -> bool:
        return self.start == self.end and not self.replacement and self.mode is not Mode.DECAY

    @property
    def moved(self) -> int:
        """Tokens of the replacement whose KV is moved (MOVE), not prefilled."""
        return sum(x.length for x in self.sources)


def check_recompute(r) -> int | float:
    """A `recompute` budget as given (a token count, an int >= 0, or a fraction of the
    downstream, a float in [0, 1]), as a plain int or float; DirectiveError otherwise."""
    if isinstance(r, float):
        if not 0.0 <= r <= 1.0:  # NaN fails too
            raise DirectiveError(f"recompute as a fraction must be in [0, 1], got {r!r}")
        return float(r)
    if is_int(r) and r >= 0:
        return int(r)
    raise DirectiveError(
        "recompute must be a token count (an int >= 0) or a fraction of the downstream "
        f"(a float in [0, 1]), got {r!r}"
    )


def with_recompute(directives, recompute: int | float) -> list[Directive]:
    """`directives` with every AMORTIZE and MOVE that names no budget given `recompute`."""
    out = []
    for d in directives:
        if recompute and d.mode in SPLICED and not d.recompute:
            d = dataclasses.replace(d, recompute=recompute)
        out.append(d)
    return out


def apply_to_list(tokens: Sequence[int], directives: Sequence[Directive]) -> list[int]:
    """The edited token list of a valid batch: the semantics in plain Python. No-ops are
    skipped (validation allows one inside another directive's span). A DECAY's text depends on
    what it keeps: resolve it first (`resolve_decay`)."""
    out, cursor = [], 0
    for d in sorted((d for d in directives if not d.is_noop), key=lambda d: (d.start, d.end)):
        if d.mode is Mode.DECAY:
            raise DirectiveError("a DECAY directive's text is known once resolved: resolve_decay")
        out += list(tokens[cursor : d.start]) + list(d.replacement)
        cursor = d.end
    return out + list(tokens[cursor:])


def validate(
    directives: Sequence[Directive],
    length: int,
    vocab_size: int,
    tokens: Sequence[int] | None = None,
) -> list[Directive]:
    """Check a batch against a sequence of `length` tokens; return it sorted, no-ops dropped.
    With `tokens` (the sequence), MOVE sources are checked against it too: in range, holding
    the replacement's tokens, and before the batch's first FORGET (KV from there on was
    computed with tokens the FORGET evicts)."""
    ds = list(directives)
    for d in ds:
        if not isinstance(d, Directive):
            raise DirectiveError(f"{d!r} is not a Directive")
        if not 0 <= d.start <= d.end <= length:
            raise DirectiveError(
                f"directive [{d.start}, {d.end}) is out of range or inverted for a sequence of "
                f"{length} tokens (need 0 <= start <= end <= length)"
            )
        bad = [t for t in d.replacement if not 0 <= t < vocab_size]
        if bad:
            raise DirectiveError(f"replacement token {bad[0]} is outside [0, {vocab_size})")
    ds = sorted((d for d in ds if not d.is_noop), key=lambda d: (d.start, d.end))
    for a, b in zip(ds, ds[1:], strict=False):
        if a.end > b.start or a.start == b.start:
            raise DirectiveError(
                f"directives [{a.start}, {a.end}) and [{b.start}, {b.end}) overlap (two edits "
                "at one start are ambiguous: merge them)"
            )
    if tokens is not None:
        forget = min([d.start for d in ds if d.mode is Mode.FORGET], default=length)
        for d in ds:
            for x in d.sources:
                if x.pages:
                    continue  # another cache's pages: checked against the pool by the caller
                src = list(tokens[x.position : x.position + x.length])
                if x.position + x.length > min(forget, length):
                    raise DirectiveError(
                        f"source {x} reaches past the sequence's {length} tokens or its first "
                        f"FORGET at {forget} (KV computed with evicted tokens never moves)"
                    )
                if src != list(d.replacement[x.offset : x.offset + x.length]):
                    raise DirectiveError(
                        f"source {x}: tokens[{x.position}:{x.position + x.length}] differ from "
                        f"the replacement's [{x.offset}:{x.offset + x.length}]"
                    )
    return ds


def resolve_decay(d: Directive, kept: Sequence[int], tokens: Sequence[int]) -> Directive:
    """The MOVE (or, keeping nothing, AMORTIZE) directive a DECAY becomes once `kept`, the
    sorted positions of its span it keeps, are chosen: text `tokens[:start] + kept tokens +
    replacement + tokens[end:]`, the kept tokens' KV moved from their slots."""
    kept = [int(p) for p in kept]
    if any(not d.start <= p < d.end for p in kept) or kept != sorted(set(kept)):
        raise DirectiveError(f"kept positions {kept} are not sorted, distinct, in the span")
    sources, offset = [], 0
    for p in kept:
        if sources and sources[-1].position + sources[-1].length == p:
            last = sources[-1]
            sources[-1] = Source(last.offset, last.position, last.length + 1)
        else:
            sources.append(Source(offset, p, 1))
        offset += 1
    rep = tuple(int(tokens[p]) for p in kept) + d.replacement
    mode = Mode.MOVE if sources else Mode.AMORTIZE
    return Directive(d.start, d.end, rep, mode, sources=tuple(sources), override_pin=d.override_pin)


# ---- public API -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Applied:
    """What `apply_directives` did, in tokens of the edited sequence (they sum to `length`)."""

    reused: int  # kept in place: the tokens before the first edit
    spliced: int  # kept and moved by a splice: c_kv bit-exact, k_pe rotated (MOVE's included)
    prefilled: int  # run through the model: spliced-in replacements and FORGET's re-prefill
    length: int  # the edited sequence's length
    moved: int = 0  # of `spliced`, the replacements' tokens MOVE (and DECAY) copied
    kept: tuple[int, ...] = ()  # DECAY: the positions it kept (pre-batch coordinates)
    recomputed: int = 0  # tokens run again after the splice (`Directive.recompute`)


def _check_source_pages(state: PagedKVState, seq: int, ds: Sequence[Directive]) -> None:
    """MOVE sources in other pages: in use, as many as their positions need, and none that
    the batch's FORGET truncation releases or zeroes (the sequence's own pages from the one
    holding the first FORGET start on, which it reads past the cut)."""
    ps = state.page_size
    forget = [d.start for d in ds if d.mode is Mode.FORGET]
    n = int(state.lengths[seq])
    held = state.page_table[seq, forget[0] // ps : allocator.pages_for(n, ps)] if forget else []
    cut_pages = set(np.asarray(held).tolist())
    for d in ds:
        for x in d.sources:
            if not x.pages:
                continue
            need = (x.position + x.length - 1) // ps - x.position // ps + 1
            if len(x.pages) < need or any(
                p >= state.num_pages or state.refcount[p] == 0 for p in x.pages
            ):
                raise DirectiveError(
                    f"source {x} needs {need} pages in use of the {state.num_pages}"
                )
            if any(p in cut_pages for p in x.pages):
                raise DirectiveError(
                    f"source {x} reads pages the batch's FORGET truncates (KV computed with "
                    "evicted tokens never moves)"
                )


def resolve_decays(
    model: CausalLM,
    state: PagedKVState,
    seq: int,
    directives: Sequence[Directive],
    *,
    rule: str = "window",
    repeat=(),
) -> tuple[PagedKVState, list[Directive], tuple[int, ...]]:
    """A validated batch with every DECAY resolved (`resolve_decay`): its kept tokens chosen
    by `leyline_jax.importance` (`rule`, and its `repeat` prompt) from `seq`'s KV as it is
    now. A DECAY at or after the batch's first FORGET start keeps the same tokens as text
    (AMORTIZE: everything from the FORGET on is prefilled again anyway). Returns (state,
    batch, kept positions); `seq`'s KV is as it was."""
    out, kept = [], []
    tokens = None
    cut = min([d.start for d in directives if d.mode is Mode.FORGET], default=None)
    for d in directives:
        if d.mode is Mode.DECAY:
            tokens = state.token_ids[seq].tolist() if tokens is None else tokens
            if rule == "reconstruct" and not _scored(d):  # all or none: nothing to rank
                k = list(range(d.start, d.start + min(d.budget, d.end - d.start)))
            elif rule == "reconstruct":
                state, span = importance.reconstruction_scores(
                    model, state, seq, d.start, d.end, repeat
                )
                k = [d.start + int(i) for i in importance.select(span, d.budget)]
            else:
                k = importance.decay_selection(model, state, seq, d.start, d.end, d.budget)
            kept += k
            d = resolve_decay(d, k, tokens)
            if cut is not None and d.start >= cut:
                d = Directive(d.start, d.end, d.replacement, override_pin=d.override_pin)
        out.append(d)
    return state, out, tuple(kept)


def apply_directives(
    model: CausalLM,
    state: PagedKVState,
    seq: int,
    directives: Sequence[Directive],
    *,
    impl: str | None = None,
    report: bool = False,
    recompute_rule: str = "border",
    decay_rule: str = "window",
    repeat=(),
) -> PagedKVState | tuple[PagedKVState, Applied]:
    """Apply an atomic batch of non-overlapping directives (pre-batch coordinates) to `seq`.

    AMORTIZE and MOVE edits are spliced; a DECAY is first resolved into a MOVE of the tokens it
    keeps (`resolve_decays`); if any directive is FORGET, everything from the first FORGET
    start is dropped and re-prefilled (edits before it are still spliced). Raises
    `DirectiveError` (invalid input) or `OutOfPagesError` before anything changes. Donates
    `state`. `impl` picks the splice implementation (see `pallas_kernels.splice_rotate`).
    With `report=True` returns `(state, Applied)`: how many tokens were reused, spliced and
    prefilled. A directive's `recompute` runs after the splice, chosen by `recompute_rule`
    (`leyline_jax.recompute.RULES`); a batch with a FORGET and a `recompute` is refused
    (DirectiveError: everything from the FORGET on is prefilled again, and what it prefills
    would have to read the recomputed KV). A DECAY's kept tokens are chosen by `decay_rule`
    (`leyline_jax.importance.RULES`; "reconstruct" with its `repeat` prompt's token ids, a free
    sequence slot and pages for the prompt and the span, all checked, with the rest of the
    batch, before the scoring runs).
    """
    if decay_rule not in importance.RULES:
        raise DirectiveError(f"decay_rule must be one of {importance.RULES}, got {decay_rule!r}")
    if recompute_rule not in recompute.RULES:
        why = f"recompute_rule must be one of {recompute.RULES}, got {recompute_rule!r}"
        raise DirectiveError(why)
    try:
        seq = allocator.check_seq(state, seq, want_open=True)
    except SequenceError as e:
        raise DirectiveError(str(e)) from e
    length, vocab = int(state.lengths[seq]), model.config.vocab_size
    tokens = state.token_ids[seq].tolist()
    ds = validate(directives, length, vocab, tokens)
    if not ds:
        return (state, Applied(length, 0, 0, length)) if report else state
    if any(d.recompute for d in ds) and any(d.mode is Mode.FORGET for d in ds):
        raise DirectiveError(
            "recompute in a batch with a FORGET: apply the FORGET in a batch of its own"
        )
    if decay_rule == "reconstruct" and any(d.mode is Mode.DECAY for d in ds):
        # the scoring runs on the device (a fork's prefill): everything else is checked first,
        # with the DECAYs resolved to as many kept tokens as they will keep
        _check_reconstruct(state, seq, ds, repeat, vocab)
        _planned(state, seq, [_as_kept(d, tokens) for d in ds], tokens, length, vocab)
    state, ds, kept = resolve_decays(model, state, seq, ds, rule=decay_rule, repeat=repeat)
    ds, planned = _planned(state, seq, ds, tokens, length, vocab)
    if planned is None:  # a DECAY that kept nothing of an empty span
        return (state, Applied(length, 0, 0, length)) if report else state
    new_tokens, cut, spliced, cut_new, plan = planned
    tail = new_tokens[cut_new:]
    state = splice.run_edit(model, state, seq, plan, tokens[:cut], spliced, tail, impl=impl)
    state, chosen = _recomputed(model, state, seq, spliced, recompute_rule)
    if chosen:
        state = paged.refill(model, state, seq, recompute.runs(chosen))
    if not report:
        return state
    reused = ds[0].start
    moved = sum(d.moved for d in spliced)
    spl = (cut - reused) - sum(d.end - d.start for d in spliced) + moved
    pre = len(new_tokens) - reused - spl
    return state, Applied(reused, spl, pre, len(new_tokens), moved, kept, len(chosen))


def _planned(state: PagedKVState, seq: int, ds, tokens, length: int, vocab: int):
    """The host side of a resolved batch, checked (DirectiveError, OutOfPagesError): (the batch
    validated, None when it is empty, else (the edited tokens, the cut, the spliced
    directives, the cut in edited coordinates, the pages' plan)). Changes nothing."""
    ds = validate(ds, length, vocab, tokens)
    _check_source_pages(state, seq, ds)
    new_tokens = apply_to_list(tokens, ds)
    if len(new_tokens) > state.max_seq_len:
        raise DirectiveError(
            f"the edited sequence would hold {len(new_tokens)} tokens, more "
            f"than max_seq_len={state.max_seq_len}"
        )
    if len(new_tokens) == 0:
        raise DirectiveError("the edit would leave the sequence empty: free it instead")
    if not ds:
        return ds, None
    forget = [d for d in ds if d.mode is Mode.FORGET]
    cut = forget[0].start if forget else length
    spliced = [d for d in ds if d.end <= cut and d.mode in SPLICED]
    cut_new = cut + sum(d.delta for d in spliced)
    first = spliced[0].start if spliced else None
    plan = allocator.plan_edit(state, seq, new_tokens, cut, first, cut_new)  # OutOfPagesError
    return ds, (new_tokens, cut, spliced, cut_new, plan)


def _as_kept(d: Directive, tokens) -> Directive:
    """A DECAY resolved as if it kept its span's first tokens (as many as it will keep)."""
    if d.mode is not Mode.DECAY:
        return d
    return resolve_decay(d, range(d.start, d.start + min(d.budget, d.end - d.start)), tokens)


def _scored(d: Directive) -> bool:
    """Whether the reconstruct rule must score a DECAY (it keeps some of its span, not all)."""
    return 0 < d.budget < d.end - d.start


def _check_reconstruct(state: PagedKVState, seq: int, ds, repeat, vocab: int) -> None:
    """What the reconstruct rule needs for the batch's DECAYs, before any runs: `repeat` token
    ids in the vocabulary, a free sequence slot, room for the prompt and the span past the
    sequence (max_seq_len) and pages for them (one DECAY's at a time: each fork is freed)."""
    if any(not is_int(t) or not 0 <= t < vocab for t in repeat):
        raise DirectiveError(f"repeat must be token ids in [0, {vocab})")
    scored = [d for d in ds if d.mode is Mode.DECAY and _scored(d)]
    if not scored:
        return
    if all(state.active[q] for q in range(state.max_seqs)):
        raise DirectiveError("the reconstruct rule needs a sequence slot not in use: none is free")
    n, ps = int(state.lengths[seq]), state.page_size
    most = max(d.end - d.start for d in scored) + len(repeat)
    if n + most > state.max_seq_len:
        raise DirectiveError(
            f"the reconstruct rule runs {most} tokens past the sequence's {n}: more than "
            f"max_seq_len={state.max_seq_len}"
        )
    need = allocator.pages_for(n + most, ps) - n // ps
    if need > len(allocator.free_pages(state)):
        raise OutOfPagesError(f"the reconstruct rule needs {need} free pages")


def _recomputed(model, state: PagedKVState, seq: int, spliced, rule: str):
    """(state, the positions, edited coordinates, sorted) the batch's `recompute` budgets choose
    (`leyline_jax.recompute.choose`): each directive's from the first token past its
    replacement that the edit did not compute in place (MOVE: its first moved token) on."""
    n, shift, wants = int(state.lengths[seq]), 0, []
    for d in spliced:
        first = d.start + shift + (d.sources[0].offset if d.sources else len(d.replacement))
        shift += d.delta
        if d.recompute and first < n:
            wants.append((first, recompute.budget(d.recompute, n - first)))
    if not wants:
        return state, []
    lo = min(first for first, _ in wants)
    scores = None
    if rule == "deviation" and any(k > recompute.BORDER for _, k in wants):
        state, scores = recompute.deviation(model, state, seq, lo)
    chosen: set[int] = set()
    for first, k in wants:
        part = None if scores is None else scores[first - lo :]
        chosen.update(recompute.choose(first, n, k, part))
    return state, sorted(chosen)


def apply_directive(
    model: CausalLM, state: PagedKVState, seq: int, directive: Directive, *, impl: str | None = None
) -> PagedKVState:
    """Apply one directive to `seq` (see `apply_directives`)."""
    return apply_directives(model, state, seq, [directive], impl=impl)


__all__ = [
    "Applied",
    "Directive",
    "DirectiveError",
    "Mode",
    "Source",
    "resolve_decay",
    "resolve_decays",
    "apply_directive",
    "apply_directives",
    "apply_to_list",
]
