"""The jnp reference of `pallas_kernels.ragged_paged_attention`, whose module docstring holds the
contract (rows, pages, both forms, storage) and the reference's work items; and the jnp path in
both MLA forms (`ref_ragged_paged_mla`). The validators are `pallas_kernels.ragged_paged_checks`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_checks import from_storage, validate_static

DEFAULT_Q_TILES = (64, 8, 1)  # query tile sizes of the jnp path, largest first
DEFAULT_BLOCK_KV = 512  # slots per kv block (rounded down to whole pages, at least one page)
_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST  # fp32 means fp32 on GPU too (no TF32)


# ---- reference (jnp) ------------------------------------------------------------------------
class _Form(NamedTuple):
    """How one tile of `size` queries meets a block of slots: the layout of the tile's query
    rows (`lead`, and `mask`, the same axes with 1 for the heads), the queries taken into it,
    the scores and the values mixed by the probabilities, and the rows back as [size, N, *]."""

    size: int
    lead: tuple[int, ...]
    mask: tuple[int, ...]
    take: Callable  # f32[size, N, *] -> f32[*lead, *]
    scores: Callable  # (queries, q_pe, c [slots, (G,) R], k [slots, (G,) Dr]) -> [*lead, slots]
    mix: Callable  # (p f32[*lead, slots], c) -> f32[*lead, D_out]
    rows: Callable  # f32[*lead, D_out] -> f32[size, N, D_out]


def _absorbed_form(size: int, n: int, groups: int | None) -> _Form:
    """Queries already in the latent space (MLA) or grouped KV heads (GQA), token-major."""

    def dot(spec):
        return lambda a, b: jnp.einsum(spec, a, b, precision=_HIGHEST)

    if groups is not None:  # grouped: query head n reads KV head n // (N / G)
        lead = (size, groups, n // groups)
        score, mix = dot("qgnd,sgd->qgns"), dot("qgns,sgr->qgnr")
    else:  # MLA: one latent row per slot, read by every head
        lead, score, mix = (size, n), dot("qnd,sd->qns"), dot("qns,sr->qnr")

    def scores(ql, qp, c, k):
        s = score(qp, k)
        return s if ql is None else score(ql, c) + s

    return _Form(
        size=size,
        lead=lead,
        mask=(size, *[1] * (len(lead) - 1)),
        take=lambda q: q.reshape(*lead, q.shape[-1]),
        scores=scores,
        mix=mix,
        rows=lambda res: res.reshape(size, n, res.shape[-1]),
    )


def _expanded_form(size: int, n: int, w_kb, w_vb) -> _Form:
    """MLA expanded: each block's latent rows up to per-head K_nope (`w_kb` [N, Dn, R]) and V
    (`w_vb` [N, R, Dv]), then attention as in multi-head attention; head-major (XLA:CPU runs
    these contractions fastest batched over heads)."""
    w_kb, w_vb = w_kb.astype(_F32), w_vb.astype(_F32)

    def dot(spec, a, b):
        return jnp.einsum(spec, a, b, precision=_HIGHEST)

    def scores(qn, qp, c, k):
        return dot("nqd,nsd->nqs", qn, dot("sr,ndr->nsd", c, w_kb)) + dot("nqd,sd->nqs", qp, k)

    return _Form(
        size=size,
        lead=(n, size),
        mask=(1, size),
        take=lambda q: q.transpose(1, 0, 2),
        scores=scores,
        mix=lambda p, c: dot("nqs,nsd->nqd", p, dot("sr,nrd->nsd", c, w_vb)),
        rows=lambda res: res.transpose(1, 0, 2),
    )


def _tile_pass(
    out,  # f32[T, N, D_out]
    q,  # [T, N, *]: the form's queries (q_lat or q_nope), or None (grouped form)
    q_pe,  # [T, N, Dr]
    c_kv,  # [P, page_size, R] or [P, page_size, G, R]
    k_pe,  # [P, page_size, Dr] or [P, page_size, G, Dr]
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    first,  # i32[B]: token where row b's first tile of this size starts
    count,  # i32[B]: row b's tiles of this size
    *,
    form: _Form,
    scale: float,
    kv_type,
    k_pe_type,
    block_pages: int,
):  # -> f32[T, N, D_out]
    """Attend every tile of `size` queries (row b's `count[b]` tiles start at token `first[b]`
    and follow each other) and write those tiles' tokens into `out`."""
    t, size = out.shape[0], form.size
    pages, page_size = c_kv.shape[:2]
    slots = block_pages * page_size  # per kv block
    ends = jnp.cumsum(count)  # i32[B]: items of rows <= b
    offs = jnp.arange(size, dtype=jnp.int32)
    kv_shape = (slots, *c_kv.shape[2:-1])

    def item(i, out):
        b = jnp.sum(ends <= i).astype(jnp.int32)  # the row of item i
        start = first[b] + (i - (ends[b] - count[b])) * size  # first token of the tile
        q_end, kv_len = cu_q_lens[b + 1], kv_lens[b]
        tok = start + offs  # i32[size]
        real = tok < q_end
        pos = kv_len - q_end + tok  # each query's position in the row's sequence
        seen = kv_len - q_end + jnp.minimum(start + size, q_end)  # slots the tile's last query sees

        def queries(x):  # [T, N, *] -> f32[*lead, *]
            return form.take(x.at[tok].get(mode="fill", fill_value=0).astype(_F32))

        qm = None if q is None else queries(q)
        qp = queries(q_pe)
        row_pages = page_indices[b]  # i32[W]

        def kv_block(j, carry):
            m, denom, acc = carry  # f32[*lead], f32[*lead], f32[*lead, D_out]
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
            s = scale * form.scores(qm, qp, c, k)
            allowed = real[:, None] & (slot[None, :] <= pos[:, None])  # [size, slots]
            s = jnp.where(allowed.reshape(*form.mask, slots), s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a query that saw nothing yet
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            acc = alpha[..., None] * acc + form.mix(p, c)
            return m_new, alpha * denom + p.sum(axis=-1), acc

        init = (
            jnp.full(form.lead, -jnp.inf, _F32),
            jnp.zeros(form.lead, _F32),
            jnp.zeros((*form.lead, out.shape[-1]), _F32),
        )
        _, denom, acc = jax.lax.fori_loop(0, -(-seen // slots), kv_block, init)
        denom = denom[..., None]
        res = jnp.where(denom > 0, acc / jnp.where(denom > 0, denom, 1.0), 0.0)
        return out.at[jnp.where(real, tok, t)].set(form.rows(res), mode="drop")

    return jax.lax.fori_loop(0, ends[-1], item, out)


def _tile_levels(out, q, q_pe, c_kv, k_pe, meta, first, left, *, tiles, make_form, whole, **kw):
    """Cut each row's queries not yet attended (row b's `left[b]` from token `first[b]`) into
    tiles of the sizes `tiles`, largest first, and attend them in `make_form(size)`'s form. Every
    size is used whole only, except the last when `whole` is False (it takes the remainder).
    Returns (out, first, left) for the queries no tile took."""
    kv_lens, page_indices, cu_q_lens, _ = meta
    for level, size in enumerate(tiles):
        last = level == len(tiles) - 1 and not whole
        count = -(-left // size) if last else left // size
        out = _tile_pass(
            out, q, q_pe, c_kv, k_pe, kv_lens, page_indices, cu_q_lens, first, count,
            form=make_form(size), **kw,
        )  # fmt: skip
        first, left = first + count * size, jnp.maximum(left - count * size, 0)
    return out, first, left


def _prepare(q_pe, c_kv, meta, q_tiles, block_kv):
    """Checks the tiling arguments. -> (each row's first query, its query count, block pages)."""
    if not q_tiles or any(s <= 0 for s in q_tiles) or list(q_tiles) != sorted(q_tiles)[::-1]:
        raise ValueError(f"q_tiles must be positive sizes, largest first: {q_tiles}")
    if block_kv <= 0:
        raise ValueError(f"block_kv must be positive, got {block_kv}")
    kv_lens, _, cu_q_lens, num_rows = meta
    in_use = jnp.arange(kv_lens.shape[0]) < num_rows[0]
    first = cu_q_lens[:-1]
    left = jnp.where(in_use, cu_q_lens[1:] - first, 0)  # queries not yet in a tile, per row
    return first, left, max(1, block_kv // c_kv.shape[1])


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
    first, left, block_pages = _prepare(q_pe, c_kv, meta, q_tiles, block_kv)
    (t, n), r = q_pe.shape[:2], c_kv.shape[-1]
    out = jnp.zeros((t, n, r), _F32)
    if t == 0:  # nothing to gather from
        return out
    groups = c_kv.shape[2] if c_kv.ndim == 4 else None
    kw = dict(scale=scale, kv_type=kv_type, k_pe_type=k_pe_type, block_pages=block_pages)
    with jax.named_scope("ragged_paged_attention_ref"):
        out, _, _ = _tile_levels(
            out, q_lat, q_pe, c_kv, k_pe, meta, first, left, tiles=q_tiles, whole=False,
            make_form=lambda size: _absorbed_form(size, n, groups), **kw,
        )  # fmt: skip
    return out


@functools.partial(
    jax.jit,
    static_argnames=("scale", "kv_dtype", "k_pe_dtype", "expanded_tiles", "q_tiles", "block_kv"),
)
def ref_ragged_paged_mla(
    q_nope,  # [T, N, Dn]
    q_lat,  # [T, N, R]: q_nope multiplied into the latent space (for the absorbed tiles)
    q_pe,  # [T, N, Dr]
    c_kv,  # [P, page_size, R]
    k_pe,  # [P, page_size, Dr]
    w_kb,  # [N, Dn, R]: latent -> K_nope
    w_vb,  # [N, R, Dv]: latent -> V
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    num_rows,  # i32[1]
    *,
    scale: float,
    kv_dtype=None,
    k_pe_dtype=None,
    expanded_tiles: tuple[int, ...] = (),
    q_tiles: tuple[int, ...] = DEFAULT_Q_TILES,
    block_kv: int = DEFAULT_BLOCK_KV,
):  # -> (f32[T, N, Dv], f32[T, N, R])
    """MLA attention in both forms, plain jnp: each row's queries are first cut into whole
    tiles of the sizes `expanded_tiles` (largest first), attended in the expanded form (per
    kv block, the latent rows up to per-head K_nope and V: flash-style, blocked, no T x S
    scores); the rest into `q_tiles` in the absorbed form, as `ref_ragged_paged_attention`.
    Returns the expanded tiles' outputs in value space and the absorbed tiles' in the latent
    space (the caller applies W_vb), each 0 at the other's queries: their sum after W_vb is the
    attention of every query. Same contract as `ref_ragged_paged_attention` otherwise."""
    meta = (kv_lens, page_indices, cu_q_lens, num_rows)
    kv_type, k_pe_type = validate_static(
        q_lat, q_pe, c_kv, k_pe, *meta, kv_dtype=kv_dtype, k_pe_dtype=k_pe_dtype
    )
    (t, n), r = q_pe.shape[:2], c_kv.shape[-1]
    if q_nope.shape[:2] != (t, n) or w_kb.shape != (n, q_nope.shape[-1], r):
        raise ValueError(f"q_nope {q_nope.shape} and w_kb {w_kb.shape} do not fit q_pe and c_kv")
    if w_vb.shape[:2] != (n, r):
        raise ValueError(f"w_vb {w_vb.shape} must be [N={n}, R={r}, Dv]")
    if (
        any(s <= 0 for s in expanded_tiles)
        or list(expanded_tiles) != sorted(set(expanded_tiles))[::-1]
    ):
        raise ValueError(
            f"expanded_tiles must be distinct positive sizes, largest first: {expanded_tiles}"
        )
    first, left, block_pages = _prepare(q_pe, c_kv, meta, q_tiles, block_kv)
    out_v, out_lat = jnp.zeros((t, n, w_vb.shape[-1]), _F32), jnp.zeros((t, n, r), _F32)
    if t == 0:
        return out_v, out_lat
    kw = dict(scale=scale, kv_type=kv_type, k_pe_type=k_pe_type, block_pages=block_pages)
    with jax.named_scope("ragged_paged_mla_ref"):
        out_v, first, left = _tile_levels(
            out_v, q_nope, q_pe, c_kv, k_pe, meta, first, left, tiles=expanded_tiles,
            whole=True, make_form=lambda size: _expanded_form(size, n, w_kb, w_vb), **kw,
        )  # fmt: skip
        out_lat, _, _ = _tile_levels(
            out_lat, q_lat, q_pe, c_kv, k_pe, meta, first, left, tiles=q_tiles, whole=False,
            make_form=lambda size: _absorbed_form(size, n, None), **kw,
        )  # fmt: skip
    return out_v, out_lat
