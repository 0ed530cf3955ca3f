"""The device side of an edit: zero what a FORGET evicted, move and rotate the kept KV into its
new slots, then prefill what is new.

`leyline_jax.allocator.plan_edit` decided every page on the host (the old and new page-table rows,
the pages and slots to zero, a copy on write); here the slots follow from the directives
(`plan_splice`: each kept token's old slot and position -> new ones, MOVE sources included, and
the spans left to prefill), and the pools go through one zeroing step, one fused move+rotate
pass over every layer (`splice_pools`: `pallas_kernels.splice_rotate`, runs of consecutive
slots), and the ragged step for the fills (`leyline_jax.paged.fill`). The splice machinery sees
"a band that moves" and "a band that moves and rotates" (halves layout), as the family names
them (`config.kv_bands()`; MLA: `c_kv` and `k_pe`, GQA: V and K), so every family shares it.

Programs. An edit's splice moves its runs in blocks of at most the state's `max_step_tokens`
runs (a shape of `shapes`), each block one call of `splice_pools`. On an accelerator that call is
one program over every layer's pools (`splice_step`; one Mosaic GPU kernel call on a Hopper,
one TPU kernel call a layer on a TPU): one dispatch a block, where a program a layer cost 27
dispatches of ~29 us an edit on an H200 (the splice reached 6.5% of the copy bandwidth at 8k
downstream tokens, 53% at 131k). On a CPU, where the jnp path runs, the same program runs on
each layer's pools in turn (`KVPools.by_layer`): its compile time is flat in depth, as every
step's is (BENCHMARKS.md, "Startup: what a step shape costs to compile, by depth"), and one
program's is not. The choice is `pallas_kernels.dispatch.per_layer_programs`. Measured both ways
(`python -m benchmarks.splice_bench --by-depth 8,30,60 --rounds 3 --repeats 5`: this 2-core CPU,
shared with other jobs; DeepSeek-V2-Lite's cache widths; each depth and form in a fresh process;
medians of three rounds): a splice shape (16 or 512 runs) compiled in 0.30-0.51 s a layer's
program at 8, 30 and 60 layers, and in 0.65-0.77, 1.2 and 2.2-2.3 s as one program; a splice of
2048 downstream tokens ran in 17, 48 and 66 ms layer by layer, 5.1, 18 and 65 ms as one program
(at 60 layers the rounds spread 60-106 and 54-65 ms). The warmup compiles every move shape (six
by default): one program over every layer would add about 1.4, 5 and 12 s to a cold start at
those depths, for up to 30 ms saved a splice of that size (at 27 layers
`benchmarks/splice_bench.py --splice-only` times both side by side: one program 1.5-2.2x
faster).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from leyline_jax import kv_pools, paged
from leyline_jax import kv_state as kv
from leyline_jax.allocator import EditPlan
from leyline_jax.kv_pools import KVPools
from leyline_jax.kv_state import PagedKVState, bucket, padded
from leyline_jax.model import Split
from pallas_kernels.dispatch import per_layer_programs, resolve
from pallas_kernels.splice_rotate import TARGETS, splice_rotate
from pallas_kernels.splice_runs import Runs, phase_table, plan_runs

MIN_MOVE_BUCKET = 16


# ---- host: which slot goes where -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Moves:
    """A splice's moved slots (kept downstream tokens, then MOVE sources) and its fills."""

    src: np.ndarray  # i32[M] old slot
    dst: np.ndarray  # i32[M] new slot
    pos_from: np.ndarray  # i32[M] old position
    pos_to: np.ndarray  # i32[M] new position
    runs: Runs  # the same moves as runs of consecutive slots (at most a page each)
    fills: list[tuple[int, tuple[int, ...]]]  # (new start, tokens to prefill) left to right


def plan_splice(
    tokens: Sequence[int],  # the sequence before the splice (its KV: `old_row`)
    old_row: np.ndarray,  # i32[max_pages]
    row: np.ndarray,  # i32[max_pages] after: pages from the first edit's on are fresh
    directives: Sequence,  # validated, sorted, AMORTIZE or MOVE (`leyline_jax.directives`)
    page_size: int,
) -> Moves:
    """Every kept token from the first edit's page on moves to its new index (rotated by its
    shift), MOVE sources are copied from wherever they are to their place in the replacement,
    and the rest of each replacement is left to prefill there."""
    n, ps = len(tokens), page_size
    starts = np.array([d.start for d in directives])
    ends = np.array([d.end for d in directives])
    cum = np.concatenate([[0], np.cumsum([d.delta for d in directives])])
    i = np.arange(directives[0].start // ps * ps, n)  # every old token on a rebuilt page
    k = np.searchsorted(starts, i, side="right") - 1  # last directive starting at or before i
    i = i[~((k >= 0) & (i < ends[np.maximum(k, 0)]))]  # not deleted
    j = i + cum[np.searchsorted(ends, i, side="right")]  # shifted by the edits before it
    fills, mi, mj, src = [], [i], [j], [old_row[i // ps] * ps + i % ps]
    for q, d in enumerate(directives):
        at, cursor = d.start + int(cum[q]), 0  # the replacement's new start
        for x in d.sources:
            if x.offset > cursor:
                fills.append((at + cursor, d.replacement[cursor : x.offset]))
            pos = x.position + np.arange(x.length)
            mi.append(pos)
            mj.append(at + x.offset + np.arange(x.length))
            pages = np.asarray(x.pages)[pos // ps - x.position // ps] if x.pages else None
            src.append((old_row[pos // ps] if pages is None else pages) * ps + pos % ps)
            cursor = x.offset + x.length
        if cursor < len(d.replacement):
            fills.append((at + cursor, d.replacement[cursor:]))
    i, j = np.concatenate(mi), np.concatenate(mj)
    src, dst = np.concatenate(src), row[j // ps] * ps + j % ps
    src, dst, i, j = (a.astype(np.int32) for a in (src, dst, i, j))
    return Moves(src, dst, i, j, plan_runs(src, dst, i, j, max_run=ps), fills)


# ---- device steps ---------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="impl", donate_argnames="pools")
def splice_step(pools: KVPools, runs: Runs, inv_freq, table, *, impl=None) -> KVPools:
    """`splice_pools` as one program over the layers `pools` holds (every layer, or one)."""
    slots = pools.num_pages * pools.page_size
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
        [c.reshape(x.shape) for c, x in zip(cs, pools.moved, strict=True)],
        [k.reshape(x.shape) for k, x in zip(ks, pools.rotated, strict=True)],
    )


splice_layer = splice_step  # the same program, by the name it has on one layer's pools


def splice_pools(pools: KVPools, runs: Runs, inv_freq, table, *, impl=None) -> KVPools:
    """Move + rotate slots of every layer's pools along `runs` (i32[M] each: `length` slots
    from `src` to `dst` at positions from `pos_from` to `pos_to`; length 0: padding), by
    `splice_rotate`, each pool moved in place, viewed as one row per slot (a slot holding
    several rows, GQA's KV heads, is one row of several vectors, all rotated alike).
    `inv_freq` f32[width/2] and `table` (`rotation_tables`). Donates `pools`. The public entry
    the benchmarks time.

    One program for every layer (`splice_step` over all of them), or one program a layer run
    on each in turn where `pallas_kernels.dispatch.per_layer_programs` says so (the module
    docstring says when and why)."""
    if per_layer_programs(impl):
        return pools.by_layer(splice_step, runs, inv_freq, table, impl=impl)
    return splice_step(pools, runs, inv_freq, table, impl=impl)


@functools.partial(jax.jit, donate_argnames="pools")
def zero_step(pools: KVPools, pages, slots):
    """Zero whole pages (i32[K]) and single slots (i32[S]) nobody references any more."""
    return kv_pools.zero_slots(kv_pools.zero_pages(pools, pages), slots)


@functools.lru_cache(maxsize=8)
def rotation_tables(config, length: int, impl=None) -> tuple[jax.Array, jax.Array | None]:
    """The splice's rotation inputs, kept on device (like a serving stack's cos/sin cache):
    the model's inverse frequencies and, for the jnp path, cos/sin of its fp32 phases at
    positions [0, length), where moved rows' rotations are looked up (with `impl` None the
    platform chooses at lowering, so the jnp path may be the one: the table is made)."""
    inv = jnp.asarray(config.rope_inv_freq())
    if impl is not None and resolve(impl, TARGETS).target is not None:
        return inv, None
    return inv, jax.jit(phase_table, static_argnums=1)(inv, length)


def padded_runs(runs: Runs, maximum: int | None = None, growth: int = 2) -> Runs:
    """`runs` padded to their bucket (a power of `growth`, at most `maximum`) with runs of
    length 0 (they move nothing)."""
    m = bucket(len(runs.src), MIN_MOVE_BUCKET, maximum, growth)
    return Runs(*(padded(a, m, 0) for a in runs))


def _blocks(runs: Runs, size: int, growth: int):
    """`runs` in blocks of at most `size` runs, each padded (every run writes a fresh slot:
    the blocks are independent)."""
    for a in range(0, len(runs.src), size):
        yield padded_runs(Runs(*(x[a : a + size] for x in runs)), size, growth)


def shapes(state: PagedKVState) -> list[tuple[str, int]]:
    """Every shape an edit's device steps over `state` can take: ("move", runs) for the
    splice, in blocks of at most the state's `max_step_tokens` runs, ("zero", pages) for an
    edit's zeroing and ("purge", pages) for a purge's, in blocks of at most `ZERO_BLOCK`."""
    moves = [("move", m) for m in state.ladder(state.max_step_tokens, MIN_MOVE_BUCKET)]
    return moves + [(kind, k) for kind in ("zero", "purge") for k in state.ladder(kv.ZERO_BLOCK)]


def run_edit(
    model,
    state: PagedKVState,
    seq: int,
    plan: EditPlan,
    before: Sequence[int],
    spliced: Sequence,
    tail: Sequence[int],
    *,
    impl=None,
) -> PagedKVState:
    """Run an edit `plan` of `seq` on the device: zero what the truncation freed; splice
    `spliced` (the AMORTIZE and MOVE directives before the cut) over `before` (the sequence's
    tokens up to the cut) and prefill their replacements; then prefill `tail` (what a FORGET
    re-prefills: the rest of the edited sequence), copying a shared partial page first.
    Donates `state`."""
    p, ps = state.num_pages, state.page_size
    pools, fills = state.pools, []
    if len(plan.dead) or len(plan.dead_slots):
        slots = padded(plan.dead_slots, ps, p * ps)
        for a in range(0, max(len(plan.dead), 1), kv.ZERO_BLOCK):
            dead = plan.dead[a : a + kv.ZERO_BLOCK]
            pools = pools.by_layer(
                zero_step, padded(dead, state.bucket(len(dead), 1, kv.ZERO_BLOCK), p), slots
            )
            slots = padded([], ps, p * ps)  # once
    if spliced:
        moves = plan_splice(before, plan.old_row, plan.row, spliced, ps)
        tables = rotation_tables(model.config, state.max_seq_len, impl)
        for runs in _blocks(moves.runs, state.max_step_tokens, state.bucket_growth):
            pools = splice_pools(pools, runs, *tables, impl=impl)
        fills = moves.fills
    state = plan.state.replace(pools=pools)
    graph = Split.of(model)
    for start, toks in fills:
        state = paged.fill(model, state, seq, start, toks, graph)
    if len(tail):
        start = int(state.lengths[seq]) - len(tail)
        state = paged.fill(model, state, seq, start, list(tail), graph, cow=plan.cow)
    return state


def precompile(model, state: PagedKVState, shape: tuple[str, int], *, impl=None):
    """Compile (and run once, on padding that changes nothing) the edit's device step of
    `shape` (one of `shapes`) and return the state."""
    (kind, k), p, ps = shape, state.num_pages, state.page_size
    if kind == "move":  # every run is padding (length 0): nothing moves
        zeros = padded([], k, 0)
        tables = rotation_tables(model.config, state.max_seq_len, impl)
        pools = splice_pools(state.pools, Runs(*[zeros] * 5), *tables, impl=impl)
    elif kind == "zero":
        pools = state.pools.by_layer(zero_step, padded([], k, p), padded([], ps, p * ps))
    else:  # a purge's: every id "nowhere" changes nothing
        return state.zeroed(np.full(k, p, np.int32))
    return state.replace(pools=pools)


def compile_counts() -> dict[str, int]:
    """How many shapes the splice and zeroing steps have compiled (tests and benchmarks)."""
    return {"splice": splice_step._cache_size(), "zero": zero_step._cache_size()}
