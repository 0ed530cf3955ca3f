"""`MLAConfig`: one frozen configuration for the MLA families that transformers ships.

Built from a Hugging Face `config.json` of `deepseek_v2`, `deepseek_v3` (also Moonlight/Kimi-style
checkpoints) or `glm4_moe_lite` (GLM-4.7-Flash), read by `leyline_jax.hf_config`. The semantics
follow the transformers reference modeling code for each family; a field the model cannot honour
raises `ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from leyline_jax import rope
from leyline_jax.hf_config import (
    FAMILIES,
    ROUTER_SIGMOID_GROUPED,
    ROUTERS,
    ConfigError,
    is_int,
    mla_fields,
    read_hf_config,
)


@dataclasses.dataclass(frozen=True)
class Bands:
    """What an attention family caches per token and layer, named by what a splice does: the
    shape of the band it moves bit-exact and of the band it moves and rotates by RoPE. The last
    axis is one row's width; a leading axis, when there is one, holds one row per KV head. Each
    row of the rotated band is in the halves layout (`leyline_jax.rope`)."""

    moved: tuple[int, ...]
    rotated: tuple[int, ...]


def check_ids(values, limit: int, what: str, *, allow_empty: bool = False) -> np.ndarray:
    """Integer ids checked on the host: a 1-D sequence or array of integers (bools, floats and
    strings are refused, not coerced) in [0, limit). Returns them as i32[n] (numpy). Raises
    ValueError naming the first bad one (`what`: "token id", "page id", ...)."""
    if isinstance(values, (list, tuple)):
        for v in values:
            if not is_int(v):
                raise ValueError(f"{what} {v!r} is not an integer")
            if not 0 <= v < limit:
                raise ValueError(f"{what} {v} is outside [0, {limit})")
        arr = np.asarray(values, np.int64).reshape(len(values))
    else:
        arr = np.asarray(values)
        if arr.ndim != 1:
            raise ValueError(f"{what}s must be a 1-D array, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{what}s must be integers, got dtype {arr.dtype}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= limit:
                raise ValueError(f"{what} {lo if lo < 0 else hi} is outside [0, {limit})")
    if arr.size == 0 and not allow_empty:
        raise ValueError(f"a non-empty 1-D array of {what}s is needed")
    return arr.astype(np.int32)


def check_tokens(tokens, vocab_size: int, *, allow_empty: bool = False) -> np.ndarray:
    """Token ids checked on the host (see `check_ids`): i32[T] in the vocabulary."""
    return check_ids(tokens, vocab_size, "token id", allow_empty=allow_empty)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    # transformers `yarn_get_mscale` / `get_mscale`
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Static description of an MLA decoder. Derived quantities are properties.

    RoPE layout: the checkpoint's `rope_interleave` says how its rope band pairs dimensions
    (True: pairs (2i, 2i+1), as DeepSeek trains them; False: pairs (i, i + Dr/2)). The loader
    permutes weights so that, inside this package, the rope band is always in the halves layout;
    one rotation code path serves every family.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # RoPE
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    rope_interleave: bool = True
    rope_factor: float | None = None
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None  # explicit override, as transformers allows
    rope_truncate: bool = True
    # MLP / MoE
    mlp_layer_types: tuple[str, ...] = ()  # per layer: "dense" | "sparse"
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    router: str = ROUTER_SIGMOID_GROUPED
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    # tensors the reference ignores: multi-token-prediction layers after the last decoder layer
    num_mtp_layers: int = 0

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ConfigError(f"model_type={self.model_type!r} is not one of {FAMILIES}")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted(set(self.mlp_layer_types) - {"dense", "sparse"})
        if bad:
            raise ConfigError(f"mlp_layer_types: unknown layer types {bad}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError(f"rope type {self.rope_type!r} is not supported (default, yarn)")
        if self.rope_type == "yarn" and self.rope_original_max_position_embeddings is None:
            raise ConfigError("yarn RoPE needs original_max_position_embeddings")
        if self.router not in ROUTERS:
            raise ConfigError(f"router={self.router!r} is not one of {ROUTERS}")
        if self.has_moe:
            for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"{name} must be positive when a layer is sparse")
            if self.n_routed_experts % self.n_group:
                raise ConfigError(
                    f"n_routed_experts={self.n_routed_experts} is not divisible by "
                    f"n_group={self.n_group}"
                )
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group={self.topk_group} must be in [1, n_group]")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError("num_experts_per_tok exceeds n_routed_experts")
            if self.router == ROUTER_SIGMOID_GROUPED and self.n_routed_experts // self.n_group < 2:
                raise ConfigError("sigmoid grouped routing needs at least 2 experts per group")

    # ---- derived ---------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_moe(self) -> bool:
        return "sparse" in self.mlp_layer_types

    def is_sparse(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @property
    def yarn_factor(self) -> float:
        if self.rope_factor is not None:
            return float(self.rope_factor)
        # transformers: a missing factor is max_position_embeddings / original
        return self.max_position_embeddings / self.rope_original_max_position_embeddings

    @property
    def rope_scale(self) -> float:
        """YaRN attention factor multiplied into cos/sin (so it is baked into cached k_pe)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.rope_attention_factor is not None:
            return float(self.rope_attention_factor)
        factor, mscale, all_dim = self.yarn_factor, self.rope_mscale, self.rope_mscale_all_dim
        if mscale and all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
        return _yarn_mscale(factor)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (as HF)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type == "yarn" and self.rope_mscale_all_dim:
            m = _yarn_mscale(self.yarn_factor, self.rope_mscale_all_dim)
            scale *= m * m
        return scale

    # ---- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MLAConfig:
        d = dict(d)
        d["mlp_layer_types"] = tuple(d["mlp_layer_types"])
        return cls(**d)

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> MLAConfig:
        """From a Hugging Face `config.json`: a checkpoint directory, the file, or its dict."""
        return cls(**mla_fields(read_hf_config(path_or_dict)))

    # ---- the attention family's seam: what the model, the pools and the splice ask ----------
    def kv_bands(self) -> Bands:
        """MLA caches the normalised latent (moved) and the rope band `k_pe` (rotated)."""
        return Bands(moved=(self.kv_lora_rank,), rotated=(self.qk_rope_head_dim,))

    def rope_inv_freq(self) -> np.ndarray:
        """f32[width / 2]: the inverse frequencies of one row of the rotated band."""
        if self.rope_type != "yarn":
            return rope.inv_freq(self.qk_rope_head_dim, self.rope_theta)
        yarn = dict(yarn_factor=self.yarn_factor, beta_fast=self.rope_beta_fast)
        yarn |= dict(beta_slow=self.rope_beta_slow, truncate=self.rope_truncate)
        yarn["original_max"] = self.rope_original_max_position_embeddings
        return rope.inv_freq(self.qk_rope_head_dim, self.rope_theta, **yarn)
