"""The Flax (NNX) decoder `CausalLM`, shared by every attention family.

A decoder (embedding, layers of attention + MLP/MoE, final norm, LM head) takes its attention
module from its config's family (`ATTENTION`: MLA in `leyline_jax.mla`, GQA in
`leyline_jax.gqa`), and that module answers two calls: `attn(x, positions)`, causal
self-attention over one whole sequence, and `attn.paged(x, positions, pools, layer, slots,
meta)`, the same over the paged cache (it writes its layer's bands and attends through
`pallas_kernels.ragged_paged_attention`). The MLP is dense or a mixture of experts
(`leyline_jax.moe`), as the config says per layer.

Dtype policy, as the reference: parameters and activations in the model dtype; RMSNorm
statistics, RoPE, softmax, the router and the logits in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from leyline_jax.config import MLAConfig, check_tokens
from leyline_jax.gqa import GQAAttention, GQAConfig
from leyline_jax.layers import MLP, Linear, RMSNorm
from leyline_jax.mla import MLAAttention
from leyline_jax.moe import MoE

# each family's attention module, by its config's type: the one place a family is named
ATTENTION = {MLAConfig: MLAAttention, GQAConfig: GQAAttention}


class DecoderLayer(nnx.Module):
    def __init__(self, config, layer: int, dtype):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = ATTENTION[type(config)](config, dtype)
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
        h, v = config.hidden_size, config.vocab_size
        self.embed = nnx.Param(jnp.zeros((v, h), dtype))  # [V, H]
        self.layers = nnx.List(
            [DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)]
        )
        self.final_norm = RMSNorm(h, config.rms_norm_eps, dtype)
        # tied embeddings reuse `embed` as the LM head
        self.lm_head = None if config.tie_word_embeddings else Linear(h, v, dtype)

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
