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

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from leyline_jax.config import MLAConfig, check_tokens
from leyline_jax.gqa import GQAAttention, GQAConfig
from leyline_jax.layers import MLP, Linear, RMSNorm, matmul
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
            out = matmul(h, self.embed[...].T)
        else:
            out = self.lm_head(h)
        return out.astype(jnp.float32)

    def __call__(self, tokens) -> jnp.ndarray:
        """Full-sequence forward of one sequence from position 0: i32[T] -> f32[T, vocab], run
        as `Split` says (one program, or one per end and one per kind of layer).

        Raises ValueError for a token array that is not 1-D, empty, or holds ids outside
        [0, vocab_size).
        """
        tokens = jnp.asarray(check_tokens(tokens, self.config.vocab_size))
        graph = Split.of(self)
        positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        if graph.fused:
            return _whole_forward(*graph.whole, tokens, positions)
        h = graph.embed(tokens)
        for layer in graph.layers:
            h = _layer_forward(*layer, h, positions)
        return graph.run(_logits, h)


# A model of at most this many layers runs a step as one program (embedding, layers, logits):
# it compiles one program per shape where layer by layer would compile three or four, and
# makes no dispatch per layer. Deeper models run layer by layer (`Split`).
FUSED_LAYERS = 4


class Ends(nnx.Module):
    """A model's two ends, sharing its variables (no copy): the embedding, and the final norm
    with the LM head. What a program runs before and after the layers."""

    def __init__(self, model: CausalLM):
        self.config, self.embed = model.config, model.embed
        self.final_norm, self.lm_head = model.final_norm, model.lm_head

    embed_tokens = CausalLM.embed_tokens
    logits = CausalLM.logits


class _Graph:
    """A module's graphdef and its params' treedef, as a jitted program's static argument,
    hashed once: jit hashes static arguments on every call, and hashing a layer's graphdef
    walks the whole graph (about 0.3 ms: 10 ms of a 30-layer step). The params travel as a
    flat list of arrays (no nnx flattening per call)."""

    __slots__ = ("graphdef", "treedef", "_hash")

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        return isinstance(other, _Graph) and (self.graphdef, self.treedef) == (
            other.graphdef,
            other.treedef,
        )

    @classmethod
    def split(cls, module, graphs: dict) -> tuple:
        """(graph, leaves) of `module`; `graphs` keeps one graph per kind of module."""
        graphdef, params = nnx.split(module)
        leaves, treedef = jax.tree.flatten(params)
        graph = cls(graphdef, treedef)
        return graphs.setdefault(graph, graph), leaves


def merge(graph: _Graph, leaves):
    """The module of a `Split` pair, inside a program."""
    return nnx.merge(graph.graphdef, jax.tree.unflatten(graph.treedef, leaves))


def merge_whole(graphs, params) -> tuple:
    """(ends, layers), the modules of `Split.whole` inside a program."""
    (ends_graph, layer_graphs), (ends_params, layer_params) = graphs, params
    layers = [merge(g, p) for g, p in zip(layer_graphs, layer_params, strict=True)]
    return merge(ends_graph, ends_params), layers


@dataclasses.dataclass(frozen=True)
class Split:
    """A model as the programs run it: its ends and each layer as pairs (graph, params), for
    `merge`. Layers of one kind (dense, MoE) share one graph, so one compiled program serves
    every layer of that kind: what a program costs to trace and compile does not grow with
    depth. Running layer by layer costs a dispatch per layer (`leyline_jax.paged`'s docstring
    has the measurements), so a model of at most `FUSED_LAYERS` layers runs as one program
    (`fused`, `whole`). Make one with `Split.of(model)` and keep it while the params stay as
    they are."""

    ends: tuple  # (graph, leaves) of `Ends`
    layers: tuple  # one (graph, leaves) per layer

    @classmethod
    def of(cls, model: CausalLM) -> Split:
        graphs: dict = {}  # one _Graph per kind of layer
        layers = tuple(_Graph.split(layer, graphs) for layer in model.layers)
        return cls(_Graph.split(Ends(model), graphs), layers)

    @property
    def fused(self) -> bool:
        """Whether a step runs as one program (`whole`) rather than layer by layer."""
        return len(self.layers) <= FUSED_LAYERS

    @property
    def whole(self) -> tuple:
        """(graphs, params) of the whole model, a program's first two arguments for
        `merge_whole`."""
        graphs = (self.ends[0], tuple(g for g, _ in self.layers))
        return graphs, (self.ends[1], tuple(p for _, p in self.layers))

    def run(self, program, *args):
        """`program(graph, params, *args)` over the ends."""
        return program(*self.ends, *args)

    def embed(self, tokens):
        """i32[T] -> [T, H], the embedding's program."""
        return embed_step(*self.ends, tokens)


@functools.partial(jax.jit, static_argnums=0)
def embed_step(graph, params, tokens):
    return merge(graph, params).embed_tokens(tokens)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graph, params, h):
    ends = merge(graph, params)
    return ends.logits(ends.final_norm(h))


@functools.partial(jax.jit, static_argnums=0)
def _layer_forward(graph, params, h, positions):
    return merge(graph, params)(h, positions)


@functools.partial(jax.jit, static_argnums=0)
def _whole_forward(graphs, params, tokens, positions):
    ends, layers = merge_whole(graphs, params)
    h = ends.embed_tokens(tokens)
    for layer in layers:
        h = layer(h, positions)
    return ends.logits(ends.final_norm(h))


def compile_counts() -> dict[str, int]:
    """How many shapes the embedding's and the full forward's programs have compiled."""
    forward = _layer_forward._cache_size() + _logits._cache_size() + _whole_forward._cache_size()
    return {"embed": embed_step._cache_size(), "forward": forward}
