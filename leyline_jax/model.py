"""The Flax (NNX) decoder: `CausalLM`, and the MLA attention of the DeepSeek-V2/V3 and
GLM-4.7-Flash families.

The decoder (embedding, layers of attention + MLP/MoE, final norm, LM head) is shared by every
attention family; a layer's attention module comes from its config (`config.attention(dtype)`)
and answers two calls: `attn(x, positions)`, causal self-attention over one whole sequence, and
`attn.paged(x, positions, pools, layer, slots, meta)`, the same over the paged cache (it writes
its layer's bands and attends through `pallas_kernels.ragged_paged_attention`). MLA lives here;
the GQA family in `leyline_jax.gqa`.

Modules hold parameters; the math lives in pure functions (`rms_norm`, `mla_attention`, `route`,
`moe_experts`) so that the paged prefill/decode path reuses it unchanged. `moe_experts` runs the
routed experts dense (every expert on every token: the oracle, and the faster for tiny experts)
or grouped (the assignments sorted by expert, each expert multiplying its own rows:
`jax.lax.ragged_dot` on GPU/TPU, a loop over the experts on CPU), chosen by shape at trace
time. Weights are stored `[in, out]` (`x @ kernel`); the rope band is in the halves layout (see
`leyline_jax.rope`).

Dtype policy, as the reference: parameters and activations in the model dtype; RMSNorm
statistics, RoPE, softmax, the router and the logits in float32.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from leyline_jax import kv_state as kv
from leyline_jax import rope
from leyline_jax.config import (
    ROUTER_SIGMOID_GROUPED,
    ROUTER_SOFTMAX_GREEDY,
    ROUTER_SOFTMAX_GROUP_LIMITED,
    MLAConfig,
    check_tokens,
)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

# q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says (as the reference).
LATENT_NORM_EPS = 1e-6


# ---- pure functions --------------------------------------------------------------------------
def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """[..., D] -> [..., D]: statistics in fp32, normalised value cast back before the weight."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return weight * (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def absorb_queries(q_nope, w_kb):  # [T, N, Dn], [N, Dn, R] -> [T, N, R]
    """Queries into the latent space, per head. Written head-major (a batched matmul over N on
    [N, T, Dn]): XLA's CPU backend runs the same einsum on [T, N, Dn] several times slower."""
    return jnp.einsum("ntd,ndr->ntr", q_nope.transpose(1, 0, 2), w_kb).transpose(1, 0, 2)


def expand_values(o_lat, w_vb):  # [T, N, R], [N, R, Dv] -> [T, N, Dv]
    """A latent attention output up to each head's values (head-major, as `absorb_queries`)."""
    return jnp.einsum("ntr,nrd->ntd", o_lat.transpose(1, 0, 2), w_vb).transpose(1, 0, 2)


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


def route(
    x: jnp.ndarray,  # [T, H]
    weight: jnp.ndarray,  # f32[H, E]
    bias: jnp.ndarray | None,  # f32[E] (e_score_correction_bias) or None
    config: MLAConfig,
) -> tuple[jnp.ndarray, jnp.ndarray]:  # f32[T, k] weights, i32[T, k] expert ids
    """Top-k expert choice with the family's rule (transformers' `*TopkRouter.forward`)."""
    logits = jnp.dot(x.astype(jnp.float32), weight.astype(jnp.float32))  # [T, E]
    t, e = logits.shape
    k, groups = config.num_experts_per_tok, config.n_group
    per_group = e // groups

    def group_mask(group_scores):  # [T, G] -> bool[T, E]: experts of the topk_group best groups
        _, gidx = jax.lax.top_k(group_scores, config.topk_group)
        gmask = jnp.zeros((t, groups), bool).at[jnp.arange(t)[:, None], gidx].set(True)
        return jnp.repeat(gmask, per_group, axis=-1)

    if config.router == ROUTER_SOFTMAX_GREEDY:
        scores = jax.nn.softmax(logits, axis=-1)
        weights, idx = jax.lax.top_k(scores, k)
    elif config.router == ROUTER_SOFTMAX_GROUP_LIMITED:
        scores = jax.nn.softmax(logits, axis=-1)
        gscores = scores.reshape(t, groups, per_group).max(axis=-1)
        scores = jnp.where(group_mask(gscores), scores, 0.0)
        weights, idx = jax.lax.top_k(scores, k)
    elif config.router == ROUTER_SIGMOID_GROUPED:
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias if bias is not None else scores
        top2, _ = jax.lax.top_k(choice.reshape(t, groups, per_group), 2)
        choice = jnp.where(group_mask(top2.sum(-1)), choice, -jnp.inf)
        _, idx = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    else:  # MLAConfig validates the router name; this is unreachable
        raise AssertionError(config.router)
    return weights * config.routed_scaling_factor, idx


def swiglu(x: jnp.ndarray, gate: jnp.ndarray, up: jnp.ndarray, down: jnp.ndarray) -> jnp.ndarray:
    """[..., H] -> [..., H]: down(silu(x @ gate) * (x @ up))."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


class MoEDispatch(enum.Enum):
    """How the routed experts run (`Experts.moe_dispatch`; set it on a whole model with
    `model.set_attributes(moe_dispatch=MoEDispatch.DENSE)`)."""

    AUTO = "auto"  # by shape, at trace time: `prefers_grouped`
    DENSE = "dense"  # every expert on every token: the oracle, and the cheaper one for tiny E*H*I
    GROUPED = "grouped"  # each token through its k experts only


def moe_experts_dense(
    x: jnp.ndarray,  # [T, H]
    weights: jnp.ndarray,  # f32[T, k]
    idx: jnp.ndarray,  # i32[T, k]
    gate: jnp.ndarray,  # [E, H, I]
    up: jnp.ndarray,  # [E, H, I]
    down: jnp.ndarray,  # [E, I, H]
) -> jnp.ndarray:  # [T, H]
    """Weighted sum of the chosen experts' SwiGLU outputs, every expert run on every token.

    Unchosen experts get weight 0. Exact and shape-static, with no sort, gather or loop: the
    oracle the grouped dispatch is tested against, and the faster one where the expert weights
    are small (`prefers_grouped`); it costs E/k times the routed flops.
    """
    t, e = x.shape[0], gate.shape[0]
    combine = jnp.zeros((t, e), jnp.float32).at[jnp.arange(t)[:, None], idx].add(weights)
    h = jax.nn.silu(jnp.einsum("th,ehi->tei", x, gate)) * jnp.einsum("th,ehi->tei", x, up)
    y = jnp.einsum("tei,eih->teh", h, down)
    return jnp.einsum("teh,te->th", y.astype(jnp.float32), combine).astype(x.dtype)


def moe_experts_grouped(
    x: jnp.ndarray,  # [T, H]
    weights: jnp.ndarray,  # f32[T, k]
    idx: jnp.ndarray,  # i32[T, k]
    gate: jnp.ndarray,  # [E, H, I]
    up: jnp.ndarray,  # [E, H, I]
    down: jnp.ndarray,  # [E, I, H]
    *,
    ragged: bool | None = None,
) -> jnp.ndarray:  # [T, H]
    """`moe_experts_dense`'s result with each token run through its k experts only.

    The T*k (token, expert) assignments are sorted by expert (stably, so each expert's rows keep
    token order), the tokens gathered in that order, each expert's contiguous run of rows put
    through its SwiGLU, the outputs weighted in fp32 and scatter-added back to their tokens
    (jax-llm-examples `deepseek_r1_jax/model.py`, `_moe_gmm`). Experts that receive no token
    cost nothing. `ragged` picks how the runs are multiplied: `jax.lax.ragged_dot` (True), or a
    loop over the experts that have rows (False, `_swiglu_expert_loop`); None takes ragged_dot
    on GPU/TPU, where it is a native grouped matmul, and the loop on CPU, where jax 0.10 lowers
    ragged_dot to a dense masked matmul over all E experts (E times the routed flops, and an
    [E, T*k, H] masked copy of the rows; `benchmarks/moe_bench.py` times it).
    """
    t, k = idx.shape
    flat = idx.reshape(-1)  # i32[T*k]
    order = jnp.argsort(flat, stable=True)  # i32[T*k]: assignments, grouped by expert
    group_sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)  # i32[E]
    tokens = order // k  # i32[T*k]: the token of each sorted assignment
    xs = x[tokens]  # [T*k, H]
    loop = functools.partial(_swiglu_expert_loop, block=_expert_block(t, k, gate.shape[0]))
    args = (xs, group_sizes, gate, up, down)
    if ragged is None:
        ys = jax.lax.platform_dependent(*args, cpu=loop, default=_swiglu_ragged)
    else:
        ys = (_swiglu_ragged if ragged else loop)(*args)
    ys = ys.astype(jnp.float32) * weights.reshape(-1)[order][:, None]  # f32[T*k, H]
    out = jnp.zeros((t, x.shape[1]), jnp.float32).at[tokens].add(ys)
    return out.astype(x.dtype)


def _swiglu_ragged(xs, group_sizes, gate, up, down):  # [M, H], i32[E], [E, H, I] x2, [E, I, H]
    """The grouped SwiGLU with `jax.lax.ragged_dot`: rows [sum(g[:e]), sum(g[:e+1])) of `xs`
    through expert e -> [M, H]."""
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, group_sizes))
    h = h * jax.lax.ragged_dot(xs, up, group_sizes)
    return jax.lax.ragged_dot(h, down, group_sizes)


def _expert_block(t: int, k: int, e: int) -> int:
    """Rows per matmul in `_swiglu_expert_loop`: the mean rows per expert (T*k/E) rounded up to
    a power of two, at most 128 and never more than T (a token picks an expert at most once, so
    no expert gets more than T rows). A block past an expert's last row is wasted work; a block
    smaller than its rows multiplies the same weights more times. Measured once, by hand, at
    V2-Lite expert shapes (E=64, top-6, fp32, on the shared 2-core CPU under load): T=32 (mean
    3) 690 / 808 / 968 ms with blocks of 2 / 4 / 8; T=64 (mean 6) 1.13-1.22 s for any block
    from 2 to 16; T=128 (mean 12) 811 / 720 / 952 ms with 8 / 16 / 32; T=512 (mean 48) 1.24 s
    with 64 against 1.70-1.86 s with 16, 32 or 128. The cap of 128 is not measured (no T tried
    had a mean above 64)."""
    mean = -(-t * k // e)
    return min(t, 128, 1 << (mean - 1).bit_length())


def _swiglu_expert_loop(xs, group_sizes, gate, up, down, *, block: int):  # as _swiglu_ragged
    """The grouped SwiGLU as loops: over the experts that have rows (in ascending order), and
    within one over its rows in blocks of `block`.

    XLA:CPU materialises any slice of a weight before a matmul reads it (a copy of H*I
    elements), so each expert's three matrices are sliced once, outside the block loop; an
    expert with no row is never sliced. The last block of an expert may run into the next
    expert's rows: those rows are written wrong here and rewritten when that expert's turn
    comes, since experts run in ascending order and each rewrites all of its rows; past the
    last row, `xs` is padded by one block. With bf16 weights XLA:CPU (which has no bf16 matmul)
    converts the whole loop-carried weight stack to fp32 on every call, so the loop then reads
    every expert and gains far less over the dense dispatch than in fp32
    (`benchmarks/results_moe.json`).
    """
    m, e = xs.shape[0], gate.shape[0]
    starts = jnp.cumsum(group_sizes) - group_sizes  # i32[E]: first sorted row of each expert
    active = jnp.nonzero(group_sizes, size=min(e, m), fill_value=0)[0]  # i32[min(E, M)]
    xp = jnp.pad(xs, ((0, block), (0, 0)))  # [M + block, H]

    def expert(j, out):
        ex = active[j]
        w_gate, w_up, w_down = gate[ex], up[ex], down[ex]

        def rows(b, out):
            r = starts[ex] + b * block
            xb = jax.lax.dynamic_slice_in_dim(xp, r, block)
            return jax.lax.dynamic_update_slice_in_dim(
                out, swiglu(xb, w_gate, w_up, w_down), r, axis=0
            )

        return jax.lax.fori_loop(0, -(-group_sizes[ex] // block), rows, out)

    out = jax.lax.fori_loop(0, jnp.count_nonzero(group_sizes), expert, jnp.zeros_like(xp))
    return out[:m]


def prefers_grouped(e: int, h: int, i: int) -> bool:
    """Whether the grouped dispatch is the faster for E experts of H x I (static shapes: the
    choice is made at trace time): from E*H*I = 2^16 up.

    Measured on this project's 2-core CPU, fp32 (`python -m benchmarks.moe_bench --crossover`,
    `benchmarks/results_moe.json`; three runs on the shared machine agree on the threshold):
    below 2^16 (the tiny test configs' 8 experts of 64 x 32 are 2^14) dense is up to 1.9x
    faster at T = 16 tokens and within 25% either way at T = 1, while grouped is 1.3-2.6x faster
    at T = 256 unless E/k is small (E=8, k=6: dense 1.2x faster); from 2^16 up grouped wins at
    every T measured: 1.15-2.8x at 2^16-2^18, 3.3-7x at 2^21, 3.6-6.3x at V2-Lite's 64 x 2048 x
    1408 (T = 1-512). T and k are left out: below 2^16 grouped wins only at large T, by under a
    millisecond, and compiles about twice as long (0.5-1.9 s against 0.2-0.9 s per shape,
    measured once), which a test suite of tiny models pays at every shape it traces. On GPU/TPU
    (ragged_dot) the crossover is not measured; this rule stands in for it.
    """
    return e * h * i >= 1 << 16


def moe_experts(
    x: jnp.ndarray,  # [T, H]
    weights: jnp.ndarray,  # f32[T, k]
    idx: jnp.ndarray,  # i32[T, k]
    gate: jnp.ndarray,  # [E, H, I]
    up: jnp.ndarray,  # [E, H, I]
    down: jnp.ndarray,  # [E, I, H]
    *,
    dispatch: MoEDispatch = MoEDispatch.AUTO,
) -> jnp.ndarray:  # [T, H]
    """Weighted sum of the chosen experts' SwiGLU outputs: the one seam the model calls, dense
    or grouped as `dispatch` says (AUTO: as `prefers_grouped` says for these shapes)."""
    if dispatch is MoEDispatch.AUTO:
        grouped = prefers_grouped(*gate.shape)
    else:
        grouped = dispatch is MoEDispatch.GROUPED
    with jax.named_scope("moe_grouped" if grouped else "moe_dense"):
        run = moe_experts_grouped if grouped else moe_experts_dense
        return run(x, weights, idx, gate, up, down)


@functools.lru_cache(maxsize=32)
def _inv_freq(config) -> np.ndarray:
    return config.rope_inv_freq()


# ---- modules ---------------------------------------------------------------------------------
# Parameters are created as zeros/ones: models are always built abstractly (nnx.eval_shape) and
# filled from a checkpoint by `leyline_jax.loader`, never trained from this initialisation.
class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, dtype):
        self.kernel = nnx.Param(jnp.zeros((din, dout), dtype))  # [in, out]

    def __call__(self, x):
        return x @ self.kernel[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


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
        q_pe = rope.apply_rope(q_pe, positions, _inv_freq(c), c.rope_scale, heads_axis=True)
        return q_nope, q_pe

    def latent(self, x, positions):
        """[T, H], i32[T] -> c_kv [T, R] (normalised), k_pe [T, Dr] (embedded): the cached pair."""
        c = self.config
        kv = self.kv_a_proj(x)
        c_kv = self.kv_a_norm(kv[..., : c.kv_lora_rank])
        k_pe = rope.apply_rope(kv[..., c.kv_lora_rank :], positions, _inv_freq(c), c.rope_scale)
        return c_kv, k_pe

    def kv_up(self):
        """w_kb [N, Dn, R], w_vb [N, R, Dv]: the up-projections of the latent."""
        return self.k_up[...], self.v_up[...]

    def output(self, o):
        """[T, N, Dv] -> [T, H]."""
        return self.o_proj(o.reshape(*o.shape[:-2], -1))

    def paged(self, x, positions, pools: kv.KVPools, layer: int, slots, meta):
        """Attention over the paged cache, absorbed form: [T, H] new tokens of a ragged batch
        (`leyline_jax.paged`) -> ([T, H], pools). Writes the new tokens' latent and `k_pe` to
        `slots` of layer `layer`, then attends with queries multiplied into the latent space,
        reading `c_kv` and `k_pe` in place; `meta`: (kv_lens, page_indices, cu_q_lens,
        num_rows) as `ragged_paged_attention` takes them."""
        q_nope, q_pe = self.queries(x, positions)
        c_new, k_new = self.latent(x, positions)
        pools = kv.write_kv(pools, layer, slots, c_new, k_new)
        w_kb, w_vb = self.kv_up()
        out = ragged_paged_attention(
            absorb_queries(q_nope, w_kb),
            q_pe,
            pools.moved[layer],  # this layer's own arrays: read in place
            pools.rotated[layer],
            *meta,
            scale=self.config.softmax_scale,
            kv_dtype=pools.moved_dtype,
            k_pe_dtype=pools.rotated_dtype,
            impl=pools.kernel_impl(None),
        )
        return self.output(expand_values(out.astype(x.dtype), w_vb)), pools

    def probe(self, x, positions, pools: kv.KVPools, layer: int, ctx_slots, mask):
        """Attention of [T, H] tokens already cached (their KV is among `ctx_slots`) over a
        sequence's cached slots i32[S] (bool[T, S] `mask`), read from layer `layer`'s pools and
        written nowhere: ([T, H], f32[T, S] each query's attention per slot, summed over heads).
        Absorbed form,
        as the paged step attends."""
        q_nope, q_pe = self.queries(x, positions)
        c = kv.gather_slots(pools, layer, ctx_slots)
        w_kb, w_vb = self.kv_up()
        o, mass = mla_attention(
            q_nope,
            q_pe,
            *c,
            w_kb,
            w_vb,
            mask,
            self.config.softmax_scale,
            absorbed=True,
            mass=True,
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


class MLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, dtype):
        self.gate_proj = Linear(hidden, inter, dtype)
        self.up_proj = Linear(hidden, inter, dtype)
        self.down_proj = Linear(inter, hidden, dtype)

    def __call__(self, x):
        return swiglu(
            x, self.gate_proj.kernel[...], self.up_proj.kernel[...], self.down_proj.kernel[...]
        )


class Router(nnx.Module):
    def __init__(self, config: MLAConfig):
        self.config = config
        e = config.n_routed_experts
        # the router stays float32 whatever the model dtype (as the reference keeps it)
        self.weight = nnx.Param(jnp.zeros((config.hidden_size, e), jnp.float32))  # f32[H, E]
        if config.router == ROUTER_SIGMOID_GROUPED:
            self.bias = nnx.Param(jnp.zeros((e,), jnp.float32))  # e_score_correction_bias
        else:
            self.bias = None

    def __call__(self, x):
        bias = None if self.bias is None else self.bias[...]
        return route(x, self.weight[...], bias, self.config)


class Experts(nnx.Module):
    def __init__(self, config: MLAConfig, dtype):
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = nnx.Param(jnp.zeros((e, h, i), dtype))  # [E, H, I]
        self.up = nnx.Param(jnp.zeros((e, h, i), dtype))  # [E, H, I]
        self.down = nnx.Param(jnp.zeros((e, i, h), dtype))  # [E, I, H]
        # static (part of the graph definition): changing it retraces
        self.moe_dispatch = MoEDispatch.AUTO

    def __call__(self, x, weights, idx):
        gate, up, down = self.gate[...], self.up[...], self.down[...]
        return moe_experts(x, weights, idx, gate, up, down, dispatch=self.moe_dispatch)


class MoE(nnx.Module):
    def __init__(self, config: MLAConfig, dtype):
        self.router = Router(config)
        self.experts = Experts(config, dtype)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared = MLP(config.hidden_size, shared, dtype) if shared else None

    def __call__(self, x):  # [..., H] -> [..., H]
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = self.router(flat)
        out = self.experts(flat, weights, idx)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(x.shape)


class DecoderLayer(nnx.Module):
    def __init__(self, config, layer: int, dtype):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = config.attention(dtype)  # the family's attention module
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_sparse(layer):
            self.mlp = MoE(config, dtype)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype)

    def feed_forward(self, h):
        """The post-attention half of the block: h + mlp(norm(h))."""
        return h + self.mlp(self.post_attention_norm(h))

    def __call__(self, h, positions):
        h = h + self.attn(self.input_norm(h), positions)
        return self.feed_forward(h)


class CausalLM(nnx.Module):
    """A causal LM of any attention family (`config`: `MLAConfig` or `leyline_jax.gqa.GQAConfig`).
    `model(tokens)` is the full-sequence forward: i32[T] -> f32[T, vocab].

    Build one with `leyline_jax.load_model` (from a Hugging Face checkpoint or a GGUF file) or
    `leyline_jax.loader.model_from_params`.
    """

    def __init__(self, config, dtype=jnp.float32):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed = nnx.Param(jnp.zeros((config.vocab_size, config.hidden_size), dtype))  # [V, H]
        self.layers = nnx.List(
            [DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)]
        )
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # tied embeddings reuse `embed` as the LM head
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, dtype)
        )

    def embed_tokens(self, tokens):
        return jnp.take(self.embed[...], tokens, axis=0)

    def logits(self, h):
        """[..., H] (after the final norm) -> f32[..., V]."""
        if self.lm_head is None:
            out = h @ self.embed[...].T
        else:
            out = self.lm_head(h)
        return out.astype(jnp.float32)

    def forward(self, tokens, positions):
        """Traceable full-sequence forward: i32[T], i32[T] -> f32[T, V]."""
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, positions)
        return self.logits(self.final_norm(h))

    def __call__(self, tokens) -> jnp.ndarray:
        """Full-sequence forward of one sequence from position 0, jitted: i32[T] -> f32[T, vocab].

        Raises ValueError for a token array that is not 1-D, empty, or holds ids outside
        [0, vocab_size).
        """
        tokens = jnp.asarray(check_tokens(tokens, self.config.vocab_size))
        graphdef, state = nnx.split(self)
        return _forward_jit(graphdef, state, tokens)


# the name the MLA families' code and users have used since the first release
MLAModel = CausalLM


@functools.partial(jax.jit, static_argnums=0)
def _forward_jit(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    return model.forward(tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32))
