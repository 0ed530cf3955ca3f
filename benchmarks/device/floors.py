"""Count before timing: the flops and bytes a prefill or a decode step of an MLA model must
spend, from its config alone (what any implementation pays, not what ours happens to do).

Weights are counted by how a token uses them: the `body` (attention, dense MLPs, shared experts,
routers, norms) runs for every token; of a sparse layer's E routed experts a token runs k; the
LM head runs once per sampled position; the embedding is a lookup (one row per token). Bytes
are every weight a step touches, read once, plus the KV cache it reads or writes (bf16 `c_kv`,
fp32 `k_pe`, as the paged state stores them). Experts touched by n tokens: the expectation under
uniform routing, E (1 - (1 - k/E)^n) — the random router of the benchmark spreads tokens about
so; a trained router's skew would touch fewer.
"""

from __future__ import annotations

import dataclasses

from benchmarks.paged_bench import attention_flops
from leyline_jax.config import MLAConfig
from leyline_jax.hf_config import ROUTER_SIGMOID_GROUPED


@dataclasses.dataclass(frozen=True)
class Params:
    body: int  # run by every token
    expert: int  # one routed expert (gate, up, down)
    sparse_layers: int
    head: int  # the LM head (the embedding itself when tied)
    embed: int  # the embedding table (a row per token read)
    total: int  # every parameter the model holds, each counted once

    @classmethod
    def of(cls, c: MLAConfig) -> Params:
        h, n, r = c.hidden_size, c.num_attention_heads, c.kv_lora_rank
        if c.q_lora_rank is None:
            q = h * n * c.qk_head_dim
        else:
            q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * c.qk_head_dim
        attn = (
            q
            + h * (r + c.qk_rope_head_dim)  # kv_a_proj
            + r  # kv_a_norm
            + n * r * (c.qk_nope_head_dim + c.v_head_dim)  # the latent's up-projections
            + n * c.v_head_dim * h  # o_proj
            + 2 * h  # the layer's two norms
        )
        body = c.num_hidden_layers * attn + h  # + the final norm
        sparse = sum(c.is_sparse(i) for i in range(c.num_hidden_layers))
        bias = c.n_routed_experts if c.router == ROUTER_SIGMOID_GROUPED else 0  # the router's
        router = h * c.n_routed_experts + bias
        shared = 3 * h * c.moe_intermediate_size * c.n_shared_experts
        dense_mlp = 3 * h * c.intermediate_size
        body += sparse * (router + shared) + (c.num_hidden_layers - sparse) * dense_mlp
        expert = 3 * h * c.moe_intermediate_size
        embed = head = c.vocab_size * h
        routed = sparse * c.n_routed_experts * expert
        total = body + routed + embed + (0 if c.tie_word_embeddings else head)
        return cls(body, expert, sparse, head, embed, total)


def experts_touched(c: MLAConfig, tokens: int) -> float:
    """Expected distinct routed experts per sparse layer that `tokens` tokens run (uniform)."""
    e, k = c.n_routed_experts, c.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens) if e else 0.0


def kv_bytes_per_token(c: MLAConfig) -> int:
    """Cache bytes of one token over all layers: bf16 `c_kv` + fp32 `k_pe`."""
    return c.num_hidden_layers * (c.kv_lora_rank * 2 + c.qk_rope_head_dim * 4)


def _weight_bytes(c: MLAConfig, p: Params, tokens: int, wbytes: int) -> float:
    experts = p.sparse_layers * experts_touched(c, tokens) * p.expert
    return wbytes * (p.body + experts + p.head + tokens * c.hidden_size)


def prefill_cost(c: MLAConfig, t: int, wbytes: int = 2) -> tuple[float, float]:
    """(flops, bytes) of prefilling t tokens from an empty cache, logits at the last one only."""
    p = Params.of(c)
    active = p.body + p.sparse_layers * c.num_experts_per_tok * p.expert
    flops = 2 * t * active + 2 * p.head + attention_flops(c, t, t)
    return flops, _weight_bytes(c, p, t, wbytes) + t * kv_bytes_per_token(c)


def decode_cost(c: MLAConfig, batch: int, context: int, wbytes: int = 2) -> tuple[float, float]:
    """(flops, bytes) of one decode step of `batch` sequences each holding `context` tokens."""
    p = Params.of(c)
    active = p.body + p.sparse_layers * c.num_experts_per_tok * p.expert + p.head
    flops = 2 * batch * active + batch * attention_flops(c, 1, context + 1)
    kv = batch * (context + 1) * kv_bytes_per_token(c)
    return flops, _weight_bytes(c, p, batch, wbytes) + kv


def floor_s(cost: tuple[float, float], flop_s: float, bytes_s: float) -> float:
    """The least time of work costing (flops, bytes) on a machine with these rates."""
    return max(cost[0] / flop_s, cost[1] / bytes_s)
