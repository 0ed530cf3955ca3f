"""ragged_paged_attention: MLA attention in the absorbed form over a paged latent cache, one layer.

Arrays in, arrays out; knows nothing of models. A step's batch is B rows (sequences) whose new
queries are concatenated along T: row b owns queries `cu_q_lens[b] : cu_q_lens[b + 1]` and, after
this step's tokens were written, `kv_lens[b]` cached slots. Query j of row b (q_len_b queries)
sits at position `kv_lens[b] - q_len_b + j` and attends every slot s <= that position (causal
within the new tokens, everything before them). Slot s of row b lives at
`c_kv[page_indices[b, s // page_size], s % page_size]` (likewise `k_pe`). In float32:

    score[t, n, s] = scale * (q_lat[t, n] . c_kv[s] + q_pe[t, n] . k_pe[s])
    out[t, n]      = sum_s softmax_s(score[t, n, :]) c_kv[s]          (latent; caller applies W_vb)

Grouped form (GQA). The same function serves a family whose keys and values are distinct per KV
head: `q_lat` is None (no latent score term), `c_kv` holds V and `k_pe` holds K, both
`[P, page_size, G, D]` (G KV heads); query head n reads KV head `n // (N / G)`:

    score[t, n, s] = scale * q_pe[t, n] . k_pe[s, g(n)]
    out[t, n]      = sum_s softmax_s(score[t, n, :]) c_kv[s, g(n)]

The splice sees the same two bands: `c_kv` moves, `k_pe` moves and rotates. The jnp path and
the GPU kernel serve both forms; the TPU kernel, the MLA form only.

Pools. `c_kv` / `k_pe` are one layer's pages ([P, page_size, *]); the caller
(`leyline_jax.kv_state`) keeps one array per layer, so a layer's pages are read in place (a slice
of stacked pools would be a copy of that layer's pool under jit). The reference reads them as
`[page, offset]` of the array it is given, never through a reshaped view: inside a step that
also writes the pool, a flattened view made XLA:CPU keep a second, copied pool for the loops.

Rows >= num_rows and queries past `cu_q_lens[num_rows]` are padding: their outputs are 0. Rows may
have no new queries. Pages past a row's `kv_lens` (and the unused slots of its last page) are
never read into a result: entries of `page_indices` past a row's pages may hold anything.

Storage. A 16-bit float band may be stored as its raw bits (uint16); `kv_dtype` / `k_pe_dtype`
name what the stored values mean, and the bits are decoded (`bitcast_convert_type`) only on the
rows read, never on a whole pool. `c_kv` and `k_pe` stay two arrays on purpose: a directive
rotates only `k_pe`, and `k_pe` is kept fp32 while `c_kv` is bf16 so repeated splices do not
drift. The anchors' kernels (jax's and tpu-inference's MLA ragged paged attention) read one fused,
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

Four implementations with one signature:
- `ref_ragged_paged_attention`: plain jnp, the production path on CPU (and on GPUs or shapes no
  kernel takes). Work items are
  (row, query tile): each row's queries are cut greedily into tiles of the sizes `q_tiles` (e.g.
  64, 8, 1: a 100-token chunk is one tile of 64, four of 8 and four of 1; a decode row is one
  tile of 1), so no tile carries padding queries except in the last size. Each pass over one tile
  size is a loop over a dynamic number of items, and each item is a blocked online softmax over
  blocks of `block_kv` slots (whole pages), looping only up to its tile's last query position.
  A block gathers its slots from the pools; slots the tile cannot see get an out-of-range index
  and are filled with 0, so they are never read. Work is about sum_b q_len_b * kv_len_b (rounded
  to tiles and blocks), never B * max_q * max_kv.
- `ragged_paged_attention_kernel`: a Pallas TPU kernel. Grid: blocks of `block_q` query tokens
  (aligned on T, q and out moved by BlockSpec). Per block it walks the rows whose queries fall in
  it (first row via scalar prefetch), and for each row fetches the row's pages of both bands by
  DMA from HBM (`memory_space=pl.ANY`), `block_kv` slots at a time, double-buffered within the
  row, copying only pages the block's queries can see; an online softmax over the block's
  (token, head) query rows updates only that row's queries.
- `ragged_paged_attention_gpu` (`pallas_kernels.ragged_paged_attention_gpu`): a Mosaic GPU
  kernel for Hopper, both forms, on the tensor cores with fp32 operands split into bf16 terms.
- `ragged_paged_attention`: the dispatch (the TPU kernel on TPU, the GPU kernel on a Hopper
  GPU, jnp elsewhere, chosen at lowering; interpret modes on request).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.dispatch import hopper, on_platform, resolve
from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu, supports

__all__ = [
    "DEFAULT_BLOCK_KV",
    "DEFAULT_BLOCK_Q",
    "DEFAULT_Q_TILES",
    "ragged_paged_attention",
    "ragged_paged_attention_kernel",
    "ref_ragged_paged_attention",
    "validate_dynamic",
    "validate_static",
]

TARGETS = ("tpu", "gpu")  # the backends with a compiled kernel (see `dispatch`)
DEFAULT_Q_TILES = (64, 8, 1)  # query tile sizes of the jnp path, largest first
DEFAULT_BLOCK_KV = 512  # slots per kv block (rounded down to whole pages, at least one page)
DEFAULT_BLOCK_Q = 8  # query tokens per kernel grid step (x N heads = rows of its matmuls)
_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST  # fp32 means fp32 on GPU too (no TF32)


# ---- validators -----------------------------------------------------------------------------
def _band_dtype(name: str, stored, meaning):
    """The float type a stored band means: its own dtype, or `meaning` when it holds raw bits."""
    stored = jnp.dtype(stored)
    if meaning is None:
        if not jnp.issubdtype(stored, jnp.floating):
            raise ValueError(f"{name} holds {stored} bits: name the float type they mean")
        return stored
    meaning = jnp.dtype(meaning)
    if not jnp.issubdtype(meaning, jnp.floating):
        raise ValueError(f"{name}'s dtype must name a float type, got {meaning}")
    if stored == meaning:
        return meaning
    if jnp.issubdtype(stored, jnp.unsignedinteger) and stored.itemsize == meaning.itemsize:
        return meaning
    raise ValueError(f"{name} stored as {stored} cannot hold {meaning} values")


def validate_static(
    q_lat,  # [T, N, R], or None for the grouped form
    q_pe,  # [T, N, Dr]
    c_kv,  # [P, page_size, R]
    k_pe,  # [P, page_size, Dr]
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    num_rows,  # i32[1]
    *,
    kv_dtype=None,
    k_pe_dtype=None,
    compiled: bool = False,
) -> tuple[jnp.dtype, jnp.dtype]:
    """Shapes and dtypes (cheap; runs at trace time). Returns the float types of c_kv and k_pe.
    `compiled`: also check the layout the compiled TPU kernel needs (R a multiple of 128 lanes,
    page_size and N multiples of their dtype's sublane tile)."""
    grouped = q_lat is None
    if q_pe.ndim != 3 or (not grouped and (q_lat.ndim != 3 or q_lat.shape[:2] != q_pe.shape[:2])):
        raise ValueError(
            "q_lat, q_pe must be [T, N, *] with equal T, N: "
            f"{None if grouped else q_lat.shape}, {q_pe.shape}"
        )
    ndim = 4 if grouped else 3
    if c_kv.ndim != ndim or k_pe.ndim != ndim or c_kv.shape[:-1] != k_pe.shape[:-1]:
        raise ValueError(
            f"c_kv, k_pe must be [P, page_size{', G' if grouped else ''}, *] with equal leading "
            f"dimensions: {c_kv.shape}, {k_pe.shape}"
        )
    if grouped:
        if compiled:
            raise ValueError("the compiled kernel serves the MLA form only (q_lat given)")
        if q_pe.shape[1] % c_kv.shape[2]:
            raise ValueError(f"{q_pe.shape[1]} query heads do not group over {c_kv.shape[2]}")
    elif q_lat.shape[2] != c_kv.shape[-1]:
        raise ValueError(f"q_lat width {q_lat.shape[2]} != c_kv width {c_kv.shape[-1]} (R)")
    if q_pe.shape[2] != k_pe.shape[-1]:
        raise ValueError(f"q_pe width {q_pe.shape[2]} != k_pe width {k_pe.shape[-1]} (Dr)")
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices must be [B, W], got {page_indices.shape}")
    b = page_indices.shape[0]
    for name, a, shape in (
        ("kv_lens", kv_lens, (b,)),
        ("page_indices", page_indices, page_indices.shape),
        ("cu_q_lens", cu_q_lens, (b + 1,)),
        ("num_rows", num_rows, (1,)),
    ):
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    for name, q in (("q_lat", q_lat), ("q_pe", q_pe)):
        if q is not None and not jnp.issubdtype(q.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got {q.dtype}")
    kv_type = _band_dtype("c_kv", c_kv.dtype, kv_dtype)
    k_pe_type = _band_dtype("k_pe", k_pe.dtype, k_pe_dtype)
    if compiled:
        r, page_size, n = c_kv.shape[-1], c_kv.shape[-2], q_lat.shape[1]
        if r % 128:
            raise ValueError(f"the compiled kernel needs R (c_kv width {r}) a multiple of 128")
        for name, band in (("c_kv", c_kv), ("k_pe", k_pe)):
            sublanes = 8 * (4 // jnp.dtype(band.dtype).itemsize)
            if page_size % sublanes:
                raise ValueError(
                    f"the compiled kernel needs page_size {page_size} a multiple of {sublanes} "
                    f"({name} stored as {band.dtype})"
                )
        heads = 8 * (4 // jnp.dtype(q_lat.dtype).itemsize)  # (token, head) rows fold onto sublanes
        if n % heads:
            raise ValueError(f"the compiled kernel needs N (heads, {n}) a multiple of {heads}")
    return kv_type, k_pe_type


def _fits(*args, **kw) -> bool:
    """The compiled kernel takes these shapes (`validate_static(compiled=True)`)."""
    try:
        validate_static(*args, compiled=True, **kw)
    except ValueError:
        return False
    return True


def validate_dynamic(
    q,  # [T, N, *]: either query array (only T is read)
    c_kv,  # [P, page_size, ...]
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    num_rows,  # i32[1]
) -> None:
    """Metadata ranges (needs concrete values: call outside jit). Rows >= num_rows are padding
    and not checked."""
    kv_lens, page_indices = np.asarray(kv_lens), np.asarray(page_indices)
    cu_q_lens, num_rows = np.asarray(cu_q_lens), int(np.asarray(num_rows)[0])
    t = q.shape[0]
    pages, page_size = c_kv.shape[:2]
    b, w = page_indices.shape
    if not 0 <= num_rows <= b:
        raise ValueError(f"num_rows {num_rows} must be in [0, {b}]")
    cu = cu_q_lens[: num_rows + 1]
    if cu[0] < 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_q_lens must be non-negative and non-decreasing: {cu}")
    if cu[-1] > t:
        raise ValueError(f"cu_q_lens[num_rows] = {cu[-1]} exceeds the {t} query tokens")
    kv = kv_lens[:num_rows]
    if ((kv < 0) | (kv > w * page_size)).any():
        raise ValueError(f"kv_lens must be in [0, W * page_size = {w * page_size}]: {kv}")
    q_lens = np.diff(cu)
    if (q_lens > kv).any():
        row = int(np.argmax(q_lens > kv))
        raise ValueError(f"row {row} has {q_lens[row]} queries but kv_lens {kv[row]}")
    used = np.arange(w)[None, :] < -(-kv[:, None] // page_size)  # bool[num_rows, W]
    bad = used & ((page_indices[:num_rows] < 0) | (page_indices[:num_rows] >= pages))
    if bad.any():
        row = int(np.argmax(bad.any(axis=1)))
        raise ValueError(f"page_indices of row {row} name a page outside [0, {pages})")


# ---- reference (jnp) ------------------------------------------------------------------------
def _from_storage(x, dtype):
    """Stored rows -> float rows (a bitcast when they are raw bits)."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _tile_pass(
    out,  # f32[T, N, R]
    q_lat,  # [T, N, R] or None (grouped form)
    q_pe,  # [T, N, Dr]
    c_kv,  # [P, page_size, R] or [P, page_size, G, R]
    k_pe,  # [P, page_size, Dr] or [P, page_size, G, Dr]
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    first,  # i32[B]: token where row b's first tile of this size starts
    count,  # i32[B]: row b's tiles of this size
    *,
    size: int,
    scale: float,
    kv_type,
    k_pe_type,
    block_pages: int,
):  # -> f32[T, N, R]
    """Attend every tile of `size` queries (row b's `count[b]` tiles start at token `first[b]`
    and follow each other) and write those tiles' tokens into `out`."""
    t, n, r = out.shape
    pages, page_size = c_kv.shape[:2]
    slots = block_pages * page_size  # per kv block
    ends = jnp.cumsum(count)  # i32[B]: items of rows <= b
    offs = jnp.arange(size, dtype=jnp.int32)
    if c_kv.ndim == 4:  # grouped: query head n reads KV head n // (N / G)
        g = c_kv.shape[2]
        lead, kv_shape = (size, g, n // g), (slots, g)
        score, mix = "qgnd,sgd->qgns", "qgns,sgr->qgnr"
    else:  # MLA: one latent row per slot, read by every head
        lead, kv_shape = (size, n), (slots,)
        score, mix = "qnd,sd->qns", "qns,sr->qnr"

    def item(i, out):
        b = jnp.sum(ends <= i).astype(jnp.int32)  # the row of item i
        start = first[b] + (i - (ends[b] - count[b])) * size  # first token of the tile
        q_end, kv_len = cu_q_lens[b + 1], kv_lens[b]
        tok = start + offs  # i32[size]
        real = tok < q_end
        pos = kv_len - q_end + tok  # each query's position in the row's sequence
        seen = kv_len - q_end + jnp.minimum(start + size, q_end)  # slots the tile's last query sees

        def queries(q):  # [T, N, *] -> f32[*lead, *]
            q = q.at[tok].get(mode="fill", fill_value=0).astype(_F32)
            return q.reshape(*lead, q.shape[-1])

        ql = None if q_lat is None else queries(q_lat)
        qp = queries(q_pe)
        row_pages = page_indices[b]  # i32[W]

        def kv_block(j, carry):
            m, denom, acc = carry  # f32[*lead], f32[*lead], f32[*lead, R]
            slot = j * slots + jnp.arange(slots)
            # slots no query of the tile can see get an out-of-range index: filled, never read
            page = row_pages.at[slot // page_size].get(mode="fill", fill_value=pages)
            page = jnp.where(slot < seen, page, pages)
            # read as [page, offset] of the pools as they are: a flattened view of a pool that
            # the step also writes made XLA:CPU copy the pool (twice) around these loops
            c = c_kv.at[page, slot % page_size].get(mode="fill", fill_value=0)  # [slots, (G,) R]
            k = k_pe.at[page, slot % page_size].get(mode="fill", fill_value=0)  # [slots, (G,) Dr]
            c = _from_storage(c, kv_type).astype(_F32).reshape(*kv_shape, -1)
            k = _from_storage(k, k_pe_type).astype(_F32).reshape(*kv_shape, -1)
            s = jnp.einsum(score, qp, k, precision=_HIGHEST)
            if ql is not None:
                s = jnp.einsum(score, ql, c, precision=_HIGHEST) + s
            s = scale * s
            allowed = real[:, None] & (slot[None, :] <= pos[:, None])  # [size, slots]
            s = jnp.where(allowed.reshape(size, *[1] * (len(lead) - 1), slots), s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a query that saw nothing yet
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            acc = alpha[..., None] * acc + jnp.einsum(mix, p, c, precision=_HIGHEST)
            return m_new, alpha * denom + p.sum(axis=-1), acc

        init = (
            jnp.full(lead, -jnp.inf, _F32),
            jnp.zeros(lead, _F32),
            jnp.zeros((*lead, r), _F32),
        )
        _, denom, acc = jax.lax.fori_loop(0, -(-seen // slots), kv_block, init)
        denom = denom[..., None]
        res = jnp.where(denom > 0, acc / jnp.where(denom > 0, denom, 1.0), 0.0)
        return out.at[jnp.where(real, tok, t)].set(res.reshape(size, n, r), mode="drop")

    return jax.lax.fori_loop(0, ends[-1], item, out)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "kv_dtype", "k_pe_dtype", "q_tiles", "block_kv"),
)
def ref_ragged_paged_attention(
    q_lat,  # [T, N, R], or None: the grouped form (module docstring)
    q_pe,  # [T, N, Dr]
    c_kv,  # [P, page_size, R] or [P, page_size, G, R]
    k_pe,  # [P, page_size, Dr] or [P, page_size, G, Dr]
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    num_rows,  # i32[1]
    *,
    scale: float,
    kv_dtype=None,
    k_pe_dtype=None,
    q_tiles: tuple[int, ...] = DEFAULT_Q_TILES,
    block_kv: int = DEFAULT_BLOCK_KV,
) -> jax.Array:  # f32[T, N, R]
    """Plain jnp, for CPU and GPU (see the module docstring for the contract).

    `kv_dtype` / `k_pe_dtype`: the float type the stored values mean (default: the array's own
    dtype; required when a band holds raw bits). `q_tiles`: query tile sizes, largest first; all
    but the last are used only whole, the last covers the remainder. `block_kv`: slots per kv
    block, rounded down to whole pages (at least one page)."""
    meta = (kv_lens, page_indices, cu_q_lens, num_rows)
    kv_type, k_pe_type = validate_static(
        q_lat, q_pe, c_kv, k_pe, *meta, kv_dtype=kv_dtype, k_pe_dtype=k_pe_dtype
    )
    if not q_tiles or any(s <= 0 for s in q_tiles) or list(q_tiles) != sorted(q_tiles)[::-1]:
        raise ValueError(f"q_tiles must be positive sizes, largest first: {q_tiles}")
    if block_kv <= 0:
        raise ValueError(f"block_kv must be positive, got {block_kv}")
    (t, n), r = q_pe.shape[:2], c_kv.shape[-1]
    if t == 0:  # nothing to gather from
        return jnp.zeros((0, n, r), _F32)
    block_pages = max(1, block_kv // c_kv.shape[1])
    b = kv_lens.shape[0]
    in_use = jnp.arange(b) < num_rows[0]
    first = cu_q_lens[:-1]
    left = jnp.where(in_use, cu_q_lens[1:] - first, 0)  # queries not yet in a tile, per row
    out = jnp.zeros((t, n, r), _F32)
    with jax.named_scope("ragged_paged_attention_ref"):
        for level, size in enumerate(q_tiles):
            last = level == len(q_tiles) - 1
            count = -(-left // size) if last else left // size
            out = _tile_pass(
                out,
                q_lat,
                q_pe,
                c_kv,
                k_pe,
                kv_lens,
                page_indices,
                cu_q_lens,
                first,
                count,
                size=size,
                scale=scale,
                kv_type=kv_type,
                k_pe_type=k_pe_type,
                block_pages=block_pages,
            )
            first, left = first + count * size, left - count * size
    return out


# ---- Pallas TPU kernel ----------------------------------------------------------------------
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
            c = _from_storage(c_buf[buf], kv_type).reshape(slots, r)
            k = _from_storage(k_buf[buf], k_pe_type).reshape(slots, -1)
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


# ---- dispatch -------------------------------------------------------------------------------
def ragged_paged_attention(
    q_lat,  # [T, N, R]: queries multiplied into the latent space (q_nope @ W_kb per head);
    # None for the grouped form (GQA: c_kv holds V, k_pe holds K, [P, page_size, G, D] each)
    q_pe,  # [T, N, Dr]: rope part of the queries, position embedded
    c_kv,  # [P, page_size, R]: latent pages, storage dtype
    k_pe,  # [P, page_size, Dr]: rope-band pages, storage dtype
    kv_lens,  # i32[B]: tokens in each row's sequence, this step's included
    page_indices,  # i32[B, W]: each row's page-table row
    cu_q_lens,  # i32[B + 1]: row b's queries are q[cu_q_lens[b] : cu_q_lens[b + 1]]
    num_rows,  # i32[1]: rows in use
    *,
    scale: float,
    kv_dtype=None,
    k_pe_dtype=None,
    impl: str | None = None,
    q_tiles: tuple[int, ...] = DEFAULT_Q_TILES,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
) -> jax.Array:  # f32[T, N, R]: in the latent space (the caller applies W_vb)
    """Ragged paged MLA attention with the implementation for this backend (contract in the
    module docstring).

    impl: see `pallas_kernels.dispatch` (None: the TPU kernel on TPU for the MLA form, the
    Mosaic GPU kernel on a Hopper GPU where `ragged_paged_attention_gpu.supports` takes the
    arrays, both forms; jnp everywhere else, chosen at lowering). `kv_dtype`
    / `k_pe_dtype`: the float type a band's stored values mean (default: its own dtype;
    required for raw bits). `q_tiles` tunes the jnp path, `block_q` the kernel, `block_kv`
    both. Concrete metadata is validated here
    (`validate_dynamic`); under the caller's jit that is the caller's job.
    """
    meta = (kv_lens, page_indices, cu_q_lens, num_rows)
    args = (q_lat, q_pe, c_kv, k_pe, *meta)
    kv_type, k_type = validate_static(*args, kv_dtype=kv_dtype, k_pe_dtype=k_pe_dtype)  # first
    if not any(isinstance(a, jax.core.Tracer) for a in meta):
        validate_dynamic(q_pe, c_kv, *meta)
    kw = dict(scale=scale, kv_dtype=kv_dtype, k_pe_dtype=k_pe_dtype, block_kv=block_kv)
    gpu = functools.partial(ragged_paged_attention_gpu, scale=scale, kv_type=kv_type, k_type=k_type)
    tpu = functools.partial(ragged_paged_attention_kernel, block_q=block_q, **kw)
    jnp_path = functools.partial(ref_ragged_paged_attention, q_tiles=q_tiles, **kw)
    if impl is None:  # each platform's kernel where it takes these arrays, else jnp there too
        kernels = {}
        if q_lat is not None and _fits(*args, kv_dtype=kv_dtype, k_pe_dtype=k_pe_dtype):
            kernels["tpu"] = functools.partial(tpu, interpret=False)
        if hopper() and not supports(q_lat, q_pe, c_kv, k_pe, page_indices, kv_type, k_type):
            kernels["cuda"] = functools.partial(gpu, interpret=False)
        # the branches take arrays only: q_lat (None in the grouped form) is bound into each
        bound = {p: functools.partial(k, q_lat) for p, k in kernels.items()}
        return on_platform(functools.partial(jnp_path, q_lat), args[1:], **bound)
    impl, target, interpret = resolve(impl, TARGETS)
    if impl == "jnp":
        return jnp_path(*args)
    if target == "gpu":
        return gpu(*args, interpret=interpret)
    if q_lat is None:
        raise ValueError(f"impl={impl!r}: the TPU kernel takes the MLA form only (q_lat given)")
    return tpu(*args, interpret=interpret)
