"""Multi-head Latent Attention (DeepSeek-V2/V3, GLM-4.7-Flash): the pure attention math and the
`MLAAttention` module.

The cache holds per token the normalised latent `c_kv` [R] (the band a splice moves) and the
position-embedded rope band `k_pe` [Dr] (the band it rotates). `mla_attention` attends over a
latent cache in the expanded form (per-head K_nope and V made from the latent) or the absorbed
form (queries multiplied into the latent space); the full-sequence forward, the paged step and
DECAY's attention probe all call it or the paged kernel. The rope band is in the halves layout
(`leyline_jax.rope`); YaRN's attention factor is applied when a key or query is embedded.
The family's Hugging Face tensor table and converter close the module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from leyline_jax import kv_pools as kv
from leyline_jax import rope
from leyline_jax.config import MLAConfig
from leyline_jax.hf_config import ROUTER_SIGMOID_GROUPED
from leyline_jax.layers import HFLeaves, Linear, RMSNorm, contiguous, einsum, hf_shapes, mlp_shapes
from pallas_kernels.dispatch import lowering_platforms, on_platform
from pallas_kernels.expanded_attention import (
    KERNEL_BLOCK,
    PLATFORM_ATTEND,
    default_chunk,
    expanded_ragged_paged_mla,
    unsupported,
)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_ref import ref_ragged_paged_mla

# q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says (as the reference).
LATENT_NORM_EPS = 1e-6
# The expanded form's tile sizes on the jnp path: powers of two up to the step's tokens, at most
# this many floats of scores per kv block (N x tile x block_kv), at most two sizes a step (each
# size is one more loop to compile).
EXPANDED_SCORES = 1 << 24
EXPANDED_SIZES = 2
# On an accelerator (`expanded_tiles(platform="tpu" | "cuda")`): flops per byte of memory
# bandwidth at which a chip's dense bf16 matmuls and its memory stream take equal time, from the
# spec sheets (H100 SXM 989 TFLOP/s / 3.35 TB/s = 295, H200 989 / 4.8 = 206; TPU v5e 197 / 0.82 =
# 240, v5p 459 / 2.77 = 166, v6e 918 / 1.64 = 560), taken low: a lower balance favours the
# absorbed form. Tiles are whole kernel blocks of queries (`expanded_attention.KERNEL_BLOCK`) and
# at most three sizes a step (each one more loop and two kernel variants to compile).
ACCELERATOR_BALANCE = 200
ACCELERATOR_SIZES = 3
ACCELERATOR_MAX_TILE = 2048


def expanded_tiles(
    tokens: int,
    c: MLAConfig,
    block_kv: int = 512,
    *,
    platform: str = "cpu",
    slot_bytes: int | None = None,
) -> tuple[int, ...]:
    """The cost model: the query tile sizes a step of `tokens` new tokens (its bucket) attends
    in the expanded form on `platform` ("cpu": the jnp path; "tpu" / "cuda": the platform's
    flash attention, `pallas_kernels.expanded_attention`), largest first; () for the absorbed
    form only. Decode steps and short chunks stay absorbed.

    CPU. Per kv slot and head, a tile of E queries costs in the absorbed form E (2R + Dr)
    multiply-adds (scores against the latent and rope band, the latent mixed), and in the
    expanded form R (Dn + Dv) to make the slot's K_nope and V, then E (Dn + Dr + Dv). The
    expanded form wins when E > R (Dn + Dv) / (2R - Dn - Dv), whatever the context's length
    (DeepSeek-V2/V3 shapes: E > 171; measured on this CPU at a 4096-slot context: 1.6x faster
    at E = 256, 2.3x at 1024, 2.2x slower at 64). At most `EXPANDED_SIZES` sizes, each within
    `EXPANDED_SCORES` floats of scores per block of `block_kv` slots.

    Accelerators. The absorbed kernel runs a prefill chunk as one-query items that each read
    the row's pages again: per query and slot it streams the slot's stored bytes (`slot_bytes`,
    default R bf16 + Dr fp32) and does 2N (2R + Dr) flops, so it costs (in flops at a machine
    balance of `ACCELERATOR_BALANCE` flops a byte) max(2N (2R + Dr), balance x slot_bytes). A
    tile of E queries in the expanded form reads and expands each slot once per tile (2N R (Dn
    + Dv) flops and balance x slot_bytes, shared by its E queries) and then attends on the
    matmul units: 2N (Dn + Dr + Dv) + (2N R (Dn + Dv) + balance x slot_bytes) / E per query
    and slot. The expanded form wins where that is lower: at V2-Lite's widths (N 16) from
    E = 19 (the absorbed kernel is bound by the pages it re-reads), at V3's (N 128) from E =
    172 (bound by its flops); both kernels take whole blocks of 128 queries, so V2-Lite expands
    from 128 queries and V3 from 256. These numbers rest on spec-sheet rooflines alone, not on
    a measurement: no device was at hand to tune on. Sizes: the largest power of two within
    the step's tokens (at most `ACCELERATOR_MAX_TILE`), the smallest worthwhile, and between
    them a third (their geometric mean), so a row leaves fewer than the smallest tile's
    queries to the absorbed form."""
    r, dn, dv = c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
    if platform == "cpu":
        gain = 2 * r - dn - dv  # per query, per slot and head: what the expanded form saves
        sizes, e = [], 1 << max(tokens, 1).bit_length()
        while (e := e // 2) and len(sizes) < EXPANDED_SIZES and e * gain > r * (dn + dv):
            if e <= tokens and c.num_attention_heads * e * block_kv <= EXPANDED_SCORES:
                sizes.append(e)
        return tuple(sizes)
    if platform not in ("tpu", "cuda"):
        raise ValueError(f"platform must be 'cpu', 'tpu' or 'cuda', got {platform!r}")
    n, dr = c.num_attention_heads, c.qk_rope_head_dim
    read = ACCELERATOR_BALANCE * (r * 2 + dr * 4 if slot_bytes is None else slot_bytes)
    absorbed = max(2 * n * (2 * r + dr), read)
    expand, attend = 2 * n * r * (dn + dv) + read, 2 * n * (dn + dr + dv)
    large = min(ACCELERATOR_MAX_TILE, 1 << max(tokens, 1).bit_length() - 1)
    small = KERNEL_BLOCK
    while small <= large and attend + expand / small >= absorbed:
        small *= 2
    if small > large:
        return ()
    middle = 1 << (large.bit_length() + small.bit_length() - 2) // 2
    return tuple(sorted({large, middle, small}, reverse=True)[:ACCELERATOR_SIZES])


def absorb_queries(q_nope, w_kb):  # [T, N, Dn], [N, Dn, R] -> [T, N, R]
    """Queries into the latent space, per head. Written head-major (a batched matmul over N on
    [N, T, Dn]): XLA's CPU backend runs the same einsum on [T, N, Dn] several times slower."""
    return einsum("ntd,ndr->ntr", q_nope.transpose(1, 0, 2), w_kb).transpose(1, 0, 2)


def expand_values(o_lat, w_vb):  # [T, N, R], [N, R, Dv] -> [T, N, Dv]
    """A latent attention output up to each head's values (head-major, as `absorb_queries`)."""
    return einsum("ntr,nrd->ntd", o_lat.transpose(1, 0, 2), w_vb).transpose(1, 0, 2)


def mla_attention(
    q_nope: jnp.ndarray,  # [T, N, Dn]
    q_pe: jnp.ndarray,  # [T, N, Dr], position embedded
    c_kv: jnp.ndarray,  # [S, R], normalised latent
    k_pe: jnp.ndarray,  # [S, Dr], position embedded
    w_kb: jnp.ndarray,  # [N, Dn, R]: latent -> K_nope
    w_vb: jnp.ndarray,  # [N, R, Dv]: latent -> V
    mask: jnp.ndarray,  # bool[T, S], True where query t may attend slot s
    scale: float,
    *,
    absorbed: bool = False,
    mass: bool = False,
):  # [T, N, Dv] (and f32[T, S] with mass=True)
    """Multi-head latent attention over a latent cache.

    absorbed=False expands K_nope and V per head (cheaper when T is close to S: prefill);
    absorbed=True multiplies queries into the latent space and never materialises per-head K/V
    (cheaper when T << S: decode). The two are the same function up to rounding. With
    `mass=True` also returns the attention each query gave each slot, summed over heads
    (DECAY's importance, `leyline_jax.importance`).
    """
    f32 = jnp.float32
    if absorbed:
        q_lat = absorb_queries(q_nope, w_kb)
        scores = jnp.einsum("tnr,sr->nts", q_lat, c_kv, preferred_element_type=f32)
    else:
        k_nope = jnp.einsum("sr,ndr->snd", c_kv, w_kb)
        scores = jnp.einsum("tnd,snd->nts", q_nope, k_nope, preferred_element_type=f32)
    scores = scores + jnp.einsum("tnd,sd->nts", q_pe, k_pe, preferred_element_type=f32)
    scores = jnp.where(mask[None], scores * scale, -jnp.inf)
    p32 = jax.nn.softmax(scores, axis=-1)
    probs = p32.astype(q_nope.dtype)
    if absorbed:
        out_lat = jnp.einsum("nts,sr->tnr", probs, c_kv)
        out = expand_values(out_lat, w_vb)
    else:
        v = jnp.einsum("sr,nrd->snd", c_kv, w_vb)
        out = jnp.einsum("nts,snd->tnd", probs, v)
    return (out, p32.sum(0)) if mass else out


class MLAAttention(nnx.Module):
    def __init__(self, config: MLAConfig, dtype):
        c = config
        self.config = c
        n, dqk = c.num_attention_heads, c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, n * dqk, dtype)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, dtype)
            self.q_a_norm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(c.q_lora_rank, n * dqk, dtype)
        self.kv_a_proj = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, dtype)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, dtype)
        # the latent's up-projections (the checkpoint's kv_b_proj), head-major: the absorbed
        # form contracts them per head, and in this layout a step reads them without a copy
        self.k_up = nnx.Param(jnp.zeros((n, c.qk_nope_head_dim, c.kv_lora_rank), dtype))
        self.v_up = nnx.Param(jnp.zeros((n, c.kv_lora_rank, c.v_head_dim), dtype))
        self.o_proj = Linear(n * c.v_head_dim, c.hidden_size, dtype)

    def queries(self, x, positions):
        """[T, H], i32[T] -> q_nope [T, N, Dn], q_pe [T, N, Dr] (position embedded)."""
        c = self.config
        q = (
            self.q_proj(x)
            if c.q_lora_rank is None
            else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        )
        q = q.reshape(*x.shape[:-1], c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        q_pe = rope.apply_rope(q_pe, positions, c.rope_inv_freq(), c.rope_scale, heads_axis=True)
        return q_nope, q_pe

    def latent(self, x, positions):
        """[T, H], i32[T] -> c_kv [T, R] (normalised), k_pe [T, Dr] (embedded): the cached pair."""
        c = self.config
        kv = self.kv_a_proj(x)
        c_kv = self.kv_a_norm(kv[..., : c.kv_lora_rank])
        k_pe = rope.apply_rope(
            kv[..., c.kv_lora_rank :], positions, c.rope_inv_freq(), c.rope_scale
        )
        return c_kv, k_pe

    def cached(self, x, positions):
        """What the cache holds for these tokens (as `latent`): (c_kv, k_pe), the moved band
        and the rotated one (the same contract as `GQAAttention.cached`)."""
        return self.latent(x, positions)

    def kv_up(self):
        """w_kb [N, Dn, R], w_vb [N, R, Dv]: the up-projections of the latent."""
        return self.k_up[...], self.v_up[...]

    def output(self, o):
        """[T, N, Dv] -> [T, H]."""
        return self.o_proj(o.reshape(*o.shape[:-2], -1))

    def paged(self, x, positions, pools: kv.KVPools, layer: int, slots, meta):
        """Attention over the paged cache: [T, H] new tokens of a ragged batch
        (`leyline_jax.paged`) -> ([T, H], pools). Writes the new tokens' latent and `k_pe` to
        `slots` of layer `layer`, then attends reading `c_kv` and `k_pe` in place: in the
        absorbed form (queries multiplied into the latent space), and long query tiles of each
        row in the expanded form, where the cost model (`expanded_tiles`, per platform) gives
        tiles: on CPU (or impl "jnp") through the jnp path (`ref_ragged_paged_mla`), on TPU and
        CUDA through the platform's flash attention (`pallas_kernels.expanded_attention`, where
        it takes the shapes), the rest of each row through the absorbed kernel. `meta`:
        (kv_lens, page_indices, cu_q_lens, num_rows) as `ragged_paged_attention` takes them."""
        q_nope, q_pe = self.queries(x, positions)
        c_new, k_new = self.latent(x, positions)
        pools = kv.write_kv(pools, layer, slots, c_new, k_new)
        w_kb, w_vb = self.kv_up()
        # this layer's own arrays: read in place
        args = (absorb_queries(q_nope, w_kb), q_pe, pools.moved[layer], pools.rotated[layer], *meta)
        kw = dict(scale=self.config.softmax_scale, kv_dtype=pools.moved_dtype)
        kw |= dict(k_pe_dtype=pools.rotated_dtype)
        impl, tiles = pools.kernel_impl(None), expanded_tiles(x.shape[0], self.config)

        def absorbed(*args):
            out = ragged_paged_attention(*args, impl=impl, **kw)
            return expand_values(out.astype(x.dtype), w_vb)

        def both(q_lat, q_pe, c_kv, k_pe, *meta):  # long tiles expanded, the rest absorbed
            o_v, o_lat = ref_ragged_paged_mla(
                q_nope, q_lat, q_pe, c_kv, k_pe, w_kb, w_vb, *meta, expanded_tiles=tiles, **kw
            )  # each query's output is in one of the two, the other 0 there: the sum is exact
            return o_v.astype(x.dtype) + expand_values(o_lat.astype(x.dtype), w_vb)

        # what a slot's stored bands weigh, the keys' width, each row's slots at most
        c_kv, k_pe = args[2], args[3]
        slot_bytes = jnp.dtype(pools.moved_dtype).itemsize * c_kv.shape[-1]
        slot_bytes += jnp.dtype(pools.rotated_dtype).itemsize * k_pe.shape[-1]
        dk, row_slots = q_nope.shape[-1] + q_pe.shape[-1], meta[1].shape[1] * c_kv.shape[1]

        def flash(platform):  # long tiles through the platform's flash attention, or None
            sizes = expanded_tiles(
                x.shape[0], self.config, platform=platform, slot_bytes=slot_bytes
            )
            attend, chunk = PLATFORM_ATTEND[platform], default_chunk(sizes, row_slots)
            fits = unsupported(
                attend, tiles=sizes, chunk=chunk, heads=q_nope.shape[1], dk=dk,
                dv=w_vb.shape[-1], dtype=x.dtype,
            )  # fmt: skip
            if not sizes or fits is not None:
                return None

            def run(q_lat, q_pe, c_kv, k_pe, *meta):
                o_v, o_lat = expanded_ragged_paged_mla(
                    q_nope, q_lat, q_pe, c_kv, k_pe, w_kb, w_vb, *meta, expanded_tiles=sizes,
                    chunk=chunk, attend=attend, **kw,
                )  # fmt: skip
                return o_v.astype(x.dtype) + expand_values(o_lat.astype(x.dtype), w_vb)

            return run

        if impl is not None:  # "jnp" (a mesh): the jnp path; a kernel named: absorbed
            out = both(*args) if tiles and impl == "jnp" else absorbed(*args)
        else:  # per platform, chosen at lowering: only platforms it may be lowered for
            flashes = {p: flash(p) for p in ("tpu", "cuda") if p in lowering_platforms()}
            kernels = {p: f for p, f in flashes.items() if f is not None}
            if not tiles and not kernels:
                out = absorbed(*args)  # every platform absorbed: the dispatch chooses the kernel
            else:
                rest = dict.fromkeys(("tpu", "cuda"), absorbed)
                out = on_platform(both if tiles else absorbed, args, **(rest | kernels))
        return self.output(out), pools

    def probe(self, x, positions, pools: kv.KVPools, layer: int, ctx_slots, mask):
        """Attention of [T, H] tokens already cached (their KV is among `ctx_slots`) over a
        sequence's cached slots i32[S] (bool[T, S] `mask`), read from layer `layer`'s pools and
        written nowhere: ([T, H], f32[T, S] each query's attention per slot, summed over heads).
        Absorbed form, as the paged step attends."""
        q_nope, q_pe = self.queries(x, positions)
        c = kv.gather_slots(pools, layer, ctx_slots)
        w_kb, w_vb = self.kv_up()
        o, mass = mla_attention(
            q_nope, q_pe, *c, w_kb, w_vb, mask, self.config.softmax_scale, absorbed=True, mass=True
        )
        return self.output(o.astype(x.dtype)), mass

    def __call__(self, x, positions):
        """Causal self-attention over one whole sequence: [T, H], i32[T] -> [T, H]."""
        q_nope, q_pe = self.queries(x, positions)
        c_kv, k_pe = self.latent(x, positions)
        w_kb, w_vb = self.kv_up()
        t = x.shape[0]
        mask = jnp.tril(jnp.ones((t, t), bool))
        o = mla_attention(q_nope, q_pe, c_kv, k_pe, w_kb, w_vb, mask, self.config.softmax_scale)
        return self.output(o)


# ---- Hugging Face checkpoints ------------------------------------------------------------------
def hf_tensor_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face MLA checkpoint of this config holds, with its on-disk shape
    (linear weights `[out, in]` as torch stores them; experts one tensor per expert)."""
    c = config
    n, h = c.num_attention_heads, c.hidden_size

    def layer(p: str, i: int) -> dict[str, tuple[int, ...]]:
        a = f"{p}.self_attn"
        shapes: dict[str, tuple[int, ...]] = {}
        if c.q_lora_rank is None:
            shapes[f"{a}.q_proj.weight"] = (n * c.qk_head_dim, h)
        else:
            shapes[f"{a}.q_a_proj.weight"] = (c.q_lora_rank, h)
            shapes[f"{a}.q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[f"{a}.q_b_proj.weight"] = (n * c.qk_head_dim, c.q_lora_rank)
        shapes[f"{a}.kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, h)
        shapes[f"{a}.kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        shapes[f"{a}.kv_b_proj.weight"] = (n * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        shapes[f"{a}.o_proj.weight"] = (h, n * c.v_head_dim)
        if not c.is_sparse(i):
            return shapes | mlp_shapes(f"{p}.mlp", h, c.intermediate_size)
        shapes[f"{p}.mlp.gate.weight"] = (c.n_routed_experts, h)
        if c.router == ROUTER_SIGMOID_GROUPED:
            shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (c.n_routed_experts,)
        for e in range(c.n_routed_experts):
            shapes |= mlp_shapes(f"{p}.mlp.experts.{e}", h, c.moe_intermediate_size)
        if c.n_shared_experts:
            inter = c.moe_intermediate_size * c.n_shared_experts
            shapes |= mlp_shapes(f"{p}.mlp.shared_experts", h, inter)
        return shapes

    return hf_shapes(c, layer)


class _Leaves(HFLeaves):
    """MLA's leaves: `kv_b_proj` split into head-major `k_up` `[N, Dn, R]` and `v_up`
    `[N, R, Dv]`, experts stacked, interleaved rope rows permuted to the halves layout."""

    def _rope_rows(self, w, axis: int):  # the trailing Dr rows of `axis` in the halves layout
        if not self.c.rope_interleave:
            return w
        perm = rope.deinterleave_perm(self.c.qk_rope_head_dim)
        head, band = np.split(w, [w.shape[axis] - len(perm)], axis=axis)
        return np.concatenate([head, np.take(band, perm, axis=axis)], axis)

    def q_proj(self, name):  # [N*Dqk, in]: each head's rope rows permuted, then [in, N*Dqk]
        c = self.c
        shape = (c.num_attention_heads, c.qk_head_dim, -1)
        return {"kernel": lambda: self._rope_rows(self.get(name).reshape(shape), 1)
                .reshape(c.num_attention_heads * c.qk_head_dim, -1).T}  # fmt: skip

    def kv_a_proj(self, name):  # [R + Dr, H]: the rope rows permuted, then [H, R + Dr]
        return {"kernel": lambda: self._rope_rows(self.get(name), 0).T}

    def kv_up(self, name) -> dict:  # [N * (Dn + Dv), R] -> k_up [N, Dn, R], v_up [N, R, Dv]
        c = self.c
        n, dn = c.num_attention_heads, c.qk_nope_head_dim

        def kv_b():
            return self.get(name).reshape(n, dn + c.v_head_dim, c.kv_lora_rank)

        return {"k_up": lambda: kv_b()[:, :dn], "v_up": lambda: kv_b()[:, dn:].transpose(0, 2, 1)}

    def experts(self, names):  # E x [out, in] -> [E, in, out], filled one expert at a time
        def build():
            d_out, d_in = np.shape(self.tensors[names[0]])
            out = np.empty((len(names), d_in, d_out), np.dtype(self.dtype))
            for e, name in enumerate(names):
                contiguous(self.get(name).T, out=out[e])
            return out

        return build

    def attention(self, a: str) -> dict:
        attn: dict[str, Any] = {}
        if self.c.q_lora_rank is None:
            attn["q_proj"] = self.q_proj(f"{a}.q_proj.weight")
        else:
            attn["q_a_proj"] = self.linear(f"{a}.q_a_proj.weight")
            attn["q_a_norm"] = {"weight": self.plain(f"{a}.q_a_layernorm.weight")}
            attn["q_b_proj"] = self.q_proj(f"{a}.q_b_proj.weight")
        attn["kv_a_proj"] = self.kv_a_proj(f"{a}.kv_a_proj_with_mqa.weight")
        attn["kv_a_norm"] = {"weight": self.plain(f"{a}.kv_a_layernorm.weight")}
        attn["o_proj"] = self.linear(f"{a}.o_proj.weight")
        return attn | self.kv_up(f"{a}.kv_b_proj.weight")

    def moe(self, p: str) -> dict:  # the router and its bias stay float32
        ex = [f"{p}.mlp.experts.{e}" for e in range(self.c.n_routed_experts)]
        moe: dict[str, Any] = {
            "router": {"weight": self.linear(f"{p}.mlp.gate.weight", np.float32)["kernel"]},
            "experts": {
                k: self.experts([f"{e}.{k}_proj.weight" for e in ex])
                for k in ("gate", "up", "down")
            },
        }
        if self.c.router == ROUTER_SIGMOID_GROUPED:
            moe["router"]["bias"] = self.plain(f"{p}.mlp.gate.e_score_correction_bias", np.float32)
        if self.c.n_shared_experts:
            moe["shared"] = self.mlp(f"{p}.mlp.shared_experts")
        return moe


def lazy_hf_params(config: MLAConfig, tensors: Mapping[str, Any], dtype) -> dict[str, Any]:
    """Lazily: flat mapping of an MLA checkpoint's tensors (names and shapes already checked by
    the loader) -> nested params of `CausalLM`, each leaf a zero-argument callable (`_Leaves`)."""
    return _Leaves(config, tensors, dtype).params()
