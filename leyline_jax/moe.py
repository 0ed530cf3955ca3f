"""Mixture of experts: the router (`route`, each family's rule), the routed experts' dispatch
(`moe_experts`: dense or grouped, chosen by shape at trace time) and the `MoE` block (router,
experts, shared experts).

`moe_experts` is the one seam: dense (every expert on every token: exact, shape-static, the
test oracle, and the faster for tiny experts) or grouped (the T*k assignments sorted by expert,
each expert multiplying only its own rows, outputs weighted in fp32 and scattered back:
`jax.lax.ragged_dot` on GPU/TPU, a loop over the experts on CPU). The router is float32, as
the reference keeps it.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from leyline_jax.config import MLAConfig
from leyline_jax.hf_config import (
    ROUTER_SIGMOID_GROUPED,
    ROUTER_SOFTMAX_GREEDY,
    ROUTER_SOFTMAX_GROUP_LIMITED,
)
from leyline_jax.layers import MLP, swiglu


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
    else:  # ROUTER_SIGMOID_GROUPED (MLAConfig validates the router name)
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias if bias is not None else scores
        top2, _ = jax.lax.top_k(choice.reshape(t, groups, per_group), 2)
        choice = jnp.where(group_mask(top2.sum(-1)), choice, -jnp.inf)
        _, idx = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * config.routed_scaling_factor, idx


class MoEDispatch(enum.Enum):
    """How the routed experts run (`Experts.moe_dispatch`; set it on a whole model with
    `model.set_attributes(moe_dispatch=MoEDispatch.DENSE)`)."""

    AUTO = "auto"  # by shape, at trace time: `prefers_grouped`
    DENSE = "dense"  # every expert on every token: the oracle, and the cheaper one for tiny E*H*I
    GROUPED = "grouped"  # each token through its k experts only


def moe_experts_dense(x, weights, idx, gate, up, down) -> jnp.ndarray:  # shapes as in `moe_experts`
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
    x, weights, idx, gate, up, down, *, ragged: bool | None = None
) -> jnp.ndarray:  # shapes as in `moe_experts`
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
    mean = (t * k + e - 1) // e  # rows per expert, rounded up
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

        return jax.lax.fori_loop(0, (group_sizes[ex] + block - 1) // block, rows, out)

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
