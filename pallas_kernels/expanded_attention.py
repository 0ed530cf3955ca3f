"""expanded_attention: MLA attention in the expanded form over a paged latent cache, through a
maintained flash attention kernel: the long query tiles of prefill chunks on the accelerators.

`expanded_ragged_paged_mla` has `ref_ragged_paged_mla`'s contract (rows, pages, storage and
padding as `pallas_kernels.ragged_paged_attention`'s module docstring defines them): each row's
queries are first cut into whole tiles of the sizes `expanded_tiles` (largest first, from the
row's first new query), attended in the expanded form; the queries no tile took (the tail of
each row: decode tokens, short chunks, the remainder of a long one) are attended in the
absorbed form by `ragged_paged_attention` (the platform's kernel) over compacted rows. It returns
the expanded tiles' outputs in value space and the absorbed queries' in the latent space, each 0
at the other's queries (the caller applies W_vb to the second and adds).

Dimension letters: T query tokens, N heads, R latent width, Dn / Dr / Dv the nope, rope and
value widths (Dk = Dn + Dr), P pages, B rows, W page-table width, E a tile's queries, C a
chunk's slots.

A tile. Tile i of row b holds queries at positions p0 .. p0 + E - 1 and sees slots 0 .. hi - 1,
hi = p0 + E. Its slots are taken in chunks of C (C >= E) counted back from hi: chunk j holds
slots hi - (j + 1) C .. hi - j C - 1, gathered from the row's pages (slots below 0 get an
out-of-range page: filled with 0, never read into a result) and expanded per head:

    K[s, n] = [c_kv[s] W_kb[n]^T | k_pe[s]]   [C, N, Dk]      V[s, n] = c_kv[s] W_vb[n]  [C, N, Dv]

Query i sees key k of chunk j when its slot is >= 0 (k >= k_start = max(0, (j + 1) C - hi)) and
<= p0 + i, which in chunk 0 is k <= i + C - E (a causal mask whose diagonal sits C - E to the
right: static) and in every later chunk always holds (C >= E). So one flash attention call per
(tile, chunk) with static masks and one dynamic lower bound on the keys, each returning its
outputs and log-sum-exp; the chunks are merged by their log-sum-exp. With a kernel call no
array of scores exists outside the kernel (it holds a block_q x block_kv tile in registers or
VMEM; tests/test_lowering_prefill.py checks the lowered programs). Every query of a tile sees
at least one key of every chunk it is given (its own slot in chunk 0; chunk j > 0 is only given
while hi - j C > 0), so no merge meets an empty softmax.

The attention calls (`ATTENDS`; `attend(q [E, N, Dk], k [C, N, Dk], v [C, N, Dv], k_start
i32[], *, causal, scale) -> (o f32[E, N, Dv], lse f32[E, N])`):
- "tokamax" (CUDA, Hopper): tokamax's Mosaic GPU flash attention for sm90
  (`tokamax._src.ops.attention.pallas_mosaic_gpu_kernel_sm90.flash_attention_kernel`, tokamax
  pinned in pyproject.toml), called below tokamax's `dot_product_attention`: that entry point
  asks the device it runs on at trace time ("Not supported on cpu", "Only supported for sm90
  and sm100 GPUs"), so a program traced here for CUDA could not hold it, and it does not return
  the log-sum-exp the chunks are merged by. The kernel takes k_start / k_end per query (k_end
  makes the causal diagonal), a value width other than the key's, and bf16 operands (fp32
  softmax and accumulation; f32 inputs are rounded to bf16 first, as tokamax's own entry does).
- "splash" (TPU): jax's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`):
  the static causal mask with its offset, segment ids for k_start, the log-sum-exp as a
  residual; operands in the activations' dtype. "splash_interpret" is the same kernel under
  Pallas' interpreter (any backend: the CPU proof of the TPU path).
- "xla": the contract in plain jnp (fp32 at HIGHEST precision; [N, E, C] scores per call):
  the reference the kernels are tested against, and the CPU proof of the GPU path (tokamax's
  kernel does not run under Mosaic GPU's interpreter: "Higher-order primitive run_state").

cuDNN's attention (`jax.nn.dot_product_attention(implementation="cudnn")`) does not lower
without a GPU ("cuDNN is not detected" at trace time) and requires V as wide as K.

`PLATFORM_ATTEND` names each accelerator's call; `unsupported` says why a call cannot take a
step (None when it can); the cost model choosing the tiles is `leyline_jax.mla.expanded_tiles`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_checks import from_storage, validate_static

_F32 = jnp.float32
_I32 = jnp.int32
_HIGHEST = jax.lax.Precision.HIGHEST
# Both kernels take queries and keys in blocks of 128 (tokamax: two warpgroups of 64 query rows;
# splash: block_q 128) and slots in blocks of 128: tiles and chunks are multiples of this.
KERNEL_BLOCK = 128
# Slots per chunk: at least the largest tile, at most this unless a tile is larger, and no more
# than the row's page table holds (rounded up to a power of two). At DeepSeek-V3's widths
# (N 128, Dk 192, Dv 128, bf16) a chunk of 1024 slots is 80 MB of K and V.
CHUNK = 1024
# tokamax's sm90 kernel: 227 KB of shared memory a block (H100, H200), its estimate's margin.
_SM90_SMEM, _SM90_SMEM_EXTRA = 227 * 1024, 2200
PLATFORM_ATTEND = {"cuda": "tokamax", "tpu": "splash"}


# ---- the attention calls: (q, k, v, k_start) -> (outputs, log-sum-exp) ------------------------
def _keys_allowed(e: int, c: int, k_start, causal: bool):  # -> bool[E, C]
    key = jnp.arange(c, dtype=_I32)[None, :]
    allowed = key >= k_start
    if causal:
        allowed = allowed & (key <= jnp.arange(e, dtype=_I32)[:, None] + (c - e))
    return allowed


def attend_xla(q, k, v, k_start, *, causal: bool, scale: float):
    """The attention call's contract in jnp (module docstring): fp32, scores [N, E, C]."""
    e, c = q.shape[0], k.shape[0]
    q, k, v = (a.astype(_F32) for a in (q, k, v))
    s = scale * jnp.einsum("end,cnd->nec", q, k, precision=_HIGHEST)
    s = jnp.where(_keys_allowed(e, c, k_start, causal)[None], s, -jnp.inf)
    m = s.max(axis=-1)  # f32[N, E]: finite, every query sees a key
    p = jnp.exp(s - m[..., None])
    denom = p.sum(axis=-1)
    o = jnp.einsum("nec,cnd->end", p, v, precision=_HIGHEST) / denom.T[..., None]
    return o, (m + jnp.log(denom)).T


def _sm90_smem(dk: int, dv: int, block_kv: int) -> int:
    """Bytes of shared memory tokamax's sm90 kernel takes (its own estimate: block_q 64, two
    stages, bf16 operands, Dk padded to 16 elements; queries and keys share a union with the
    outputs)."""
    dk = -(-dk // 16) * 16
    union = max((2 * 64 + 2 * block_kv) * dk, 2 * 64 * dv) * 2
    return union + 2 * block_kv * dv * 2 + _SM90_SMEM_EXTRA


def _sm90_block_kv(dk: int, dv: int) -> int | None:
    """Slots per block of tokamax's sm90 kernel (its heuristic): 128 where shared memory holds
    them, else 64; None when not even 64 fit."""
    return next((b for b in (128, 64) if _sm90_smem(dk, dv, b) < _SM90_SMEM), None)


def attend_tokamax(q, k, v, k_start, *, causal: bool, scale: float):
    """tokamax's Mosaic GPU flash attention (sm90), bf16 operands, fp32 softmax."""
    from tokamax._src.ops.attention import pallas_mosaic_gpu_kernel_sm90 as sm90

    e, c = q.shape[0], k.shape[0]
    bf16 = jnp.dtype(jnp.bfloat16)
    k_end = (jnp.arange(e, dtype=_I32) + (c - e + 1))[None] if causal else None  # [1, E]
    block_kv = _sm90_block_kv(q.shape[-1], v.shape[-1])
    out, (m, denom) = sm90.flash_attention_kernel(
        q.astype(bf16), k.astype(bf16), v.astype(bf16), None, None,
        jnp.reshape(k_start, (1, 1)).astype(_I32), k_end,
        is_causal=False, logits_soft_cap=None, logits_scale=scale, out_dtype=bf16,
        normalize_output=True, return_residuals=True, use_stable_softmax=True,
        rescale_threshold=1.0, config=sm90.Config(block_q=64, block_kv=block_kv, num_stages=2),
    )  # fmt: skip
    # residuals [N, E]: the largest scaled score m and sum exp(score - m)
    return out.astype(_F32), (m + jnp.log(denom)).T


def attend_splash(q, k, v, k_start, *, causal: bool, scale: float, interpret: bool = False):
    """jax's splash attention (Pallas TPU), operands in q's dtype, fp32 softmax."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    e, n, c = q.shape[0], q.shape[1], k.shape[0]
    one = sm.CausalMask((e, c), offset=c - e) if causal else sm.FullMask((e, c))
    kernel = sk.make_splash_mha(
        sm.MultiHeadMask([one] * n), head_shards=1, q_seq_shards=1, save_residuals=True,
        block_sizes=sk.BlockSizes(block_q=KERNEL_BLOCK, block_kv=KERNEL_BLOCK),
        interpret=interpret,
    )  # fmt: skip
    segments = sk.SegmentIds(
        q=jnp.ones((e,), _I32), kv=(jnp.arange(c, dtype=_I32) >= k_start).astype(_I32)
    )
    q = (q.astype(_F32) * scale).astype(q.dtype)  # splash applies no scale
    out, (lse,) = kernel(
        q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), segment_ids=segments
    )  # [N, E, Dv], [N, E]
    return out.transpose(1, 0, 2).astype(_F32), lse.T


ATTENDS = {
    "xla": attend_xla,
    "tokamax": attend_tokamax,
    "splash": attend_splash,
    "splash_interpret": functools.partial(attend_splash, interpret=True),
}
KERNELS = ("tokamax", "splash", "splash_interpret")  # calls with the kernels' block granularity
_HEADS_MAJOR = ("splash", "splash_interpret")  # K and V expanded as [N, C, D] for these


# ---- validators --------------------------------------------------------------------------------
def default_chunk(tiles: tuple[int, ...], slots: int) -> int:
    """Slots per chunk for `tiles` over rows of at most `slots` slots (module docstring)."""
    cap = min(CHUNK, 1 << max(slots - 1, 0).bit_length())
    return max(max(tiles, default=1), cap)


def unsupported(
    attend: str,
    *,
    tiles: tuple[int, ...],
    chunk: int,
    heads: int,
    dk: int,
    dv: int,
    dtype=jnp.bfloat16,
) -> str | None:
    """Why the call `attend` cannot take tiles `tiles` and chunks of `chunk` slots of `heads`
    heads at key width `dk` and value width `dv` (operands of `dtype`); None when it can. For
    "tokamax" also: jax's GPU, when a program is traced on one, is a Hopper (compute capability
    9.x; traced elsewhere, a Hopper is assumed). A kernel call must import and trace at these
    shapes on this jax (checked once per shape: tokamax, outside jax, may break on a jax it was
    not written for, and the step then stays absorbed rather than failing)."""
    if attend not in ATTENDS:
        return f"unknown attention call {attend!r}: one of {', '.join(ATTENDS)}"
    if any(e > chunk for e in tiles):
        return f"chunks of {chunk} slots are shorter than the tiles {tiles}"
    blocks = (chunk, *tiles) if tiles else ()
    if attend in KERNELS and any(x % KERNEL_BLOCK for x in blocks):
        return f"tiles {tiles} and chunk {chunk} must be multiples of {KERNEL_BLOCK}"
    if attend == "tokamax":
        if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
            return f"tokamax's kernel takes float32 or bfloat16 operands, not {dtype}"
        if _sm90_block_kv(dk, dv) is None:
            return f"widths Dk {dk} / Dv {dv} do not fit tokamax's kernel in shared memory"
        if jax.default_backend() == "gpu":
            capability = str(getattr(jax.devices()[0], "compute_capability", ""))
            if capability.split(".")[0] != "9":
                return f"tokamax's sm90 kernel needs a Hopper GPU, not compute {capability}"
    if attend in KERNELS and tiles:
        shape = (max(tiles), chunk, heads, dk, dv, jnp.dtype(dtype))
        return _trace_error(attend, ATTENDS[attend], *shape)
    return None


@functools.cache
def _trace_error(attend: str, call, e: int, c: int, n: int, dk: int, dv: int, dtype) -> str | None:
    """What tracing `call` (the call named `attend`) on a tile of `e` queries and a chunk of `c`
    keys raises (both masks), as text; None when it traces."""
    sds = jax.ShapeDtypeStruct
    args = (sds((e, n, dk), dtype), sds((c, n, dk), dtype), sds((c, n, dv), dtype))
    try:
        for causal in (True, False):
            jax.eval_shape(functools.partial(call, causal=causal, scale=1.0), *args, sds((), _I32))
    except Exception as err:  # whatever a kernel outside jax raises: said, not raised
        return f"{attend}'s kernel does not trace here: {err!r}"
    return None


def _check(q_nope, q_lat, q_pe, c_kv, k_pe, w_kb, w_vb, meta, tiles, kv_dtype, k_pe_dtype):
    kv_type, k_pe_type = validate_static(
        q_lat, q_pe, c_kv, k_pe, *meta, kv_dtype=kv_dtype, k_pe_dtype=k_pe_dtype
    )
    (t, n), r = q_pe.shape[:2], c_kv.shape[-1]
    if q_nope.shape[:2] != (t, n) or w_kb.shape != (n, q_nope.shape[-1], r):
        raise ValueError(f"q_nope {q_nope.shape} and w_kb {w_kb.shape} do not fit q_pe and c_kv")
    if w_vb.shape[:2] != (n, r):
        raise ValueError(f"w_vb {w_vb.shape} must be [N={n}, R={r}, Dv]")
    if any(e <= 0 for e in tiles) or list(tiles) != sorted(set(tiles))[::-1]:
        raise ValueError(f"expanded_tiles must be distinct positive sizes, largest first: {tiles}")
    return kv_type, k_pe_type


# ---- the expanded tiles ------------------------------------------------------------------------
def _merge(a, b):
    """Two partial attentions of the same queries over disjoint keys -> their union's."""
    (oa, la), (ob, lb) = a, b  # f32[E, N, Dv], f32[E, N]
    m = jnp.maximum(la, lb)
    wa, wb = jnp.exp(la - m), jnp.exp(lb - m)
    o = (oa * wa[..., None] + ob * wb[..., None]) / (wa + wb)[..., None]
    return o, m + jnp.log(wa + wb)


def _tiles_pass(
    out,  # f32[T, N, Dv]
    q,  # [T, N, Dk]: q_nope | q_pe, the attention's operand dtype
    c_kv,  # [P, page_size, R]
    k_pe,  # [P, page_size, Dr]
    w_kb,  # [N, Dn, R], the operand dtype
    w_vb,  # [N, R, Dv], the operand dtype
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    first,  # i32[B]: token where row b's first tile of this size starts
    count,  # i32[B]: row b's tiles of this size
    *,
    size: int,
    chunk: int,
    attend: str,
    scale: float,
    kv_type,
    k_pe_type,
):  # -> f32[T, N, Dv]
    """Attend every tile of `size` queries (row b's `count[b]` tiles start at token `first[b]`
    and follow each other), chunk by chunk (module docstring), into `out`."""
    pages, page_size = c_kv.shape[:2]
    n, dn = w_kb.shape[:2]
    ends = jnp.cumsum(count)  # i32[B]: tiles of rows <= b
    dtype = q.dtype
    precision = _HIGHEST if dtype == _F32 else None
    spec = "nsd" if attend in _HEADS_MAJOR else "snd"
    call = functools.partial(ATTENDS[attend], scale=scale)

    def item(i, out):
        b = jnp.sum(ends <= i).astype(_I32)  # the row of tile i
        start = first[b] + (i - (ends[b] - count[b])) * size  # its first token
        hi = kv_lens[b] - cu_q_lens[b + 1] + start + size  # the slots it sees: [0, hi)
        qt = jax.lax.dynamic_slice_in_dim(q, start, size)  # [E, N, Dk]
        row_pages = page_indices[b]  # i32[W]

        def chunk_kv(j):  # chunk j's keys [C, N, Dk] and values [C, N, Dv], and its k_start
            low = hi - (j + 1) * chunk
            slot = low + jnp.arange(chunk, dtype=_I32)
            page = row_pages.at[slot // page_size].get(mode="fill", fill_value=pages)
            page = jnp.where(slot >= 0, page, pages)  # below the row's first slot: never read
            c = c_kv.at[page, slot % page_size].get(mode="fill", fill_value=0)  # [C, R]
            kr = k_pe.at[page, slot % page_size].get(mode="fill", fill_value=0)  # [C, Dr]
            c = from_storage(c, kv_type).astype(dtype)
            kr = from_storage(kr, k_pe_type).astype(dtype)

            def up(w, ws):  # the latent up to every head, f32 accumulation
                return jnp.einsum(
                    f"sr,{ws}->{spec}", c, w, precision=precision, preferred_element_type=_F32
                ).astype(dtype)

            k_nope, v = up(w_kb, "ndr"), up(w_vb, "nrd")
            rope_shape = (n, chunk, kr.shape[-1]) if spec == "nsd" else (chunk, n, kr.shape[-1])
            rope = jnp.broadcast_to(kr[None] if spec == "nsd" else kr[:, None], rope_shape)
            k = jnp.concatenate([k_nope, rope], axis=-1)
            if spec == "nsd":  # the call's operands are token-major; XLA folds the transposes
                k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
            return k, v, jnp.maximum(0, -low)

        res = call(qt, *chunk_kv(0), causal=True)

        def more(j, res):
            return _merge(res, call(qt, *chunk_kv(j), causal=False))

        o, _ = jax.lax.fori_loop(1, -(-hi // chunk), more, res)
        return jax.lax.dynamic_update_slice_in_dim(out, o, start, 0)

    return jax.lax.fori_loop(0, ends[-1], item, out)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "kv_dtype", "k_pe_dtype", "expanded_tiles", "chunk", "attend", "absorbed_impl",
    ),
)  # fmt: skip
def expanded_ragged_paged_mla(
    q_nope,  # [T, N, Dn]
    q_lat,  # [T, N, R]: q_nope multiplied into the latent space (for the absorbed queries)
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
    expanded_tiles: tuple[int, ...],
    chunk: int | None = None,
    attend: str = "xla",
    absorbed_impl: str | None = None,
):  # -> (f32[T, N, Dv], f32[T, N, R])
    """MLA attention with each row's long query tiles expanded through the flash attention
    `attend` and the rest absorbed (module docstring; the contract of `ref_ragged_paged_mla`).

    The attention's operands are q_nope's dtype (the activations'). `chunk`: slots per chunk
    (default `default_chunk`). `absorbed_impl`: `ragged_paged_attention`'s impl for the queries
    no tile took (None: the platform's kernel, chosen at lowering). Raises ValueError when the
    arrays do not fit each other or `attend` cannot take the tiles (`unsupported`)."""
    meta = (kv_lens, page_indices, cu_q_lens, num_rows)
    tiles = expanded_tiles
    kv_type, k_pe_type = _check(
        q_nope, q_lat, q_pe, c_kv, k_pe, w_kb, w_vb, meta, tiles, kv_dtype, k_pe_dtype
    )
    (t, n), page_size = q_pe.shape[:2], c_kv.shape[1]
    dn, dv = q_nope.shape[-1], w_vb.shape[-1]
    chunk = default_chunk(tiles, page_indices.shape[1] * page_size) if chunk is None else chunk
    dtype = q_nope.dtype
    dk = dn + q_pe.shape[-1]
    why = unsupported(attend, tiles=tiles, chunk=chunk, heads=n, dk=dk, dv=dv, dtype=dtype)
    if why is not None:
        raise ValueError(why)
    in_use = jnp.arange(kv_lens.shape[0]) < num_rows[0]
    first = cu_q_lens[:-1]
    left = jnp.where(in_use, cu_q_lens[1:] - first, 0)  # queries not yet in a tile, per row
    out_v = jnp.zeros((t, n, dv), _F32)
    if t == 0:
        return out_v, jnp.zeros((t, n, c_kv.shape[-1]), _F32)
    q = jnp.concatenate([q_nope, q_pe.astype(dtype)], axis=-1)  # [T, N, Dk]
    kw = dict(chunk=chunk, attend=attend, scale=scale, kv_type=kv_type, k_pe_type=k_pe_type)
    with jax.named_scope("expanded_paged_mla"):
        for size in tiles:
            count = left // size
            out_v = _tiles_pass(
                out_v, q, c_kv, k_pe, w_kb.astype(dtype), w_vb.astype(dtype), kv_lens,
                page_indices, cu_q_lens, first, count, size=size, **kw,
            )  # fmt: skip
            first, left = first + count * size, left - count * size
    # the rest: each row's last `left` queries, compacted to rows of their own
    cu = jnp.concatenate([jnp.zeros(1, _I32), jnp.cumsum(left).astype(_I32)])  # i32[B + 1]
    idx = jnp.arange(t, dtype=_I32)
    row = jnp.clip(jnp.searchsorted(cu[1:], idx, side="right"), 0, left.shape[0] - 1)
    src = jnp.where(idx < cu[-1], first[row] + idx - cu[row], t)  # i32[T]; t: padding

    def take(x):
        return x.at[src].get(mode="fill", fill_value=0)

    o_lat = ragged_paged_attention(
        take(q_lat), take(q_pe), c_kv, k_pe, kv_lens, page_indices, cu, num_rows,
        scale=scale, kv_dtype=kv_dtype, k_pe_dtype=k_pe_dtype, impl=absorbed_impl,
    )  # fmt: skip
    out_lat = jnp.zeros_like(o_lat).at[src].set(o_lat, mode="drop")
    return out_v, out_lat
