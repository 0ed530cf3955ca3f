"""The validators and the jnp reference of `pallas_kernels.ragged_paged_attention`, whose module
docstring holds the contract (rows, pages, both forms, storage) and the reference's work items.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_Q_TILES = (64, 8, 1)  # query tile sizes of the jnp path, largest first
DEFAULT_BLOCK_KV = 512  # slots per kv block (rounded down to whole pages, at least one page)
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


def fits_tpu(*args, **kw) -> bool:
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
def from_storage(x, dtype):
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
            c = from_storage(c, kv_type).astype(_F32).reshape(*kv_shape, -1)
            k = from_storage(k, k_pe_type).astype(_F32).reshape(*kv_shape, -1)
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
