"""ragged_paged_attention's GPU kernel, in Mosaic GPU (Hopper: H100, H200; same contract as
`pallas_kernels.ragged_paged_attention`, whose module docstring defines rows, pages and both
forms, MLA absorbed and GQA grouped).

Work items. A query column is one (token, head) pair; the columns of one program are `qc` of
them: `hb` heads of one KV group (all N heads for MLA, the N/G heads sharing a KV head for GQA,
or a block of them) times `qc / hb` consecutive tokens of one row. A program is (head block,
token item, kv split): the row's kv blocks (BK = 64 slots, whole pages) are cut into `splits`
contiguous ranges so that a decode batch still fills the GPU (flash-decoding), and the splits'
partial results are merged afterwards in jnp by their log-sum-exp.

The matmuls run on the tensor cores (wgmma) with the slots as M (64) and the columns as N, so
a decode token of V2-Lite (16 heads) fills N = 16 instead of padding 16 heads to M = 64. Per
kv block, its pages come in by TMA into shared memory, then:

    scores^T [BK, qc] = C [BK, R] @ Q_lat^T + K [BK, Dr] @ Q_pe^T      (MLA; GQA: K @ Q^T)
    out^T   [Dv, qc] += C^T [Dv, BK] @ P^T [BK, qc]                      (GQA: V^T @ P^T)

with an online softmax over the slots (axis 0). The contract is fp32: the tensor cores take
16-bit operands, so every fp32 operand is split into three bf16 terms (hi + mid + lo carry 24
bits of mantissa: `split3`; the queries' terms are made before the call, `split3_bits`) and
the products of the terms are summed in the fp32 accumulator. The moved band (C / V) is bf16
already: exact, one term. Q (scaled, in fp32) and P take three terms; an fp32 rotated band K
takes three, and only the products whose terms' orders sum to at most two are formed (the rest
are below fp32's last bit). Slots past a row's kv_lens (unused slots of its last page, pages
never copied) are zeroed in shared memory before the value matmul, so poisoned pages never
reach a result. On an H200 the outputs are within 0.9-1.5e-5 of float64 at 4k-32k slots (the
jnp path's: 0.3-1.6e-6; not chased: the tensor cores' fp32 accumulation is a likely cause).

The host side (`pallas_kernels.ragged_paged_gpu_plan`): the static `Plan`, the token items, the
query columns and the merge of the kv splits. Shapes it takes (`unsupported` says why not): the
moved band bf16 (stored as bf16 or its bits), the rotated band fp32 or bf16; both bands' widths
multiples of 64 (a 128-byte swizzled bf16 row); a page size dividing 64 and at least 8; head blocks
that tile the heads; the scratch within shared memory. The dispatch sends every other case to jnp.

Speed (H200, one V2-Lite layer, decode of C rows at 32k tokens): 13-16% of the copy bandwidth
at C = 32 / 128, 35-40x the jnp path; no stage overlaps another within a program (one block's
pages in, then its matmuls) and a program's ~200 KB of shared memory leaves one per SM:
double-buffered pages with a producer warpgroup are the next step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dispatch import mosaic_gpu_interpret
from pallas_kernels.ragged_paged_gpu_plan import (
    BK,
    TERMS,
    Plan,
    columns,
    merge,
    plan_for,
    split3,
    token_items,
    unsupported,
)

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


def _kernel(*refs, plan: Plan, page_size: int, interpret: bool):
    """One program per (head block, token item, kv split). Scratch is scoped in the kernel."""
    *_, c_ref, k_ref, _, _ = refs  # (metadata, Q terms, the bands, out, lse)
    dk, dv = k_ref.shape[-1], c_ref.shape[-1]
    qc, pages = plan.qc, BK // page_size
    narrow = min(128, 2 * qc)  # P's swizzle (its rows are qc wide), which C's and Q_lat's match
    scratch = [
        _swizzled((TERMS, qc, dv), _BF16, narrow) if plan.lat else None,  # Q_lat terms
        _swizzled((TERMS, qc, dk), _BF16),  # Q_pe (GQA: Q) terms
        _swizzled((BK, dv), _BF16, narrow),  # the moved band's block
        _swizzled((BK, dk), k_ref.dtype),  # the rotated band's block as stored
        _swizzled((plan.k_terms, BK, dk), _BF16),  # its terms
        _swizzled((TERMS, BK, qc), _BF16),  # P's terms
        plgpu.SMEM((dv, qc), _F32),  # out^T
        plgpu.SMEM((BK, qc), _F32),  # log-sum-exp, one row per slot row (a wgmma-shaped tile)
        plgpu.Barrier(num_arrivals=1, num_barriers=2 * pages + 1),
    ]
    pl.run_scoped(
        functools.partial(_body, refs, plan=plan, page_size=page_size, interpret=interpret),
        *[s for s in scratch if s is not None],
    )


def _body(refs, *scratch, plan: Plan, page_size: int, interpret: bool):
    (
        row_ref,
        pos_ref,
        ntok_ref,
        kvlen_ref,
        pages_ref,
        ql_ref,
        qk_ref,
        c_ref,
        k_ref,
        o_ref,
        lse_ref,
    ) = refs
    if plan.lat:
        ql_smem, qk_smem, c_smem, kf_smem, k_smem, p_smem, o_smem, lse_smem, bar = scratch
    else:
        qk_smem, c_smem, kf_smem, k_smem, p_smem, o_smem, lse_smem, bar = scratch
        ql_smem = None
    qc, hb, pages = plan.qc, plan.hb, BK // page_size
    dv = c_ref.shape[-1]
    wgmma = plgpu.Layout.WGMMA
    col = wgmma.reduce(0)
    gh, it, split = (jax.lax.axis_index(a) for a in ("head", "item", "split"))
    group = gh // (plan.head_blocks // plan.groups)
    row, first, ntok, kv_len = row_ref[it], pos_ref[it], ntok_ref[it], kvlen_ref[it]
    last = first + ntok - 1
    blocks = jnp.where(ntok > 0, (last + BK) // BK, 0)  # blocks the item's queries see
    per = (blocks + plan.splits - 1) // plan.splits
    lo = split * per
    hi = jnp.minimum(blocks, lo + per)

    q_bar = bar.at[2 * pages]
    for s in range(TERMS):
        plgpu.copy_gmem_to_smem(qk_ref.at[gh, it, s], qk_smem.at[s], q_bar)
        plgpu.barrier_wait(q_bar)
        if plan.lat:
            plgpu.copy_gmem_to_smem(ql_ref.at[gh, it, s], ql_smem.at[s], q_bar)
            plgpu.barrier_wait(q_bar)

    k_pairs = [(i, j) for i in range(TERMS) for j in range(plan.k_terms) if i + j < TERMS]

    def band(ref, page):
        return ref.at[page] if plan.lat else ref.at[page, :, group]

    def block(blk, carry):
        o, m, total = carry
        for p in range(pages):
            rows = pl.ds(p * page_size, page_size)

            @pl.when(blk * BK + p * page_size < kv_len)
            def _fetch(p=p, rows=rows):
                page = pages_ref[row, blk * pages + p]
                plgpu.copy_gmem_to_smem(band(c_ref, page), c_smem.at[rows], bar.at[p])
                plgpu.copy_gmem_to_smem(band(k_ref, page), kf_smem.at[rows], bar.at[pages + p])

        for p in range(pages):

            @pl.when(blk * BK + p * page_size < kv_len)
            def _wait(p=p):
                plgpu.barrier_wait(bar.at[p])
                plgpu.barrier_wait(bar.at[pages + p])

        slot = blk * BK + _iota((BK, 64), 0, interpret)

        @pl.when((blk + 1) * BK > kv_len)
        def _zero_unused():  # slots past kv_len: stale or poisoned, never multiplied into out
            for lo_col in range(0, dv, 64):
                cols = pl.ds(lo_col, 64)
                x = _load(c_smem.at[:, cols], interpret)
                c_smem[:, cols] = jnp.where(slot < kv_len, x, jnp.zeros_like(x))

        kf = _load(kf_smem, interpret).astype(_F32)
        kslot = blk * BK + _iota(kf.shape, 0, interpret)
        kf = jnp.where(kslot < kv_len, kf, jnp.zeros_like(kf))
        terms = split3(kf)[: plan.k_terms]
        for j, term in enumerate(terms):
            k_smem[j] = term
        plgpu.commit_smem()

        score_terms = [(k_smem.at[j], False, qk_smem.at[i], True) for i, j in k_pairs]
        if plan.lat:
            score_terms += [(c_smem, False, ql_smem.at[i], True) for i in range(TERMS)]
        s = _matmul(score_terms, (BK, qc), interpret)
        srow = blk * BK + _iota((BK, qc), 0, interpret)
        scol = _iota((BK, qc), 1, interpret)
        seen = srow <= jnp.minimum(first + scol // hb, last)  # causal; padding columns = last
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=0))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [1]))
        total = total * alpha + p.sum(axis=0)
        o = o * jax.lax.broadcast_in_dim(alpha, o.shape, [1])
        for i, term in enumerate(split3(p)):
            p_smem[i] = term
        plgpu.commit_smem()

        value_terms = [(c_smem, True, p_smem.at[i], False) for i in range(TERMS)]
        o = o + _matmul(value_terms, (dv, qc), interpret)
        return o, m_new, total

    o = _layout(jnp.zeros((dv, qc), _F32), wgmma, interpret)
    m = _layout(jnp.full((qc,), _EMPTY, _F32), col, interpret)
    total = _layout(jnp.zeros((qc,), _F32), col, interpret)
    o, m, total = jax.lax.fori_loop(lo, hi, block, (o, m, total))
    some = total > 0
    o = o / jax.lax.broadcast_in_dim(jnp.where(some, total, 1.0), o.shape, [1])
    lse = jnp.where(some, m + jnp.log(jnp.where(some, total, 1.0)), _EMPTY)
    o_smem[...] = o
    lse_smem[...] = jax.lax.broadcast_in_dim(lse, (BK, qc), [1])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[gh, it, split])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[gh, it, split])
    plgpu.wait_smem_to_gmem(0)


def ragged_paged_attention_gpu(
    q_lat,
    q_pe,
    c_kv,
    k_pe,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_rows,
    *,
    scale,
    kv_type,
    k_type,
    interpret=False,
):
    """The Mosaic GPU kernel; same contract as `ref_ragged_paged_attention` (validated by the
    caller). `kv_type` / `k_type`: the float types the bands' stored values mean.
    `interpret`: False (compiled, on a Hopper GPU) or True (Mosaic GPU's interpreter)."""
    if why := unsupported(q_lat, q_pe, c_kv, k_pe, page_indices, kv_type, k_type):
        raise ValueError(f"the GPU attention kernel does not take these arrays: {why}")
    (t, n, _), page_size = q_pe.shape, c_kv.shape[1]
    if t == 0:
        return jnp.zeros((0, n, c_kv.shape[-1]), _F32)
    plan = plan_for(q_lat, q_pe, c_kv, k_pe, page_indices, jnp.dtype(k_type))
    items = token_items(kv_lens, cu_q_lens, num_rows, plan)
    if c_kv.dtype != _BF16:  # raw bits: a bitcast, no copy
        c_kv = jax.lax.bitcast_convert_type(c_kv, _BF16)
    if k_pe.dtype == jnp.uint16:
        k_pe = jax.lax.bitcast_convert_type(k_pe, _BF16)
    qk = columns(q_pe, items, plan, scale)
    ql = columns(q_lat, items, plan, scale) if plan.lat else jnp.zeros((1, 1, TERMS, 8, 64), _BF16)
    dv, grid = c_kv.shape[-1], (plan.head_blocks, plan.items, plan.splits)
    kernel = pl.kernel(
        functools.partial(_kernel, plan=plan, page_size=page_size, interpret=bool(interpret)),
        out_type=(
            jax.ShapeDtypeStruct((*grid, dv, plan.qc), _F32),
            jax.ShapeDtypeStruct((*grid, BK, plan.qc), _F32),
        ),
        mesh=plgpu.Mesh(grid=grid, grid_names=("head", "item", "split")),
        interpret=mosaic_gpu_interpret() if interpret else False,
        name="ragged_paged_attention_gpu",
    )
    meta = (items.row, items.first, items.ntok, items.kv_len, page_indices.astype(jnp.int32))
    o, lse = kernel(*meta, ql, qk, c_kv, k_pe)
    return merge(o, lse[:, :, :, 0, :], items, plan, t, n)
