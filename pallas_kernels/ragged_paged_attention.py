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
drift. The anchors' kernels (jax's and tpu-inference's MLA ragged paged attention) read one
fused, lane-aligned `[P, page, R + Dr]` cache; what keeping the bands apart costs on TPU is in
`pallas_kernels.ragged_paged_attention_tpu`.

Four implementations with one signature, and the jnp path in both MLA forms:
- `ref_ragged_paged_attention` (`pallas_kernels.ragged_paged_ref`; the validators are
  `ragged_paged_checks`): plain jnp, the production path on CPU (and on GPUs or shapes no kernel
  takes). Work items are (row, query tile): each row's queries are cut greedily into tiles of the
  sizes `q_tiles` (e.g. 64, 8, 1: a 100-token chunk is one tile of 64, four of 8 and four of 1; a
  decode row is one tile of 1), so no tile carries padding queries except in the last size. Each
  pass over one tile size is a loop over a dynamic number of items, and each item is a blocked
  online softmax over blocks of `block_kv` slots (whole pages), looping only up to its tile's last
  query position. A block gathers its slots from the pools; slots the tile cannot see get an
  out-of-range index and are filled with 0, so they are never read. Work is about sum_b q_len_b *
  kv_len_b (rounded to tiles and blocks), never B * max_q * max_kv.
- `ref_ragged_paged_mla` (beside it): the jnp path in both MLA forms, long query tiles in the
  expanded form (per kv block, the latent up to per-head K and V) and the rest absorbed; which
  tiles are expanded is the caller's cost model (`leyline_jax.mla.expanded_tiles`).
- `ragged_paged_attention_kernel` (`pallas_kernels.ragged_paged_attention_tpu`): a Pallas TPU
  kernel. Grid: blocks of `block_q` query tokens
  (aligned on T, q and out moved by BlockSpec). Per block it walks the rows whose queries fall in
  it (first row via scalar prefetch), and for each row fetches the row's pages of both bands by
  DMA from HBM (`memory_space=pl.ANY`), `block_kv` slots at a time, double-buffered within the
  row, copying only pages the block's queries can see; an online softmax over the block's
  (token, head) query rows updates only that row's queries.
- `ragged_paged_attention_gpu` (`pallas_kernels.ragged_paged_attention_gpu`): a Mosaic GPU
  kernel for Hopper, both forms, on the tensor cores with fp32 operands split into bf16 terms:
  split-KV over every SM by a per-step schedule (persistent programs, kv blocks of 64 slots
  double-buffered by TMA), the splits merged by log-sum-exp after it.
- `ragged_paged_attention`: the dispatch (the TPU kernel on TPU, the GPU kernel on a Hopper
  GPU, jnp elsewhere, chosen at lowering; interpret modes on request).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.dispatch import hopper, on_platform, resolve
from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu, unsupported
from pallas_kernels.ragged_paged_attention_tpu import (
    DEFAULT_BLOCK_Q,
    ragged_paged_attention_kernel,
)
from pallas_kernels.ragged_paged_checks import fits_tpu, validate_dynamic, validate_static
from pallas_kernels.ragged_paged_ref import (
    DEFAULT_BLOCK_KV,
    DEFAULT_Q_TILES,
    ref_ragged_paged_attention,
    ref_ragged_paged_mla,
)

__all__ = [
    "DEFAULT_BLOCK_KV",
    "DEFAULT_BLOCK_Q",
    "DEFAULT_Q_TILES",
    "ragged_paged_attention",
    "ragged_paged_attention_kernel",
    "ref_ragged_paged_attention",
    "ref_ragged_paged_mla",
    "validate_dynamic",
    "validate_static",
]

TARGETS = ("tpu", "gpu")  # the backends with a compiled kernel (see `dispatch`)


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

    impl: see `pallas_kernels.dispatch` (None: the TPU kernel on TPU for the MLA form, the Mosaic
    GPU kernel on a Hopper GPU where it takes the arrays, both forms; jnp everywhere else, chosen at
    lowering). `kv_dtype` / `k_pe_dtype`: the float type a band's stored values mean (default: its
    own dtype; required for raw bits). `q_tiles` tunes the jnp path, `block_q` the kernel,
    `block_kv` both. Concrete metadata is validated here (`validate_dynamic`); under the caller's
    jit that is the caller's job.
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
        if q_lat is not None and fits_tpu(*args, kv_dtype=kv_dtype, k_pe_dtype=k_pe_dtype):
            kernels["tpu"] = functools.partial(tpu, interpret=False)
        gpu_args = (q_lat, q_pe, c_kv, k_pe, page_indices, kv_type, k_type)
        if hopper() and unsupported(*gpu_args) is None:
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
