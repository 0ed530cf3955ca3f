"""ragged_paged_attention's Pallas TPU kernel (same contract as
`pallas_kernels.ragged_paged_attention`, whose module docstring defines rows, pages and storage;
the MLA form only).

Grid: blocks of `block_q` query tokens (aligned on T, q and out moved by BlockSpec). Per block it
walks the rows whose queries fall in it (first row via scalar prefetch), and for each row
fetches the row's pages of both bands by DMA from HBM (`memory_space=pl.ANY`), `block_kv` slots
at a time, double-buffered within the row, copying only pages the block's queries can see; an
online softmax over the block's (token, head) query rows updates only that row's queries.

The anchors' kernels (jax's and tpu-inference's MLA ragged paged attention) read one fused,
lane-aligned `[P, page, R + Dr]` cache; keeping the bands apart costs, on TPU:
- two DMAs per page instead of one: two descriptors and two semaphore waits per page; with small
  pages the per-DMA issue cost, not bandwidth, can bound a decode step;
- lane alignment: Dr = 64 is half a 128-lane vreg, so the `k_pe` VMEM buffers (and, under XLA's
  usual (8, 128) tiling, the pool in HBM) are padded to 128 lanes and the band takes twice its
  bytes; its DMA moves 256-byte fp32 rows rather than being the tail of one contiguous row. (The
  fused anchors pad Dr to 128 too, so the padding is no loss relative to them.)
- two score matmuls (contraction R = 512 and Dr = 64) instead of one over R + Dr: the Dr pass
  fills at most half of the MXU's contraction depth, and with fp32 `k_pe` it is an fp32 matmul
  (several bf16 passes): 64 / 576 of the score flops, at fp32 speed;
- two double buffers in VMEM (`[2, pages, page, R]` and `[2, pages, page, Dr]`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_checks import from_storage, validate_static
from pallas_kernels.ragged_paged_ref import DEFAULT_BLOCK_KV

DEFAULT_BLOCK_Q = 8  # query tokens per kernel grid step (x N heads = rows of its matmuls)
_F32 = jnp.float32


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # i32[B]
    page_indices_ref,  # i32[B, W]
    cu_q_lens_ref,  # i32[B + 1]
    num_rows_ref,  # i32[1]
    first_row_ref,  # i32[T / block_q]: per block, the first row whose queries end after its start
    # inputs
    q_lat_ref,  # [block_q, N, R] (VMEM block)
    q_pe_ref,  # [block_q, N, Dr] (VMEM block)
    c_kv_hbm,  # [P, page_size, R] (HBM)
    k_pe_hbm,  # [P, page_size, Dr] (HBM)
    # output
    o_ref,  # f32[block_q, N, R] (VMEM block)
    # scratch
    c_buf,  # [2, block_pages, page_size, R], storage dtype
    k_buf,  # [2, block_pages, page_size, Dr], storage dtype
    sems,  # DMA[2, 2]: (buffer, band)
    m_ref,  # f32[block_q * N, 128]: running max, replicated over lanes
    l_ref,  # f32[block_q * N, 128]: running sum, replicated over lanes
    acc_ref,  # f32[block_q * N, R]: unnormalised output
    *,
    scale: float,
    kv_type,
    k_pe_type,
):
    block_q, n, r = q_lat_ref.shape
    _, block_pages, page_size, _ = c_buf.shape
    slots = block_pages * page_size
    width = page_indices_ref.shape[1]
    rows_n = block_q * n  # one matmul row per (token, head), heads fastest
    q_lo = pl.program_id(0) * block_q
    q_hi = q_lo + block_q
    num_rows = num_rows_ref[0]

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
    l_ref[...] = jnp.zeros(l_ref.shape, _F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)
    # score matmuls take their operands' common type (bf16 x bf16 stays a one-pass MXU matmul),
    # always accumulating in f32; the weighted sum of c_kv is f32
    q_type = jnp.promote_types(q_lat_ref.dtype, kv_type)
    qp_type = jnp.promote_types(q_pe_ref.dtype, k_pe_type)
    q = q_lat_ref[...].astype(q_type).reshape(rows_n, r)
    qp = q_pe_ref[...].astype(qp_type).reshape(rows_n, q_pe_ref.shape[2])
    # token of each row (lax.div: non-negative operands need no floor correction)
    tok = q_lo + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows_n, 1), 0), n)

    def row_needed(b):
        return (b < num_rows) & (cu_q_lens_ref[b] < q_hi)

    def one_row(b):
        q_start, q_end, kv_len = cu_q_lens_ref[b], cu_q_lens_ref[b + 1], kv_lens_ref[b]
        lo, hi = jnp.maximum(q_start, q_lo), jnp.minimum(q_end, q_hi)
        seen = jnp.where(hi > lo, kv_len - q_end + hi, 0)  # slots this block's last query sees
        n_blocks = pl.cdiv(seen, slots)
        n_pages = pl.cdiv(seen, page_size)
        mine = (tok >= lo) & (tok < hi)  # bool[rows_n, 1]: this row's queries in the block
        pos = kv_len - q_end + tok  # i32[rows_n, 1]: their positions

        def copies(j, buf):  # (needed, c copy, k_pe copy) for each page of kv block j
            out = []
            for k in range(block_pages):
                pg = j * block_pages + k
                page = page_indices_ref[b, jnp.minimum(pg, width - 1)]
                c_copy = pltpu.make_async_copy(c_kv_hbm.at[page], c_buf.at[buf, k], sems.at[buf, 0])
                k_copy = pltpu.make_async_copy(k_pe_hbm.at[page], k_buf.at[buf, k], sems.at[buf, 1])
                out.append((pg < n_pages, c_copy, k_copy))
            return out

        def start(j, buf):
            for needed, c_copy, k_copy in copies(j, buf):

                @pl.when(needed)
                def _(c_copy=c_copy, k_copy=k_copy):
                    c_copy.start()
                    k_copy.start()

        def wait(j, buf):
            for needed, c_copy, k_copy in copies(j, buf):

                @pl.when(needed)
                def _(c_copy=c_copy, k_copy=k_copy):
                    c_copy.wait()
                    k_copy.wait()

        @pl.when(n_blocks > 0)
        def _():
            start(0, 0)

        def kv_block(j, _):
            buf = jax.lax.rem(j, 2)

            @pl.when(j + 1 < n_blocks)
            def _():
                start(j + 1, 1 - buf)

            wait(j, buf)
            slot = j * slots + jax.lax.broadcasted_iota(jnp.int32, (slots, 1), 0)
            visible = slot < seen  # pages not copied and unused slots hold stale data
            c = from_storage(c_buf[buf], kv_type).reshape(slots, r)
            k = from_storage(k_buf[buf], k_pe_type).reshape(slots, -1)
            c = jnp.where(visible, c, jnp.zeros_like(c))
            k = jnp.where(visible, k, jnp.zeros_like(k))
            dims = (((1,), (1,)), ((), ()))
            s = jax.lax.dot_general(q, c.astype(q_type), dims, preferred_element_type=_F32)
            s_pe = jax.lax.dot_general(qp, k.astype(qp_type), dims, preferred_element_type=_F32)
            s = scale * (s + s_pe)
            col = j * slots + jax.lax.broadcasted_iota(jnp.int32, (rows_n, slots), 1)
            allowed = mine & (col <= pos)
            s = jnp.where(allowed, s, -jnp.inf)  # [rows_n, slots]
            # queries of other rows see nothing here: their max stays, so alpha = 1 (or 0 on a
            # zero state) and p = 0, and their state comes out unchanged, bit for bit
            m_prev = m_ref[...][:, :1]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a query that saw nothing yet
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m_prev - m_safe)
            l_new = alpha * l_ref[...][:, :1] + p.sum(axis=1, keepdims=True)
            m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
            l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)
            pv = jnp.dot(p, c.astype(_F32), preferred_element_type=_F32)
            acc_ref[...] = alpha * acc_ref[...] + pv
            return 0

        jax.lax.fori_loop(0, n_blocks, kv_block, 0)
        return b + 1

    jax.lax.while_loop(row_needed, one_row, first_row_ref[pl.program_id(0)])
    denom = l_ref[...][:, :1]
    out = jnp.where(denom > 0, acc_ref[...] / jnp.where(denom > 0, denom, 1.0), 0.0)
    o_ref[...] = out.reshape(block_q, n, r)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "kv_dtype",
        "k_pe_dtype",
        "block_q",
        "block_kv",
        "interpret",
    ),
)
def ragged_paged_attention_kernel(
    q_lat,  # [T, N, R]
    q_pe,  # [T, N, Dr]
    c_kv,  # [P, page_size, R]
    k_pe,  # [P, page_size, Dr]
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    num_rows,  # i32[1]
    *,
    scale: float,
    kv_dtype=None,
    k_pe_dtype=None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    interpret=False,
) -> jax.Array:  # f32[T, N, R]
    """The Pallas TPU kernel; same contract as `ref_ragged_paged_attention`. `block_q`: query
    tokens per grid step (T is padded up to a multiple); `block_kv`: slots per DMA'd kv block,
    rounded down to whole pages. `interpret`: False (compiled), True, or a
    `pltpu.InterpretParams`."""
    meta = (kv_lens, page_indices, cu_q_lens, num_rows)
    kv_type, k_pe_type = validate_static(
        q_lat,
        q_pe,
        c_kv,
        k_pe,
        *meta,
        kv_dtype=kv_dtype,
        k_pe_dtype=k_pe_dtype,
        compiled=interpret is False,
    )
    if block_q <= 0 or block_kv <= 0:
        raise ValueError(f"block_q {block_q} and block_kv {block_kv} must be positive")
    t, n, r = q_lat.shape
    dr = q_pe.shape[2]
    page_size = c_kv.shape[-2]
    block_pages = max(1, block_kv // page_size)
    blocks = max(1, pl.cdiv(t, block_q))
    pad = blocks * block_q - t
    q_lat = jnp.pad(q_lat, ((0, pad), (0, 0), (0, 0)))
    q_pe = jnp.pad(q_pe, ((0, pad), (0, 0), (0, 0)))
    # first row whose queries reach each block: rows ending at or before its start are skipped
    starts = jnp.arange(blocks, dtype=jnp.int32) * block_q
    ends = jnp.where(jnp.arange(kv_lens.shape[0]) < num_rows[0], cu_q_lens[1:], t + block_q)
    first_row = jnp.sum(ends[None, :] <= starts[:, None], axis=1).astype(jnp.int32)

    def q_map(i, *_):
        return (i, 0, 0)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(blocks,),
        in_specs=[
            pl.BlockSpec((block_q, n, r), q_map),  # q_lat
            pl.BlockSpec((block_q, n, dr), q_map),  # q_pe
            any_spec,  # c_kv, left in HBM
            any_spec,  # k_pe, left in HBM
        ],
        out_specs=pl.BlockSpec((block_q, n, r), q_map),
        scratch_shapes=[
            pltpu.VMEM((2, block_pages, page_size, r), c_kv.dtype),
            pltpu.VMEM((2, block_pages, page_size, dr), k_pe.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((block_q * n, 128), _F32),
            pltpu.VMEM((block_q * n, 128), _F32),
            pltpu.VMEM((block_q * n, r), _F32),
        ],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, kv_type=kv_type, k_pe_type=k_pe_type),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((blocks * block_q, n, r), _F32),
        # each block owns its queries' state: blocks are independent
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="ragged_paged_mla_attention",
    )(kv_lens, page_indices, cu_q_lens, num_rows, first_row, q_lat, q_pe, c_kv, k_pe)
    return out[:t]
