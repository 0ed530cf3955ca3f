"""ragged_paged_attention's GPU kernel, in Mosaic GPU (Hopper: H100, H200; same contract as
`pallas_kernels.ragged_paged_attention`, whose module docstring defines rows, pages and both
forms, MLA absorbed and GQA grouped).

Work. A query column is one (token, head) pair; a unit's columns are `qc` of them: `hb` heads of
one KV group (all N heads for MLA, the N/G heads sharing a KV head for GQA, or a block of them)
times `qc / hb` consecutive tokens of one row (a token item). Split-KV (flash-decoding, with
FlashMLA's host-made tile schedule): the programs are persistent, `plan.parts` per head block,
as many in all as the SMs hold at once (`num_sms` times the programs one SM's shared memory
holds). Before the call a split schedule (`split_schedule`, jnp, in the caller's step) cuts the
items' kv blocks (BK = 64 slots, whole pages) into units so that every part gets the same work: a
short row is one unit, a long row is spread over many parts. A program runs its part's units in
turn; each unit writes its partial output (normalised over its own blocks) and its log-sum-exp,
and after the call a combine (`combine_units`, jnp) merges each item's units by log-sum-exp. The
schedule and the combine are arguments (`schedule=`, `combine=`): a host-made schedule can be
handed in, and a test can break either.

The pipeline, in one warpgroup. A unit's query terms come in by TMA; then its kv blocks, two
stages deep (`plan.stages`): block j + 1's pages are requested (one TMA per page and band, a
barrier each) before block j's matmuls, into the stage block j - 1 left, and the page numbers of
a block are read from the page table a block before that. An fp32 rotated band has one stage: it
is split into bf16 terms as soon as it arrives and the next block's is requested then, early in
the block. Per block, on the tensor cores (wgmma, the slots as M = 64):

    scores^T [BK, 3 qc] = C [BK, R] @ Q_lat3^T + K [BK, Dr] @ Q_pe3^T     (MLA; GQA: K @ Q3^T)
    out^T   [Dv, qc]   += C^T [Dv, BK] @ P^T [BK, qc]  (P's three terms)  (GQA: V^T @ P^T)

where Q3 holds the three terms of the queries side by side (N = 3 qc: one wgmma per operand tile,
C read from shared memory once, not once per term; the three column groups are summed in
registers), with an online softmax over the slots (axis 0). A decode token of V2-Lite (16 heads)
fills N = 16 (48 for the scores) instead of padding 16 heads to M = 64.

The contract is fp32: the tensor cores take 16-bit operands, so every fp32 operand is split into
three bf16 terms (hi + mid + lo carry 24 bits of mantissa: `split3`; the queries' terms are made
before the call, `split3_bits`) and the products are summed in fp32 accumulators. The moved band
(C / V) is bf16 already: exact, one term. Q (scaled, in fp32) and P take three terms; an fp32
rotated band K takes three, each met by all three of Q's. Slots past a row's kv_lens (unused
slots of its last page, pages never requested) are zeroed in shared memory before the value
matmul and masked out of the scores, so poisoned pages never reach a result. Measured with the
previous version of this kernel on an H200: within 0.9-1.5e-5 of float64 at 4k-32k slots (the
jnp path's: 0.3-1.6e-6; not chased: the tensor cores' fp32 accumulation is a likely cause).

Shared memory (Mosaic GPU's count, `Plan.smem`, which the lowering gate holds to the byte): the
query terms for the program's life; per unit the kv stages, whose bytes then hold the unit's
output tile; per block the rotated band's terms, whose bytes then hold P's. V2-Lite / V3 (MLA,
qc 16): 227,440 B, one program an SM (Q's terms 54 KB, two 64 KB latent stages, the fp32 K stage
16 KB and its terms 24 KB); two programs cannot fit: the queries' terms and a single latent block
alone exceed half an SM. Llama-8B-shaped GQA (qc 16): 84,112 B, two programs an SM.

The host side (`pallas_kernels.ragged_paged_gpu_plan`): the static `Plan`, the token items, the
split schedule, the query columns and the combine. Shapes it takes (`unsupported` says why not):
the moved band bf16 (stored as bf16 or its bits), the rotated band fp32 or bf16; both bands'
widths multiples of 64 (a 128-byte swizzled bf16 row); a page size dividing 64 and at least 8;
head blocks that tile the heads; the scratch within shared memory. The dispatch sends every
other case to jnp.

Speed (a model; the device suite measures it). The previous version (one block's pages in, then
its matmuls; kv splits fixed per call) reached 13-16% of the copy bandwidth on an H200 in decode
at 32k tokens (C = 32 / 128 rows of one V2-Lite layer): about 16 us a 64-slot block a program.
Per block and SM here, V2-Lite: 80 KB of pages (64 slots of 1024 B latent + 256 B fp32 rope) from
HBM, its share of the copy bandwidth taking 2.5 us (4.2 TB/s over 132 SMs), against ~520 KB of
shared-memory traffic (the wgmmas' reads: scores 150 KB, the values' three P terms 240 KB; the
pages' TMA writes 80 KB; the terms' writes 30 KB) at 128 B a clock, ~2.3 us at 1.98 GHz: the
two are balanced, so the block's other latency (softmax, the terms, fences; what the previous
version's 16 us hold beyond its ~5 us of modelled work) decides how near the bandwidth it gets.
V3 (128 heads: 8 head blocks, each the same in-SM work for the same pages) is bound by that work
near 14% of the bandwidth: the fp32 queries' three terms at N = 16 columns are what limit it.
Llama-8B-shaped GQA: ~130 KB of shared-memory traffic per 32 KB block: bandwidth-bound.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dispatch import mosaic_gpu_interpret
from pallas_kernels.ragged_paged_gpu_plan import (
    BK,
    NUM_SMS,
    TERMS,
    Items,
    Plan,
    Schedule,
    columns,
    combine_units,
    plan_for,
    scatter_items,
    split3,
    split_schedule,
    token_items,
    unsupported,
)

__all__ = ["ragged_paged_attention_gpu", "unsupported"]

_F32, _BF16 = jnp.float32, jnp.bfloat16
_EMPTY = -1e30  # the running max before any slot (finite: exp(_EMPTY - _EMPTY) is 1, not NaN)


def _layout(x, layout, interpret: bool):
    """x in registers in `layout` (the interpreter has no layouts: x as it is)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _iota(shape, dim: int, interpret: bool):
    """i32 indices along `dim` of a wgmma-layout register array of `shape`."""
    return _layout(jax.lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA, interpret)


def _swizzled(shape, dtype, swizzle: int = 128):
    """Shared memory a wgmma reads: (8, swizzle-byte) tiles, swizzled (the operands of one wgmma
    share a swizzle; a row narrower than it takes its own width)."""
    row_bytes = min(swizzle, shape[-1] * jnp.dtype(dtype).itemsize)
    elems = row_bytes // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(row_bytes))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _load(ref, interpret: bool):
    """A shared-memory tile into registers in the wgmma layout."""
    return ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)


def _matmul(terms, shape, interpret: bool):
    """sum of a @ b over `terms` [(a_ref, a_transposed, b_ref, b_transposed)], bf16 products in
    an fp32 accumulator: wgmmas on the tensor cores. Mosaic GPU's interpreter takes no
    transposed wgmma operand, so there the same sum is formed with jnp from the same shared
    memory (the operands' orientation is then checked by the compiled tests only)."""
    if interpret:
        out = jnp.zeros(shape, _F32)
        for a, at, b, bt in terms:
            a, b = (a[...].T if at else a[...]), (b[...].T if bt else b[...])
            out = out + jnp.dot(a, b, preferred_element_type=_F32)
        return out

    def run(acc):
        for a, at, b, bt in terms:
            a = plgpu.transpose_ref(a, (1, 0)) if at else a
            plgpu.wgmma(acc, a, plgpu.transpose_ref(b, (1, 0)) if bt else b)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, _F32))


class _Refs(NamedTuple):
    """The kernel's operands (GMEM) and its program-long scratch (SMEM, barriers)."""

    item_of: object  # i32[U]: the schedule (`Schedule`)
    lo: object  # i32[U]
    hi: object  # i32[U]
    begin: object  # i32[parts + 1]
    row: object  # i32[items]: the token items (`Items`)
    first: object  # i32[items]
    ntok: object  # i32[items]
    kv_len: object  # i32[items]
    pages: object  # i32[B, W]: the page table
    ql: object  # bf16[head_blocks, items, 3 * qc, Dv]: Q_lat's terms (MLA; else a stand-in)
    qk: object  # bf16[head_blocks, items, 3 * qc, Dk]: Q_pe's (GQA: Q's) terms
    c: object  # bf16[P, page_size, Dv] or [P, page_size, G, Dv]: the moved band (C / V)
    k: object  # [P, page_size, Dk] or [P, page_size, G, Dk]: the rotated band (K), as stored
    o: object  # f32[head_blocks, U, Dv, qc]: each unit's partial output (out)
    lse: object  # f32[head_blocks, U, BK, qc]: its log-sum-exp, one row per slot row (out)
    ql_smem: object  # bf16[3 * qc, Dv] (MLA only)
    qk_smem: object  # bf16[3 * qc, Dk]
    q_bar: object  # the queries' two barriers
    c_bar: object  # one per (stage, page)
    k_bar: object  # one per (K stage, page)


class _Unit(NamedTuple):
    """What a unit's blocks need to know (i32 scalars)."""

    row: object  # the item's row: its page-table row
    group: object  # the KV group of the unit's head block (0 for MLA)
    kv_len: object  # the row's slots
    first: object  # the item's first query position
    last: object  # its last
    lo: object  # the unit's kv blocks [lo, hi)
    hi: object


def _narrow(qc: int) -> int:
    """P's swizzle (its rows are qc wide), which C's and Q_lat's match (a wgmma's operands share
    one)."""
    return min(128, 2 * qc)


def _kernel(*refs, plan: Plan, page_size: int, interpret: bool):
    """One persistent program (head block, part): the part's units in turn (`begin[p]` ..
    `begin[p + 1]` - 1) for that head block. Scratch is scoped in the kernel: the query terms and
    barriers for the program's life."""
    operands = _Refs(*refs, *[None] * 5)
    dk, dv = operands.k.shape[-1], operands.c.shape[-1]
    qc, pages = plan.qc, BK // page_size
    scratch = [
        _swizzled((TERMS * qc, dv), _BF16, _narrow(qc)) if plan.lat else None,  # Q_lat terms
        _swizzled((TERMS * qc, dk), _BF16),  # Q_pe (GQA: Q) terms
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        plgpu.Barrier(num_arrivals=1, num_barriers=plan.stages * pages),
        plgpu.Barrier(num_arrivals=1, num_barriers=plan.k_stages * pages),
    ]

    def program(*scratch):
        if not plan.lat:
            scratch = (None, *scratch)
        r = _Refs(*refs, *scratch)
        head, p = jax.lax.axis_index("head"), jax.lax.axis_index("part")
        unit = functools.partial(_unit, r, plan=plan, page_size=page_size, interpret=interpret)
        jax.lax.fori_loop(r.begin[p], r.begin[p + 1], unit, head)

    pl.run_scoped(program, *[s for s in scratch if s is not None])


def _unit(r: _Refs, u, head, *, plan: Plan, page_size: int, interpret: bool):
    """One unit of head block `head`: an item's kv blocks [lo, hi) -> its partial output and
    log-sum-exp."""
    qc, dv, dk = plan.qc, r.c.shape[-1], r.k.shape[-1]
    it, lo, hi = r.item_of[u], r.lo[u], r.hi[u]
    group = head // (plan.head_blocks // plan.groups)
    row, first, ntok, kv_len = r.row[it], r.first[it], r.ntok[it], r.kv_len[it]
    last = first + ntok - 1

    plgpu.copy_gmem_to_smem(r.qk.at[head, it], r.qk_smem, r.q_bar.at[0])
    if plan.lat:
        plgpu.copy_gmem_to_smem(r.ql.at[head, it], r.ql_smem, r.q_bar.at[1])
        plgpu.barrier_wait(r.q_bar.at[1])
    plgpu.barrier_wait(r.q_bar.at[0])

    at = _Unit(row, group, kv_len, first, last, lo, hi)
    o, m, total = pl.run_scoped(
        functools.partial(_blocks, r, at, plan=plan, page_size=page_size, interpret=interpret),
        _swizzled((plan.stages, BK, dv), _BF16, _narrow(qc)),  # the moved band's stages
        _swizzled((plan.k_stages, BK, dk), r.k.dtype),  # the rotated band's, as stored
    )
    some = total > 0
    o = o / jax.lax.broadcast_in_dim(jnp.where(some, total, 1.0), o.shape, [1])
    lse = jnp.where(some, m + jnp.log(jnp.where(some, total, 1.0)), _EMPTY)

    def store(o_smem, lse_smem):  # in the stages' bytes: every load into them was waited for
        o_smem[...] = o
        lse_smem[...] = jax.lax.broadcast_in_dim(lse, (BK, qc), [1])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, r.o.at[head, u])
        plgpu.copy_smem_to_gmem(lse_smem, r.lse.at[head, u])
        plgpu.wait_smem_to_gmem(0)  # before the next unit's loads reuse these bytes

    pl.run_scoped(store, plgpu.SMEM((dv, qc), _F32), plgpu.SMEM((BK, qc), _F32))
    return head


def _blocks(r: _Refs, at: _Unit, c_ring, k_ring, *, plan: Plan, page_size: int, interpret: bool):
    """The unit's kv blocks, `plan.stages` deep: block j + stages - 1's pages are requested
    before block j's matmuls (the rotated band's too when it is stored as bf16; stored as fp32,
    its single stage is requested again for block j + 1 once block j's terms are made from it).
    -> (out^T, max, sum) in registers."""
    qc, hb, pages, depth = plan.qc, plan.hb, BK // page_size, plan.stages
    dv = r.c.shape[-1]
    row, kv_len, lo, hi = at.row, at.kv_len, at.lo, at.hi
    wgmma = plgpu.Layout.WGMMA
    col = wgmma.reduce(0)
    k_ahead = plan.k_terms == 1  # bf16: the rotated band's stages go with the moved band's

    def band(ref, page):
        return ref.at[page] if plan.lat else ref.at[page, :, at.group]

    def pages_of(blk, fn):
        """fn(p) for each page of block blk that holds slots below kv_len (the others are never
        requested, so never waited for)."""
        for p in range(pages):
            pl.when(blk * BK + p * page_size < kv_len)(functools.partial(fn, p))

    def indices(blk):
        """Block blk's page numbers, loaded a block before they are used (i32 scalars; past the
        row's pages any entry, never used)."""
        last = r.pages.shape[1] - 1
        return tuple(r.pages[row, jnp.minimum(blk * pages + p, last)] for p in range(pages))

    def fetch(blk, idx, ref, ring, bar, stage):
        def one(p):
            rows = pl.ds(p * page_size, page_size)
            dst, barrier = ring.at[stage, rows], bar.at[stage * pages + p]
            plgpu.copy_gmem_to_smem(band(ref, idx[p]), dst, barrier)

        pages_of(blk, one)

    def wait(blk, bar, stage):
        pages_of(blk, lambda p: plgpu.barrier_wait(bar.at[stage * pages + p]))

    def fetch_both(blk, idx, stage):
        fetch(blk, idx, r.c, c_ring, r.c_bar, stage)
        if k_ahead:
            fetch(blk, idx, r.k, k_ring, r.k_bar, stage)

    first = indices(lo)
    for d in range(depth - 1):  # the prologue: the first stages - 1 blocks requested
        idx = first if d == 0 else indices(lo + d)
        pl.when(lo + d < hi)(functools.partial(fetch_both, lo + d, idx, d))
    if not k_ahead:
        pl.when(lo < hi)(lambda: fetch(lo, first, r.k, k_ring, r.k_bar, 0))

    def scores(blk, stage, k_terms):
        """scores^T [BK, qc]: each Q term's columns side by side (N = 3 qc, one wgmma per operand
        tile), then the three column groups summed."""
        terms = [(c_ring.at[stage], False, r.ql_smem, True)] if plan.lat else []
        terms += [(k, False, r.qk_smem, True) for k in k_terms]
        s3 = _matmul(terms, (BK, TERMS * qc), interpret)
        return s3[:, :qc] + s3[:, qc : 2 * qc] + s3[:, 2 * qc :]

    def block(blk, carry):
        o, m, total, idx_ahead = carry
        stage = jax.lax.rem(blk - lo, depth)
        ahead = blk + depth - 1  # into the stage block blk - 1 left
        fetch_ahead = functools.partial(fetch_both, ahead, idx_ahead)
        pl.when(ahead < hi)(lambda: fetch_ahead(jax.lax.rem(stage + depth - 1, depth)))
        idx_next = idx_ahead if depth == 2 else indices(blk + 1)  # block blk + 1's
        idx_ahead = indices(ahead + 1)  # in flight during this block's matmuls

        if k_ahead:  # the stage is the operand (bf16)
            wait(blk, r.k_bar, stage)
            wait(blk, r.c_bar, stage)
            s = scores(blk, stage, [k_ring.at[stage]])
        else:

            def split_k(k_smem):
                wait(blk, r.k_bar, 0)
                kf = _load(k_ring.at[0], interpret).astype(_F32)
                kslot = blk * BK + _iota(kf.shape, 0, interpret)
                kf = jnp.where(kslot < kv_len, kf, jnp.zeros_like(kf))
                for j, term in enumerate(split3(kf)[: plan.k_terms]):
                    k_smem[j] = term
                plgpu.commit_smem()  # and every thread is past its read of the stage
                pl.when(blk + 1 < hi)(lambda: fetch(blk + 1, idx_next, r.k, k_ring, r.k_bar, 0))
                wait(blk, r.c_bar, stage)
                return scores(blk, stage, [k_smem.at[j] for j in range(plan.k_terms)])

            s = pl.run_scoped(split_k, _swizzled((plan.k_terms, BK, r.k.shape[-1]), _BF16))

        srow = blk * BK + _iota((BK, qc), 0, interpret)
        scol = _iota((BK, qc), 1, interpret)
        seen = srow <= jnp.minimum(at.first + scol // hb, at.last)  # causal; padding = last
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=0))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [1]))
        total = total * alpha + p.sum(axis=0)
        o = o * jax.lax.broadcast_in_dim(alpha, o.shape, [1])
        c_stage = c_ring.at[stage]

        @pl.when((blk + 1) * BK > kv_len)
        def _zero_unused():  # slots past kv_len: stale or poisoned, never multiplied into out
            slot = blk * BK + _iota((BK, 64), 0, interpret)
            for lo_col in range(0, dv, 64):
                cols = pl.ds(lo_col, 64)
                x = _load(c_stage.at[:, cols], interpret)
                c_stage[:, cols] = jnp.where(slot < kv_len, x, jnp.zeros_like(x))

        def values(p_smem):
            for i, term in enumerate(split3(p)):
                p_smem[i] = term
            plgpu.commit_smem()
            value_terms = [(c_stage, True, p_smem.at[i], False) for i in range(TERMS)]
            return _matmul(value_terms, (dv, qc), interpret)

        o = o + pl.run_scoped(values, _swizzled((TERMS, BK, qc), _BF16))
        return o, m_new, total, idx_ahead

    o = _layout(jnp.zeros((dv, qc), _F32), wgmma, interpret)
    m = _layout(jnp.full((qc,), _EMPTY, _F32), col, interpret)
    total = _layout(jnp.zeros((qc,), _F32), col, interpret)
    o, m, total, _ = jax.lax.fori_loop(lo, hi, block, (o, m, total, indices(lo + depth - 1)))
    return o, m, total


def ragged_paged_attention_gpu(
    q_lat,  # [T, N, R] f32, or None (the grouped form)
    q_pe,  # [T, N, Dr] f32 (GQA: Q [T, N, D])
    c_kv,  # [P, page_size, R] bf16 or its bits (GQA: V [P, page_size, G, D])
    k_pe,  # [P, page_size, Dr] f32 / bf16 / bf16 bits (GQA: K [P, page_size, G, D])
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    num_rows,  # i32[1]
    *,
    scale: float,
    kv_type,
    k_type,
    interpret=False,
    num_sms: int = NUM_SMS,
    schedule: Callable[[Items, Plan], Schedule] = split_schedule,
    combine: Callable = combine_units,
) -> jax.Array:  # f32[T, N, R]
    """The Mosaic GPU kernel; same contract as `ref_ragged_paged_attention` (validated by the
    caller). `kv_type` / `k_type`: the float types the bands' stored values mean.
    `interpret`: False (compiled, on a Hopper GPU), True (Mosaic GPU's interpreter with
    `mosaic_gpu_interpret()`'s params) or the interpreter's params themselves (e.g. with its race
    detector on).
    `num_sms`: the SMs the persistent programs fill (`plan.per_sm` programs each).
    `schedule(items, plan)` -> the split schedule's arrays (default: `split_schedule`, jnp, in
    the caller's program; a host-made `Schedule` may be passed as `lambda *_: sched`), and
    `combine(o, lse, schedule, plan)` -> each item's output (default: `combine_units`): both
    injectable so that a test can break them."""
    if why := unsupported(q_lat, q_pe, c_kv, k_pe, page_indices, kv_type, k_type):
        raise ValueError(f"the GPU attention kernel does not take these arrays: {why}")
    (t, n, _), page_size = q_pe.shape, c_kv.shape[1]
    if t == 0:
        return jnp.zeros((0, n, c_kv.shape[-1]), _F32)
    plan = plan_for(q_lat, q_pe, c_kv, k_pe, page_indices, jnp.dtype(k_type), num_sms=num_sms)
    if isinstance(plan, str):
        raise ValueError(f"the GPU attention kernel does not take these arrays: {plan}")
    items = token_items(kv_lens, cu_q_lens, num_rows, plan)
    sched = schedule(items, plan)
    if c_kv.dtype != _BF16:  # raw bits: a bitcast, no copy
        c_kv = jax.lax.bitcast_convert_type(c_kv, _BF16)
    if k_pe.dtype == jnp.uint16:
        k_pe = jax.lax.bitcast_convert_type(k_pe, _BF16)
    qk = columns(q_pe, items, plan, scale)
    ql = columns(q_lat, items, plan, scale) if plan.lat else jnp.zeros((1, 1, 8, 64), _BF16)
    dv, grid = c_kv.shape[-1], (plan.head_blocks, plan.parts)
    kernel = pl.kernel(
        functools.partial(_kernel, plan=plan, page_size=page_size, interpret=bool(interpret)),
        out_type=(
            jax.ShapeDtypeStruct((plan.head_blocks, plan.units, dv, plan.qc), _F32),
            jax.ShapeDtypeStruct((plan.head_blocks, plan.units, BK, plan.qc), _F32),
        ),
        mesh=plgpu.Mesh(grid=grid, grid_names=("head", "part")),
        interpret=(mosaic_gpu_interpret() if interpret is True else interpret) or False,
        name="ragged_paged_attention_gpu",
    )
    meta = (*sched, items.row, items.first, items.ntok, items.kv_len)
    o, lse = kernel(*meta, page_indices.astype(jnp.int32), ql, qk, c_kv, k_pe)
    return scatter_items(combine(o, lse[:, :, 0, :], sched, plan), items, plan, t, n)
