"""Reading a Hugging Face `config.json` of an MLA family into `MLAConfig`'s fields.

A field the file omits takes the family's transformers default (`_FAMILY_DEFAULTS`); a field
the model cannot honour raises `ConfigError` naming it. `leyline_jax.config` builds the config
from `mla_fields`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")

# Routing rules, one per family behaviour (see `leyline_jax.moe.route`).
ROUTER_SOFTMAX_GREEDY = "softmax_greedy"  # deepseek_v2, topk_method="greedy"
ROUTER_SOFTMAX_GROUP_LIMITED = "softmax_group_limited"  # deepseek_v2, "group_limited_greedy"
ROUTER_SIGMOID_GROUPED = "sigmoid_grouped"  # deepseek_v3 / glm4_moe_lite (noaux_tc)
ROUTERS = (ROUTER_SOFTMAX_GREEDY, ROUTER_SOFTMAX_GROUP_LIMITED, ROUTER_SIGMOID_GROUPED)


class ConfigError(ValueError):
    """A configuration the model cannot honour (unknown family, unsupported field value)."""


def is_int(v) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


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
    with open(path, encoding="utf-8") as f:
        try:
            hf = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(hf).__name__}")
    return hf


# Where a config.json omits a field, transformers uses its config class default, and those
# differ between families (e.g. routed_scaling_factor 1.0 / 2.5 / 1.8). Same defaults here, in
# the order of FAMILIES (deepseek_v2, deepseek_v3, glm4_moe_lite); _ABSENT: the class has none.
_ABSENT = object()
_DEFAULTS: dict[str, tuple[Any, Any, Any]] = {
    "rms_norm_eps": (1e-6, 1e-6, 1e-5),
    "max_position_embeddings": (2048, 4096, 202752),
    "routed_scaling_factor": (1.0, 2.5, 1.8),
    "n_group": (None, 8, 1),
    "topk_group": (None, 4, 1),
    "first_k_dense_replace": (0, 3, _ABSENT),
    "n_shared_experts": (2, 1, 1),
    "n_routed_experts": (64, 256, 64),
    "moe_intermediate_size": (1407, 2048, 1536),
    "num_experts_per_tok": (None, 8, 4),
    "q_lora_rank": (1536, 1536, 768),
    "kv_lora_rank": (512, 512, 512),
    "qk_nope_head_dim": (128, 128, 192),
    "qk_rope_head_dim": (64, 64, 64),
    "v_head_dim": (128, 128, 256),
    "topk_method": ("greedy", _ABSENT, _ABSENT),
    "norm_topk_prob": (False, True, True),
    "rope_interleave": (_ABSENT, True, True),
}
_FAMILY_DEFAULTS = {
    family: {k: v[i] for k, v in _DEFAULTS.items() if v[i] is not _ABSENT}
    for i, family in enumerate(FAMILIES)
}


# the largest size or count a config may give (a larger one is a mistake, not a model)
MAX_SIZE = 2**31 - 1


def integer(key: str, value, minimum: int = 1) -> int:
    """`value`, an integer in [minimum, MAX_SIZE] (nothing coerced), else ConfigError."""
    if not is_int(value) or not minimum <= value <= MAX_SIZE:
        shown = value if not is_int(value) or abs(int(value)) < 2**63 else "a huge integer"
        raise ConfigError(f"{key}={shown!r} must be an integer in [{minimum}, {MAX_SIZE}]")
    return int(value)


def real(key: str, value, *, positive: bool = False) -> float:
    """`value`, a finite number (> 0 when `positive`; nothing coerced), else ConfigError."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok and is_int(value) and abs(value) > MAX_SIZE:
        ok = False  # math.isfinite of a huge int overflows
    if not ok or not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{key}={value!r} must be a finite number{' > 0' if positive else ''}")
    return float(value)


def _optional_real(key: str, value) -> float | None:
    return None if value is None else real(key, value)


class _HF:
    """A `config.json` being read: its family, its values over the family's defaults (an
    explicit null stays null, as in transformers), and the checks that name a field."""

    def __init__(self, hf):
        if not isinstance(hf, Mapping):
            raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        self.family = hf.get("model_type")
        if not isinstance(self.family, str) or self.family not in FAMILIES:
            raise ConfigError(f"unknown model_type {self.family!r}: supported are {FAMILIES}")
        self.d = {**_FAMILY_DEFAULTS[self.family], **hf}

    def get(self, key, default=None):
        return self.d.get(key, default)

    def need(self, key, minimum=1) -> int:
        if self.d.get(key) is None:
            raise ConfigError(f"{self.family} config.json is missing {key!r}")
        return integer(key, self.d[key], minimum)

    def count(self, key, default, minimum=0) -> int:  # an integer where null / 0 is `default`
        return integer(key, self.d.get(key) or default, minimum)

    def refuse(self, key, ok, why) -> None:
        if self.d.get(key) is not None and not ok(self.d[key]):
            raise ConfigError(f"{key}={self.d[key]!r} is not supported: {why}")


def mla_fields(hf) -> dict[str, Any]:
    """`MLAConfig`'s fields from a `config.json` dict."""
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
    return dict(
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
        q_lora_rank=None if q_lora is None else integer("q_lora_rank", q_lora, 1),
        rms_norm_eps=real("rms_norm_eps", r.get("rms_norm_eps", 1e-6), positive=True),
        max_position_embeddings=integer(
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
        routed_scaling_factor=real(
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
        real("rope_theta", r.get("rope_theta"), positive=True)
    theta = rope.get("rope_theta", r.get("rope_theta", 10000.0))
    out = {"rope_theta": real("rope_theta", theta, positive=True), "rope_type": rope_type}
    if rope_type != "yarn":
        return out
    omax = r.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings", r.get("max_position_embeddings")
    )
    factor = rope.get("factor")
    return out | dict(
        rope_factor=None if factor is None else real("rope factor", factor, positive=True),
        rope_original_max_position_embeddings=integer("original_max_position_embeddings", omax, 1),
        rope_beta_fast=real("beta_fast", rope.get("beta_fast") or 32),
        rope_beta_slow=real("beta_slow", rope.get("beta_slow") or 1),
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
        return integer("num_nextn_predict_layers", mtp or 0, 0)
    if r.family == "glm4_moe_lite":
        return integer("num_nextn_predict_layers", r.get("num_nextn_predict_layers", 1) or 0, 0)
    return 0
