"""`MLAConfig`: one frozen configuration for the MLA families that transformers ships.

Built from a Hugging Face `config.json` of `deepseek_v2`, `deepseek_v3` (also Moonlight/Kimi-style
checkpoints) or `glm4_moe_lite` (GLM-4.7-Flash). The semantics follow the transformers reference
modeling code for each family; a field the model cannot honour raises `ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from leyline_jax import rope

FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")

# Routing rules, one per family behaviour (see `leyline_jax.model.route`).
ROUTER_SOFTMAX_GREEDY = "softmax_greedy"  # deepseek_v2, topk_method="greedy"
ROUTER_SOFTMAX_GROUP_LIMITED = "softmax_group_limited"  # deepseek_v2, "group_limited_greedy"
ROUTER_SIGMOID_GROUPED = "sigmoid_grouped"  # deepseek_v3 / glm4_moe_lite (noaux_tc)
ROUTERS = (ROUTER_SOFTMAX_GREEDY, ROUTER_SOFTMAX_GROUP_LIMITED, ROUTER_SIGMOID_GROUPED)


class ConfigError(ValueError):
    """A configuration the model cannot honour (unknown family, unsupported field value)."""


@dataclasses.dataclass(frozen=True)
class Bands:
    """What an attention family caches per token and layer, named by what a splice does: the
    shape of the band it moves bit-exact and of the band it moves and rotates by RoPE. The last
    axis is one row's width; a leading axis, when there is one, holds one row per KV head. Each
    row of the rotated band is in the halves layout (`leyline_jax.rope`)."""

    moved: tuple[int, ...]
    rotated: tuple[int, ...]


def read_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face `config.json` as a dict: from a checkpoint directory, the file, or a dict."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigError(
            f"a config is a path or a JSON object (a mapping), got {type(path_or_dict)}"
        )
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_ids(values, limit: int, what: str, *, allow_empty: bool = False) -> np.ndarray:
    """Integer ids checked on the host: a 1-D sequence or array of integers (bools, floats and
    strings are refused, not coerced) in [0, limit). Returns them as i32[n] (numpy). Raises
    ValueError naming the first bad one (`what`: "token id", "page id", ...)."""
    if isinstance(values, (list, tuple)):
        for v in values:
            if not _is_int(v):
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
        factor = self.yarn_factor
        if self.rope_mscale and self.rope_mscale_all_dim:
            return _yarn_mscale(factor, self.rope_mscale) / _yarn_mscale(
                factor, self.rope_mscale_all_dim
            )
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
        return _from_hf_dict(read_hf_config(path_or_dict))

    # ---- the attention family's seam: what the model, the pools and the splice ask ----------
    def kv_bands(self) -> Bands:
        """MLA caches the normalised latent (moved) and the rope band `k_pe` (rotated)."""
        return Bands(moved=(self.kv_lora_rank,), rotated=(self.qk_rope_head_dim,))

    def rope_inv_freq(self) -> np.ndarray:
        """f32[width / 2]: the inverse frequencies of one row of the rotated band."""
        return rope.inv_freq(self)


# Where a config.json omits a field, transformers uses its config class default, and those
# differ between families (e.g. routed_scaling_factor 1.0 / 2.5 / 1.8). Same defaults here.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        routed_scaling_factor=1.0,
        n_group=None,
        topk_group=None,
        first_k_dense_replace=0,
        n_shared_experts=2,
        n_routed_experts=64,
        moe_intermediate_size=1407,
        num_experts_per_tok=None,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        topk_method="greedy",
        norm_topk_prob=False,
    ),
    "deepseek_v3": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        n_shared_experts=1,
        n_routed_experts=256,
        moe_intermediate_size=2048,
        num_experts_per_tok=8,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        norm_topk_prob=True,
        rope_interleave=True,
    ),
    "glm4_moe_lite": dict(
        rms_norm_eps=1e-5,
        max_position_embeddings=202752,
        routed_scaling_factor=1.8,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        n_routed_experts=64,
        moe_intermediate_size=1536,
        num_experts_per_tok=4,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        norm_topk_prob=True,
        rope_interleave=True,
    ),
}


def _integer(key: str, value, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"{key}={value!r} must be an integer >= {minimum}")
    return int(value)


def _real(key: str, value, *, positive: bool = False) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{key}={value!r} must be a finite number{' > 0' if positive else ''}")
    return float(value)


def _optional_real(key: str, value) -> float | None:
    return None if value is None else _real(key, value)


class _HF:
    """A `config.json` being read: its family, its values over the family's defaults (an
    explicit null stays null, as in transformers), and the checks that name a field."""

    def __init__(self, hf):
        if not isinstance(hf, Mapping):
            raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        self.family = hf.get("model_type")
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown model_type {self.family!r}: supported are {FAMILIES}")
        self.d = {**_FAMILY_DEFAULTS[self.family], **hf}

    def get(self, key, default=None):
        return self.d.get(key, default)

    def need(self, key, minimum=1) -> int:
        if self.d.get(key) is None:
            raise ConfigError(f"{self.family} config.json is missing {key!r}")
        return _integer(key, self.d[key], minimum)

    def count(self, key, default, minimum=0) -> int:  # an integer where null / 0 is `default`
        return _integer(key, self.d.get(key) or default, minimum)

    def refuse(self, key, ok, why) -> None:
        if self.d.get(key) is not None and not ok(self.d[key]):
            raise ConfigError(f"{key}={self.d[key]!r} is not supported: {why}")


def _from_hf_dict(hf) -> MLAConfig:
    r = _HF(hf)
    r.refuse("hidden_act", lambda v: v == "silu", "only SiLU MLPs are implemented")
    r.refuse(
        "attention_bias", lambda v: v is False, "MLA projections with bias are not implemented"
    )
    r.refuse("mlp_bias", lambda v: v is False, "MLPs with bias are not implemented")
    r.refuse(
        "moe_layer_freq",
        lambda v: v == 1,
        "the reference places a MoE block on every layer from first_k_dense_replace on",
    )
    r.refuse(
        "pretraining_tp", lambda v: v == 1, "tensor-parallel pretraining splits are not modelled"
    )
    r.refuse("partial_rotary_factor", lambda v: v == 1 or v == 1.0, "partial RoPE is not modelled")
    layers = r.need("num_hidden_layers")
    q_lora = r.get("q_lora_rank")
    return MLAConfig(
        model_type=r.family,
        vocab_size=r.need("vocab_size"),
        hidden_size=r.need("hidden_size"),
        num_hidden_layers=layers,
        num_attention_heads=r.need("num_attention_heads"),
        intermediate_size=r.need("intermediate_size"),
        kv_lora_rank=r.need("kv_lora_rank"),
        qk_nope_head_dim=r.need("qk_nope_head_dim"),
        qk_rope_head_dim=r.need("qk_rope_head_dim"),
        v_head_dim=r.need("v_head_dim"),
        q_lora_rank=None if q_lora is None else _integer("q_lora_rank", q_lora, 1),
        rms_norm_eps=_real("rms_norm_eps", r.get("rms_norm_eps", 1e-6), positive=True),
        max_position_embeddings=_integer(
            "max_position_embeddings", r.get("max_position_embeddings", 4096), 1
        ),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        # V2 applies RoPE on complex views of interleaved pairs; V3/GLM honour rope_interleave
        rope_interleave=r.family == "deepseek_v2" or bool(r.get("rope_interleave", True)),
        mlp_layer_types=_layer_types(r, layers),
        moe_intermediate_size=r.count("moe_intermediate_size", 0),
        n_routed_experts=r.count("n_routed_experts", 0),
        n_shared_experts=r.count("n_shared_experts", 0),
        num_experts_per_tok=r.count("num_experts_per_tok", 0),
        routed_scaling_factor=_real(
            "routed_scaling_factor", r.get("routed_scaling_factor", 1.0), positive=True
        ),
        num_mtp_layers=_mtp_layers(r),
        **_routing(r),
        **_rope(r),
    )


def _rope(r: _HF) -> dict[str, Any]:
    """RoPE's fields: new-style `rope_parameters`, or old-style `rope_theta` + `rope_scaling`."""
    for key in ("rope_parameters", "rope_scaling"):
        if r.get(key) is not None and not isinstance(r.get(key), Mapping):
            raise ConfigError(f"{key}={r.get(key)!r} must be a JSON object")
    rope = dict(r.get("rope_parameters") or {})
    for k, v in (r.get("rope_scaling") or {}).items():
        rope.setdefault(k, v)
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError("rope_parameters nested per layer type are not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope_type={rope_type!r} is not supported (default, yarn)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("rope_parameters.partial_rotary_factor != 1 is not supported")
    if r.get("rope_theta") is not None:  # checked even where rope_parameters overrides it
        _real("rope_theta", r.get("rope_theta"), positive=True)
    theta = rope.get("rope_theta", r.get("rope_theta", 10000.0))
    out = {"rope_theta": _real("rope_theta", theta, positive=True), "rope_type": rope_type}
    if rope_type != "yarn":
        return out
    omax = r.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings", r.get("max_position_embeddings")
    )
    factor = rope.get("factor")
    return out | dict(
        rope_factor=None if factor is None else _real("rope factor", factor, positive=True),
        rope_original_max_position_embeddings=_integer("original_max_position_embeddings", omax, 1),
        rope_beta_fast=_real("beta_fast", rope.get("beta_fast") or 32),
        rope_beta_slow=_real("beta_slow", rope.get("beta_slow") or 1),
        rope_mscale=_optional_real("mscale", rope.get("mscale")),
        rope_mscale_all_dim=_optional_real("mscale_all_dim", rope.get("mscale_all_dim")),
        rope_attention_factor=_optional_real("attention_factor", rope.get("attention_factor")),
        rope_truncate=bool(rope.get("truncate", True)),
    )


def _layer_types(r: _HF, layers: int) -> tuple[str, ...]:
    if r.family == "glm4_moe_lite":
        return tuple(r.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1))
    k = r.count("first_k_dense_replace", 0)
    return tuple(["dense"] * min(k, layers) + ["sparse"] * max(layers - k, 0))


def _routing(r: _HF) -> dict[str, Any]:
    """The router's rule and groups: V2's softmax (greedy or group-limited), V3/GLM's sigmoid."""
    groups = dict(n_group=r.count("n_group", 1, 1), topk_group=r.count("topk_group", 1, 1))
    if r.family != "deepseek_v2":
        r.refuse("scoring_func", lambda v: v == "sigmoid", f"{r.family} routes with sigmoid scores")
        r.refuse("topk_method", lambda v: v == "noaux_tc", f"{r.family} routes with noaux_tc")
        norm = bool(r.get("norm_topk_prob"))
        return dict(router=ROUTER_SIGMOID_GROUPED, norm_topk_prob=norm, **groups)
    method = r.get("topk_method") or "greedy"
    routers = {
        "greedy": ROUTER_SOFTMAX_GREEDY,
        "group_limited_greedy": ROUTER_SOFTMAX_GROUP_LIMITED,
    }
    if method not in routers:
        raise ConfigError(
            f"topk_method={method!r} is not supported for deepseek_v2 "
            "(greedy, group_limited_greedy)"
        )
    r.refuse(
        "norm_topk_prob",
        lambda v: v is False,
        "the deepseek_v2 reference never normalises top-k weights",
    )
    return dict(router=routers[method], norm_topk_prob=False, **groups)


def _mtp_layers(r: _HF) -> int:
    if r.family == "deepseek_v3":
        mtp = r.get("num_nextn_predict_layers", r.get("num_mtp_layers", 1))
        return _integer("num_nextn_predict_layers", mtp or 0, 0)
    if r.family == "glm4_moe_lite":
        return _integer("num_nextn_predict_layers", r.get("num_nextn_predict_layers", 1) or 0, 0)
    return 0
