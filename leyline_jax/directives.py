"""Directives: edit a cached sequence in place (AMORTIZE) or re-prefill after the edit (FORGET).

A directive `(start, end, replacement, mode)` is in token coordinates of the sequence as it is
now; a batch of directives is atomic, non-overlapping, all in pre-batch coordinates. Semantics are
DESIGN.md §2. Planning runs on the host (validate, pick fresh pages, compute every moved slot's
source, destination and old/new position); applying runs on device under jit (one fused
move+rotate pass over every layer's pools through `pallas_kernels.splice_rotate`, moving runs
of consecutive slots, then the replacements' prefill).

The splice machinery sees "a band that moves" and "a band that moves and rotates" (halves
layout), as the family names them (`config.kv_bands()`; MLA: `c_kv` and `k_pe`, GQA: V and K),
so every family shares it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from leyline_jax import importance, paged
from leyline_jax import kv_state as kv
from leyline_jax.kv_state import OutOfPagesError, PagedKVState, SequenceError
from leyline_jax.model import CausalLM
from pallas_kernels.dispatch import resolve
from pallas_kernels.splice_rotate import TARGETS, Runs, phase_table, plan_runs, splice_rotate

MIN_MOVE_BUCKET = 16


class DirectiveError(ValueError):
    """An invalid directive or batch. Raised before any state changes."""


class Mode(enum.Enum):
    AMORTIZE = "amortize"  # splice in place: downstream keeps its moved band, rotated band by delta
    FORGET = "forget"  # truncate at start and re-prefill replacement + tokens[end:]
    DECAY = "decay"  # AMORTIZE keeping the span's `budget` most-attended tokens ahead of it
    MOVE = "move"  # AMORTIZE whose replacement's `sources` are moved from the sequence's slots


SPLICED = (Mode.AMORTIZE, Mode.MOVE)  # the modes a splice applies (DECAY resolves to MOVE)


def _is_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, np.integer))


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
        for name in ("offset", "position", "length"):
            v = getattr(self, name)
            if not _is_int(v):
                raise DirectiveError(f"source {name} must be an int, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.offset < 0 or self.position < 0 or self.length < 1:
            raise DirectiveError(f"source {self} needs offset >= 0, position >= 0 and length >= 1")
        try:
            pages = tuple(self.pages)
        except TypeError as e:
            raise DirectiveError(f"source pages must be a sequence of page ids: {e}") from e
        if any(not _is_int(p) or p < 0 for p in pages):
            raise DirectiveError(f"source pages must be page ids, got {pages!r}")
        object.__setattr__(self, "pages", tuple(int(p) for p in pages))


@dataclasses.dataclass(frozen=True)
class Directive:
    """Replace tokens [start, end) of a sequence by `replacement`.

    DECAY needs `budget` (how many of the span's tokens to keep); MOVE needs `sources` (which
    parts of the replacement come from the sequence's own KV). `override_pin`: the directive
    may cut into a span its session pinned (checked by the engine, which owns pins)."""

    start: int
    end: int
    replacement: tuple[int, ...] = ()
    mode: Mode = Mode.AMORTIZE
    budget: int | None = None
    sources: tuple[Source, ...] = ()
    override_pin: bool = False

    def __post_init__(self):
        for name in ("start", "end"):
            v = getattr(self, name)
            if not _is_int(v):
                raise DirectiveError(f"{name} must be an int, got {v!r}")
        try:
            rep = tuple(self.replacement)
        except TypeError as e:
            raise DirectiveError(f"replacement must be a sequence of token ids: {e}") from e
        for t in rep:
            if not _is_int(t):
                raise DirectiveError(f"replacement token {t!r} is not an int")
        object.__setattr__(self, "replacement", tuple(int(t) for t in rep))
        object.__setattr__(self, "start", int(self.start))
        object.__setattr__(self, "end", int(self.end))
        if not isinstance(self.mode, Mode):
            raise DirectiveError(
                f"unknown mode {self.mode!r}: use Mode.AMORTIZE, FORGET, DECAY or MOVE"
            )
        if not isinstance(self.override_pin, bool):
            raise DirectiveError(f"override_pin must be a bool, got {self.override_pin!r}")
        if self.mode is Mode.DECAY:
            if not _is_int(self.budget) or self.budget < 0:
                raise DirectiveError(f"DECAY needs budget >= 0 (an int), got {self.budget!r}")
            object.__setattr__(self, "budget", int(self.budget))
        elif self.budget is not None:
            raise DirectiveError(f"budget is DECAY's; a {self.mode.name} directive has none")
        try:
            srcs = tuple(self.sources)
        except TypeError as e:
            raise DirectiveError(f"sources must be a sequence of Source: {e}") from e
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


# ---- AMORTIZE planning (host) ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SplicePlan:
    """Everything the device needs to apply an AMORTIZE batch to one sequence."""

    new_tokens: list[int]
    page_row: np.ndarray  # i32[max_pages] the sequence's new page-table row (P = unused)
    fresh: np.ndarray  # i32[F] pages taken from the pool
    released: np.ndarray  # i32[R] pages the sequence no longer references
    src: np.ndarray  # i32[M] moved slots (kept downstream, then MOVE sources): old slot
    dst: np.ndarray  # i32[M] new slot
    pos_from: np.ndarray  # i32[M] old position
    pos_to: np.ndarray  # i32[M] new position
    runs: Runs  # the same moves as runs of consecutive slots (at most a page each)
    fills: list[tuple[int, tuple[int, ...]]]  # (new start, tokens to prefill) left to right


def plan_splice(
    tokens: Sequence[int],
    page_row: np.ndarray,  # i32[max_pages] current row
    directives: Sequence[Directive],  # validated, sorted, AMORTIZE or MOVE
    page_size: int,
    free_pages: np.ndarray,  # i32[...] free page ids, lowest first
    num_pages: int,
) -> SplicePlan:
    """Pages from the one holding the first edited token onwards are rebuilt in fresh pages:
    kept tokens move there (rotated by their shift), so do MOVE sources (copied from wherever
    they are, rotated to their new position), the rest of each replacement is prefilled there;
    the prefix pages before it are untouched. Raises OutOfPagesError if the pool is short."""
    n, ps = len(tokens), page_size
    new_tokens = apply_to_list(tokens, directives)
    first_page = directives[0].start // ps
    old_pages = -(-n // ps)
    new_pages = -(-len(new_tokens) // ps)
    need = new_pages - first_page
    if need > len(free_pages):
        raise OutOfPagesError(
            f"splice needs {need} fresh pages; {len(free_pages)} of {num_pages} are free"
        )
    fresh = np.asarray(free_pages[:need], np.int32)
    row = np.full_like(page_row, num_pages)
    row[:first_page] = page_row[:first_page]
    row[first_page:new_pages] = fresh

    starts = np.array([d.start for d in directives])
    ends = np.array([d.end for d in directives])
    cum = np.concatenate([[0], np.cumsum([d.delta for d in directives])])
    i = np.arange(first_page * ps, n)  # every old token on a rebuilt page
    k = np.searchsorted(starts, i, side="right") - 1  # last directive starting at or before i
    deleted = (k >= 0) & (i < ends[np.maximum(k, 0)])
    i = i[~deleted]
    shift = cum[np.searchsorted(ends, i, side="right")]  # sum of deltas of edits before i
    j = i + shift
    # MOVE sources join the moved rows: old slot -> new slot
    fills, mi, mj, out_src = [], [i], [j], [page_row[i // ps] * ps + i % ps]
    for q, d in enumerate(directives):
        at, cursor = d.start + int(cum[q]), 0  # the replacement's new start
        for x in d.sources:
            if x.offset > cursor:
                fills.append((at + cursor, d.replacement[cursor : x.offset]))
            pos = x.position + np.arange(x.length)
            mi.append(pos)
            mj.append(at + x.offset + np.arange(x.length))
            if x.pages:  # another cache's pages
                out_src.append(np.asarray(x.pages)[pos // ps - x.position // ps] * ps + pos % ps)
            else:
                out_src.append(page_row[pos // ps] * ps + pos % ps)
            cursor = x.offset + x.length
        if cursor < len(d.replacement):
            fills.append((at + cursor, d.replacement[cursor:]))
    i, j = np.concatenate(mi).astype(np.int64), np.concatenate(mj).astype(np.int64)
    src = np.concatenate(out_src).astype(np.int64)
    dst = row[j // ps] * ps + j % ps
    src, dst, i, j = (a.astype(np.int32) for a in (src, dst, i, j))
    return SplicePlan(
        new_tokens=new_tokens,
        page_row=row,
        fresh=fresh,
        released=np.asarray(page_row[first_page:old_pages], np.int32),
        src=src,
        dst=dst,
        pos_from=i,
        pos_to=j,
        runs=plan_runs(src, dst, i, j, max_run=ps),
        fills=fills,
    )


# ---- device steps ---------------------------------------------------------------------------
def _pad(a: np.ndarray, size: int, fill: int) -> jnp.ndarray:
    out = np.full(size, fill, np.int32)
    out[: len(a)] = a
    return jnp.asarray(out)


@functools.partial(jax.jit, static_argnames="impl", donate_argnames="pools")
def _splice_step(pools: kv.KVPools, src, dst, pos_from, pos_to, inv_freq, table, length, *, impl):
    """Move + rotate the kept slots into their fresh pages (pure on the pools): runs i32[M]
    each, `length` slots from `src` to `dst` at positions from `pos_from` to `pos_to` (length
    0: padding). Every layer's pools go through one `splice_rotate`, each still
    its own buffer, moved in place, viewed as one row per slot: a slot holding several rows
    (GQA: one per KV head) is one row of several vectors, all rotated alike."""
    slots = pools.num_pages * pools.page_size
    runs = Runs(src, dst, length, pos_from, pos_to)
    cs, ks = splice_rotate(
        tuple(x.reshape(slots, -1) for x in pools.moved),
        tuple(x.reshape(slots, -1) for x in pools.rotated),
        runs,
        inv_freq,
        k_dtype=pools.rotated_dtype,
        table=table,
        max_run=pools.page_size,
        impl=pools.kernel_impl(impl),
    )
    return pools.with_bands(
        [x.reshape(o.shape) for x, o in zip(cs, pools.moved, strict=True)],
        [x.reshape(o.shape) for x, o in zip(ks, pools.rotated, strict=True)],
    )


@functools.partial(jax.jit, donate_argnames="pools")
def _zero_step(pools: kv.KVPools, pages, slots):
    """Zero whole pages (i32[K]) and single slots (i32[S]) nobody references any more."""
    return kv.zero_slots(kv.zero_pages(pools, pages), slots)


def _truncate(state: PagedKVState, seq: int, length: int) -> PagedKVState:
    """Cut `seq` to `length` tokens, dropping the page references past it; zero what nobody
    references any more: released pages reaching refcount 0, and the tail of a kept partial
    page the sequence alone holds."""
    ps, p = state.page_size, state.num_pages
    n = int(state.lengths[seq])
    row = state.page_table[seq].copy()
    released = row[-(-length // ps) : -(-n // ps)].copy()
    row[-(-length // ps) :] = p
    state, dead = kv.release_pages(state, released)
    tail = np.zeros(0, np.int32)
    if length % ps and state.refcount[row[(length - 1) // ps]] == 1:
        last = int(row[(length - 1) // ps])
        tail = (last * ps + np.arange(length % ps, ps)).astype(np.int32)
    state = kv.set_sequence(state, seq, row, state.token_ids[seq][:length])
    pools = _zero_step(
        state.pools,
        _pad(dead, paged.bucket(max(len(dead), 1)), p),
        _pad(tail, ps, p * ps),  # a partial page's tail: fewer than page_size slots
    )
    return state.replace(pools=pools)


def _uses_jnp(impl) -> bool:
    return resolve(impl, TARGETS).target is None


@functools.lru_cache(maxsize=8)
def _phases(config, length: int) -> jax.Array:
    """cos/sin of the model's fp32 RoPE phases at positions [0, length), kept on device (like
    a serving stack's cos/sin cache): the jnp splice looks moved rows' rotations up here."""
    return jax.jit(phase_table, static_argnums=1)(jnp.asarray(config.rope_inv_freq()), length)


def _rotation(model, state: PagedKVState, impl) -> tuple:
    """The splice step's rotation inputs: the model's inverse frequencies and, for the jnp path,
    the phase table it looks rotations up in."""
    table = _phases(model.config, state.max_seq_len) if _uses_jnp(impl) else None
    return jnp.asarray(model.config.rope_inv_freq()), table


def _splice(model, state, seq, tokens, directives, impl):
    """Apply a validated AMORTIZE batch (pages already checked by the caller's plan)."""
    plan = plan_splice(
        tokens,
        state.page_table[seq],
        directives,
        state.page_size,
        kv.free_pages(state),
        state.num_pages,
    )
    runs = plan.runs
    m = paged.bucket(len(runs.src), MIN_MOVE_BUCKET)
    pools = _splice_step(
        state.pools,
        _pad(runs.src, m, 0),
        _pad(runs.dst, m, 0),
        _pad(runs.pos_from, m, 0),
        _pad(runs.pos_to, m, 0),
        *_rotation(model, state, impl),
        _pad(runs.length, m, 0),  # padding runs move nothing
        impl=impl,
    )
    state = kv.retain_pages(state.replace(pools=pools), plan.fresh)
    state, _ = kv.release_pages(state, plan.released)
    state = kv.set_sequence(state, seq, plan.page_row, plan.new_tokens)
    graph = nnx.split(model)
    for start, rep in plan.fills:  # in chunks, like a prefill: bounds the [T, S] score buffer
        for a in range(0, len(rep), paged.PREFILL_CHUNK):
            state, _ = paged.fill(
                model, state, seq, start + a, rep[a : a + paged.PREFILL_CHUNK], graph
            )
    return state


def _check_budget(state, seq, length, cut, spliced, cut_new, tail_len) -> None:
    """Simulate the page accounting of truncate -> splice -> prefill on a host copy of the
    refcounts; raise OutOfPagesError if any step would find the pool short."""
    ps, refcount = state.page_size, state.refcount.copy()
    row = state.page_table[seq]

    def release(pages):
        for p in pages:
            refcount[p] -= 1

    release(row[-(-cut // ps) : -(-length // ps)])  # truncation (a no-op without FORGET)
    steps = []
    if spliced:
        first = spliced[0].start // ps
        steps.append(-(-cut_new // ps) - first)
    if tail_len:
        last = row[(cut - 1) // ps] if cut % ps and not spliced else -1
        shared = bool(last >= 0 and refcount[last] > 1)
        steps.append(int(kv.pages_needed(cut_new, tail_len, shared, ps)[0]))
    for i, need in enumerate(steps):
        free = int((refcount == 0).sum())
        if need > free:
            raise OutOfPagesError(
                f"the directive batch needs {need} pages at step {i + 1}; "
                f"{free} of {state.num_pages} would be free"
            )
        refcount[np.flatnonzero(refcount == 0)[:need]] = 1
        if spliced and i == 0:
            release(row[spliced[0].start // ps : -(-cut // ps)])


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


def _check_source_pages(state: PagedKVState, seq: int, ds: Sequence[Directive]) -> None:
    """MOVE sources in other pages: in use, as many as their positions need, and none that
    the batch's FORGET truncation releases or zeroes (the sequence's own pages from the one
    holding the first FORGET start on, which it reads past the cut)."""
    ps = state.page_size
    forget = [d.start for d in ds if d.mode is Mode.FORGET]
    n = int(state.lengths[seq])
    cut_pages = set(state.page_table[seq, forget[0] // ps : -(-n // ps)].tolist()) if forget else ()
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
    model: CausalLM, state: PagedKVState, seq: int, directives: Sequence[Directive]
) -> tuple[list[Directive], tuple[int, ...]]:
    """A validated batch with every DECAY resolved (`resolve_decay`): its kept tokens chosen
    by `leyline_jax.importance` from `seq`'s KV as it is now. A DECAY at or after the batch's
    first FORGET start keeps the same tokens as text (AMORTIZE: everything from the FORGET on
    is prefilled again anyway). Returns (batch, kept positions)."""
    out, kept = [], []
    tokens = None
    cut = min([d.start for d in directives if d.mode is Mode.FORGET], default=None)
    for d in directives:
        if d.mode is Mode.DECAY:
            tokens = kv.tokens(state, seq) if tokens is None else tokens
            k = importance.decay_selection(model, state, seq, d.start, d.end, d.budget)
            kept += k
            d = resolve_decay(d, k, tokens)
            if cut is not None and d.start >= cut:
                d = Directive(d.start, d.end, d.replacement, override_pin=d.override_pin)
        out.append(d)
    return out, tuple(kept)


def apply_directives(
    model: CausalLM,
    state: PagedKVState,
    seq: int,
    directives: Sequence[Directive],
    *,
    impl: str | None = None,
    report: bool = False,
) -> PagedKVState | tuple[PagedKVState, Applied]:
    """Apply an atomic batch of non-overlapping directives (pre-batch coordinates) to `seq`.

    AMORTIZE and MOVE edits are spliced; a DECAY is first resolved into a MOVE of the tokens it
    keeps (`resolve_decays`); if any directive is FORGET, everything from the first FORGET
    start is dropped and re-prefilled (edits before it are still spliced). Raises
    `DirectiveError` (invalid input) or `OutOfPagesError` before anything changes. Donates
    `state`. `impl` picks the splice implementation (see `pallas_kernels.splice_rotate`).
    With `report=True` returns `(state, Applied)`: how many tokens were reused, spliced and
    prefilled.
    """
    try:
        seq = kv.check_seq(state, seq, must_be_open=True)
    except SequenceError as e:
        raise DirectiveError(str(e)) from e
    length = int(state.lengths[seq])
    tokens = kv.tokens(state, seq)
    ds = validate(directives, length, model.config.vocab_size, tokens)
    if not ds:
        return (state, Applied(length, 0, 0, length)) if report else state
    ds, kept = resolve_decays(model, state, seq, ds)
    ds = validate(ds, length, model.config.vocab_size, tokens)
    _check_source_pages(state, seq, ds)
    new_tokens = apply_to_list(tokens, ds)
    if len(new_tokens) > state.max_seq_len:
        raise DirectiveError(
            f"the edited sequence would hold {len(new_tokens)} tokens, more "
            f"than max_seq_len={state.max_seq_len}"
        )
    if len(new_tokens) == 0:
        raise DirectiveError("the edit would leave the sequence empty: free it instead")
    if not ds:  # a DECAY that kept nothing of an empty span
        return (state, Applied(length, 0, 0, length)) if report else state
    forget = [d for d in ds if d.mode is Mode.FORGET]
    cut = forget[0].start if forget else length
    spliced = [d for d in ds if d.end <= cut and d.mode in SPLICED]
    cut_new = cut + sum(d.delta for d in spliced)
    tail = new_tokens[cut_new:] if forget else []
    _check_budget(state, seq, length, cut, spliced, cut_new, len(tail))

    # ---- apply ------------------------------------------------------------------------------
    if forget:
        state = _truncate(state, seq, cut)
        tokens = tokens[:cut]
    if spliced:
        state = _splice(model, state, seq, tokens, spliced, impl)
    if tail:
        state, _ = paged.prefill(model, state, seq, tail)
    if not report:
        return state
    reused = ds[0].start
    moved = sum(d.moved for d in spliced)
    kept_down = (cut - reused) - sum(d.end - d.start for d in spliced)
    spl = kept_down + moved
    return state, Applied(reused, spl, len(new_tokens) - reused - spl, len(new_tokens), moved, kept)


def apply_directive(
    model: CausalLM, state: PagedKVState, seq: int, directive: Directive, *, impl: str | None = None
) -> PagedKVState:
    """Apply one directive to `seq` (see `apply_directives`)."""
    return apply_directives(model, state, seq, [directive], impl=impl)


def precompile(model: CausalLM, state: PagedKVState, *, impl: str | None = None):
    """Compile (and run once, on padding that changes nothing) the directive steps for every
    bucket one sequence's edit can meet: splice moves up to `max_seq_len` runs of slots, zeroing
    up to a sequence's pages. Returns the state and how many shapes ran."""
    p, ps = state.num_pages, state.page_size
    runs = 0
    top = paged.bucket(state.max_seq_len, MIN_MOVE_BUCKET)
    for m in (1 << i for i in range(MIN_MOVE_BUCKET.bit_length() - 1, top.bit_length())):
        zeros = _pad([], m, 0)  # every run is padding (length 0): nothing moves
        pools = _splice_step(
            state.pools,
            zeros,
            zeros,
            zeros,
            zeros,
            *_rotation(model, state, impl),
            zeros,
            impl=impl,
        )
        state = state.replace(pools=pools)
        runs += 1
    for k in (1 << i for i in range(paged.bucket(state.max_pages_per_seq).bit_length())):
        pools = _zero_step(state.pools, _pad([], k, p), _pad([], ps, p * ps))
        state = state.replace(pools=pools)
        runs += 1
    return state, runs


def compile_counts() -> dict[str, int]:
    """How many shapes the splice and truncate steps have compiled (for tests and benchmarks)."""
    return {"splice": _splice_step._cache_size(), "zero": _zero_step._cache_size()}


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
    "compile_counts",
    "plan_splice",
    "precompile",
]
