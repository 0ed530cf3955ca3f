"""The grouped-query attention (GQA) family: Llama-style decoders (SmolLM2, Llama 2/3 layouts).

One module holds the family: its config (`GQAConfig`, from a `LlamaForCausalLM` `config.json`
or a GGUF file's metadata), its attention module (`GQAAttention`: q/k/v/o projections,
`num_key_value_heads` KV heads, RoPE on the whole head dimension), its Hugging Face tensor table
and converter. The decoder around it (RMSNorm, SwiGLU MLP, tied or separate LM head) is the
shared `leyline_jax.model.CausalLM`; the paged state, the ragged step, the splice kernel and the
directives are the same as MLA's, asked through the seam (`kv_bands`, `rope_inv_freq`; the
decoder takes this family's attention module from `leyline_jax.model.ATTENTION`).

Bands. In GQA all of K carries position: a splice moves V unchanged and moves and rotates K.
Each cached slot holds `[G, Dh]` of each (G KV heads, one row per head, each row of K in the
halves layout that Hugging Face's `rotate_half` uses), so the splice kernel rotates K row by row
with the head's own inverse frequencies.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from leyline_jax import kv_pools as kv
from leyline_jax import rope
from leyline_jax.config import Bands
from leyline_jax.hf_config import ConfigError, integer, read_hf_config, real
from leyline_jax.layers import HFLeaves, Linear, hf_shapes, mlp_shapes
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

MODEL_TYPES = ("llama",)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GQAConfig:
    """Static description of a Llama-style GQA decoder (fields as in `LlamaConfig`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type={self.model_type!r} is not one of {MODEL_TYPES}")
        for name in (f.name for f in dataclasses.fields(self) if f.type == "int"):  # the sizes
            v = getattr(self, name)
            integer(name, v)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE pairs dimensions)")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ConfigError("rope_theta and rms_norm_eps must be positive")

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def is_sparse(self, layer: int) -> bool:
        return False  # dense SwiGLU MLPs only

    # ---- the attention family's seam -------------------------------------------------------
    def kv_bands(self) -> Bands:
        """GQA caches V (moved) and K (rotated), one row per KV head."""
        shape = (self.num_key_value_heads, self.head_dim)
        return Bands(moved=shape, rotated=shape)

    def rope_inv_freq(self) -> np.ndarray:
        """f32[head_dim / 2]: the inverse frequencies of one row (one head) of K: RoPE on the
        whole head, no scaling."""
        return rope.inv_freq(self.head_dim, self.rope_theta)

    # ---- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GQAConfig:
        return cls(**dict(d))

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> GQAConfig:
        """From a `LlamaForCausalLM` `config.json` (directory, file or dict). Fields the model
        cannot honour (biases, RoPE scaling, a sliding window) raise `ConfigError` naming them."""
        hf = read_hf_config(path_or_dict)
        if not isinstance(hf, Mapping):
            raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        if not isinstance(hf.get("model_type"), str) or hf["model_type"] not in MODEL_TYPES:
            raise ConfigError(f"model_type {hf.get('model_type')!r} is not one of {MODEL_TYPES}")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ConfigError(f"{key}=true is not supported")
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if not isinstance(scaling, Mapping):
            raise ConfigError(f"rope_scaling={scaling!r} must be a JSON object")
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"rope_scaling type {kind!r} is not supported (default RoPE only)")
        theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported (silu only)")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise ConfigError("pretraining_tp != 1 is not supported")
        missing = [k for k in _REQUIRED if hf.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks {missing[0]!r}")
        n, h = integer("num_attention_heads", hf["num_attention_heads"]), hf["hidden_size"]
        tie = hf.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ConfigError(f"tie_word_embeddings={tie!r} must be true or false")
        return cls(
            model_type=hf["model_type"],
            vocab_size=hf["vocab_size"],
            hidden_size=integer("hidden_size", h),
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=n,
            num_key_value_heads=hf.get("num_key_value_heads") or n,
            head_dim=hf.get("head_dim") or h // n,
            rms_norm_eps=real("rms_norm_eps", hf.get("rms_norm_eps", 1e-6), positive=True),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=tie,
            rope_theta=real("rope_theta", theta, positive=True),
        )


def gqa_attention(q, k, v, mask, scale: float, *, mass: bool = False):
    """[T, N, D] queries over [S, G, D] keys and values (query head n reads KV head
    n // (N / G)); bool[T, S] mask -> [T, N, D]. Scores and softmax in fp32. With `mass=True`
    also returns f32[T, S], each query's attention per slot summed over heads."""
    t, n, d = q.shape
    g = k.shape[1]
    qg = q.reshape(t, g, n // g, d)
    s = jnp.einsum("tgnd,sgd->gnts", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[None, None], s, -jnp.inf)
    p32 = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("gnts,sgd->tgnd", p32.astype(v.dtype), v).reshape(t, n, d)
    return (out, p32.sum((0, 1))) if mass else out


class GQAAttention(nnx.Module):
    def __init__(self, config: GQAConfig, dtype):
        c = config
        self.config = c
        n, g, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, n * d, dtype)
        self.k_proj = Linear(c.hidden_size, g * d, dtype)
        self.v_proj = Linear(c.hidden_size, g * d, dtype)
        self.o_proj = Linear(n * d, c.hidden_size, dtype)

    def qkv(self, x, positions):
        """[T, H], i32[T] -> q [T, N, D], k [T, G, D] (both position embedded), v [T, G, D]."""
        c = self.config
        t, inv = x.shape[0], c.rope_inv_freq()
        q = self.q_proj(x).reshape(t, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).reshape(t, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(t, c.num_key_value_heads, c.head_dim)
        q = rope.apply_rope(q, positions, inv, 1.0, heads_axis=True)
        k = rope.apply_rope(k, positions, inv, 1.0, heads_axis=True)
        return q, k, v

    def cached(self, x, positions):
        """[T, H], i32[T] -> what the cache holds for these tokens: (V, K) [T, G, D] (the
        moved band, the rotated one)."""
        _, k, v = self.qkv(x, positions)
        return v, k

    def output(self, o):
        """[T, N, D] -> [T, H]."""
        return self.o_proj(o.reshape(*o.shape[:-2], -1))

    def paged(self, x, positions, pools: kv.KVPools, layer: int, slots, meta):
        """Attention over the paged cache (same contract as `MLAAttention.paged`): writes the new
        tokens' V (moved band) and K (rotated band) to `slots` of layer `layer`, then attends
        through `ragged_paged_attention`'s grouped form."""
        q, k, v = self.qkv(x, positions)
        pools = kv.write_kv(pools, layer, slots, v, k)
        out = ragged_paged_attention(
            None,
            q,
            pools.moved[layer],
            pools.rotated[layer],
            *meta,
            scale=self.config.softmax_scale,
            kv_dtype=pools.moved_dtype,
            k_pe_dtype=pools.rotated_dtype,
            impl=pools.kernel_impl(None),
        )
        return self.output(out.astype(x.dtype)), pools

    def probe(self, x, positions, pools: kv.KVPools, layer: int, ctx_slots, mask):
        """Attention of cached tokens over a sequence's cached slots, writing nothing (same
        contract as `MLAAttention.probe`)."""
        q, _, _ = self.qkv(x, positions)
        v, k = kv.gather_slots(pools, layer, ctx_slots)
        o, mass = gqa_attention(q, k, v, mask, self.config.softmax_scale, mass=True)
        return self.output(o.astype(x.dtype)), mass

    def __call__(self, x, positions):
        """Causal self-attention over one whole sequence: [T, H], i32[T] -> [T, H]."""
        q, k, v = self.qkv(x, positions)
        t = x.shape[0]
        o = gqa_attention(q, k, v, jnp.tril(jnp.ones((t, t), bool)), self.config.softmax_scale)
        return self.output(o)


# ---- Hugging Face checkpoints ------------------------------------------------------------------
def hf_tensor_shapes(config: GQAConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a `LlamaForCausalLM` checkpoint of this config holds (`[out, in]`)."""
    c = config
    h, n, g, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def layer(p: str, i: int) -> dict[str, tuple[int, ...]]:
        q, kv = (n * d, h), (g * d, h)
        attn = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": (h, n * d)}
        shapes = {f"{p}.self_attn.{k}.weight": s for k, s in attn.items()}
        return shapes | mlp_shapes(f"{p}.mlp", h, c.intermediate_size)

    return hf_shapes(c, layer)


class _Leaves(HFLeaves):
    def attention(self, a: str) -> dict:
        return {k: self.linear(f"{a}.{k}.weight") for k in ("q_proj", "k_proj", "v_proj", "o_proj")}


def lazy_hf_params(
    config: GQAConfig, tensors: Mapping[str, Any], dtype=jnp.float32
) -> dict[str, Any]:
    """Lazily: flat mapping of `LlamaForCausalLM` tensors (names and shapes already checked by
    the loader) -> nested params of `CausalLM`, each leaf a zero-argument callable
    (`leyline_jax.layers.HFLeaves`). Hugging Face's q/k rows are already in the halves layout
    (`rotate_half`)."""
    return _Leaves(config, tensors, dtype).params()
