"""Hugging Face checkpoint (or GGUF file) -> `CausalLM`.

Per family, one table names every tensor a checkpoint holds and its shape, and one pure
converter maps a flat dict of those tensors to our params; `hf_tensor_shapes(config)` and
`convert_hf_params` dispatch to them by the config's type (MLA's live here, GQA's in
`leyline_jax.gqa`; `_FAMILIES` is the one registry: adding a family is a module and a line
there). The converter checks names and shapes against the table first. The loader, the parity
tests and the tiny checkpoint writer all go through them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from leyline_jax import gqa, rope
from leyline_jax.config import (
    FAMILIES as MLA_MODEL_TYPES,
)
from leyline_jax.config import (
    ROUTER_SIGMOID_GROUPED,
    ConfigError,
    MLAConfig,
    read_hf_config,
)
from leyline_jax.model import CausalLM

# Above this many bytes of tensors the loader shows a progress bar (unless told otherwise).
PROGRESS_BYTES = 256 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, unexpected or mis-shaped tensors, bad files."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory or one of its files does not exist."""


def _mla_tensor_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face MLA checkpoint of this config holds, with its on-disk shape.

    Linear weights are `[out, in]` as torch stores them; experts are one tensor per expert.
    """
    c = config
    n, h = c.num_attention_heads, c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)

    def mlp(prefix: str, inter: int):
        shapes[f"{prefix}.gate_proj.weight"] = (inter, h)
        shapes[f"{prefix}.up_proj.weight"] = (inter, h)
        shapes[f"{prefix}.down_proj.weight"] = (h, inter)

    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        a = f"{p}.self_attn"
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
        if c.is_sparse(i):
            shapes[f"{p}.mlp.gate.weight"] = (c.n_routed_experts, h)
            if c.router == ROUTER_SIGMOID_GROUPED:
                shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (c.n_routed_experts,)
            for e in range(c.n_routed_experts):
                mlp(f"{p}.mlp.experts.{e}", c.moe_intermediate_size)
            if c.n_shared_experts:
                mlp(f"{p}.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
        else:
            mlp(f"{p}.mlp", c.intermediate_size)
    return shapes


def _ignored(config, name: str) -> bool:
    """What the reference ignores on load: multi-token-prediction layers after the last layer;
    and an lm_head stored beside tied embeddings (the reference re-ties it to the embedding)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        i, n = int(m.group(1)), config.num_hidden_layers
        return n <= i < n + getattr(config, "num_mtp_layers", 0)
    return config.tie_word_embeddings and name == "lm_head.weight"


def _check_names_and_shapes(config, tensors: Mapping[str, Any]) -> None:
    expected = hf_tensor_shapes(config)
    present = {k for k in tensors if not _ignored(config, k)}
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s), e.g. {missing[:5]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {unexpected[:5]}")
    if problems:
        raise CheckpointError(f"{config.model_type} checkpoint: " + "; ".join(problems))
    for name, shape in expected.items():
        got = tuple(np.shape(tensors[name]))
        if got != shape:
            raise CheckpointError(f"tensor {name} has shape {got}, expected {shape}")


def _mla_convert(config: MLAConfig, tensors: Mapping[str, Any], dtype) -> dict[str, Any]:
    """MLA: transposes linear weights to `[in, out]`, splits `kv_b_proj` into head-major `k_up`
    `[N, Dn, R]` and `v_up` `[N, R, Dv]`, stacks experts, permutes interleaved rope rows to
    the halves layout, casts to `dtype` (the router and its bias stay float32)."""
    c = config
    n, dr = c.num_attention_heads, c.qk_rope_head_dim
    perm = rope.deinterleave_perm(dr) if c.rope_interleave else np.arange(dr)

    def get(name, out_dtype=dtype):
        return np.asarray(tensors[name]).astype(out_dtype)

    def linear(name):  # [out, in] -> [in, out]
        return get(name).T

    def q_rows(w):  # [N*Dqk, in]: permute each head's rope rows
        w = w.reshape(n, c.qk_head_dim, -1)
        w = np.concatenate([w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :][:, perm]], 1)
        return w.reshape(n * c.qk_head_dim, -1)

    def mlp(prefix):
        return {
            "gate_proj": {"kernel": linear(f"{prefix}.gate_proj.weight")},
            "up_proj": {"kernel": linear(f"{prefix}.up_proj.weight")},
            "down_proj": {"kernel": linear(f"{prefix}.down_proj.weight")},
        }

    layers = {}
    for i in range(c.num_hidden_layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        attn: dict[str, Any] = {}
        if c.q_lora_rank is None:
            attn["q_proj"] = {"kernel": q_rows(get(f"{a}.q_proj.weight")).T}
        else:
            attn["q_a_proj"] = {"kernel": linear(f"{a}.q_a_proj.weight")}
            attn["q_a_norm"] = {"weight": get(f"{a}.q_a_layernorm.weight")}
            attn["q_b_proj"] = {"kernel": q_rows(get(f"{a}.q_b_proj.weight")).T}
        kv_a = get(f"{a}.kv_a_proj_with_mqa.weight")
        kv_a = np.concatenate([kv_a[: c.kv_lora_rank], kv_a[c.kv_lora_rank :][perm]], 0)
        attn["kv_a_proj"] = {"kernel": kv_a.T}
        attn["kv_a_norm"] = {"weight": get(f"{a}.kv_a_layernorm.weight")}
        kv_b = get(f"{a}.kv_b_proj.weight").reshape(  # [N * (Dn + Dv), R] -> [N, Dn + Dv, R]
            c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
        )
        attn["k_up"] = kv_b[:, : c.qk_nope_head_dim]  # [N, Dn, R]
        attn["v_up"] = kv_b[:, c.qk_nope_head_dim :].transpose(0, 2, 1)  # [N, R, Dv]
        attn["o_proj"] = {"kernel": linear(f"{a}.o_proj.weight")}
        layer: dict[str, Any] = {
            "input_norm": {"weight": get(f"{p}.input_layernorm.weight")},
            "post_attention_norm": {"weight": get(f"{p}.post_attention_layernorm.weight")},
            "attn": attn,
        }
        if c.is_sparse(i):
            ex = [f"{p}.mlp.experts.{e}" for e in range(c.n_routed_experts)]
            moe: dict[str, Any] = {
                "router": {"weight": get(f"{p}.mlp.gate.weight", np.float32).T},
                "experts": {
                    "gate": np.stack([linear(f"{e}.gate_proj.weight") for e in ex]),
                    "up": np.stack([linear(f"{e}.up_proj.weight") for e in ex]),
                    "down": np.stack([linear(f"{e}.down_proj.weight") for e in ex]),
                },
            }
            if c.router == ROUTER_SIGMOID_GROUPED:
                moe["router"]["bias"] = get(f"{p}.mlp.gate.e_score_correction_bias", np.float32)
            if c.n_shared_experts:
                moe["shared"] = mlp(f"{p}.mlp.shared_experts")
            layer["mlp"] = moe
        else:
            layer["mlp"] = mlp(f"{p}.mlp")
        layers[i] = layer

    params: dict[str, Any] = {
        "embed": get("model.embed_tokens.weight"),
        "layers": layers,
        "final_norm": {"weight": get("model.norm.weight")},
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = {"kernel": linear("lm_head.weight")}
    return params


# model_type -> (config class, tensor table, converter): the one place a family is registered
_FAMILIES = {
    **{t: (MLAConfig, _mla_tensor_shapes, _mla_convert) for t in MLA_MODEL_TYPES},
    **{t: (gqa.GQAConfig, gqa.hf_tensor_shapes, gqa.convert_hf_params) for t in gqa.MODEL_TYPES},
}


def _family(model_type):
    if model_type not in _FAMILIES:
        raise ConfigError(f"unknown model_type {model_type!r}: supported are {sorted(_FAMILIES)}")
    return _FAMILIES[model_type]


def config_from_hf(path_or_dict):
    """The config of any supported family from a Hugging Face `config.json` (directory, file or
    dict): `MLAConfig` or `leyline_jax.gqa.GQAConfig`, by its `model_type`."""
    hf = read_hf_config(path_or_dict)
    return _family(hf.get("model_type"))[0].from_hf(hf)


def config_from_dict(d: Mapping[str, Any]):
    """Inverse of `config.to_dict()` for any family."""
    return _family(d.get("model_type"))[0].from_dict(d)


def hf_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this config holds, with its on-disk shape
    (linear weights `[out, in]` as torch stores them)."""
    return _family(config.model_type)[1](config)


def convert_hf_params(config, tensors: Mapping[str, Any], dtype=jnp.float32) -> dict[str, Any]:
    """Pure: flat dict of HF tensors (numpy-convertible) -> nested params of `CausalLM`, by the
    family's converter. Raises `CheckpointError` naming the tensor for any missing, unexpected
    or mis-shaped tensor, before converting anything."""
    _check_names_and_shapes(config, tensors)
    return _family(config.model_type)[2](config, tensors, dtype)


def model_from_params(config, params: Mapping[str, Any], dtype=jnp.float32) -> CausalLM:
    """Build a `CausalLM` around a nested params dict (as `convert_hf_params` returns)."""
    abstract = nnx.eval_shape(lambda: CausalLM(config, dtype))
    graphdef, state = nnx.split(abstract)
    expected = nnx.to_pure_dict(state)
    flat_expected = dict(jax.tree_util.tree_leaves_with_path(expected))
    flat_given = dict(jax.tree_util.tree_leaves_with_path(params))
    if set(flat_expected) != set(flat_given):
        missing = sorted(map(jax.tree_util.keystr, set(flat_expected) - set(flat_given)))
        extra = sorted(map(jax.tree_util.keystr, set(flat_given) - set(flat_expected)))
        raise CheckpointError(
            f"params do not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for path, want in flat_expected.items():
        got = flat_given[path]
        if tuple(np.shape(got)) != tuple(want.shape):
            raise CheckpointError(
                f"param {jax.tree_util.keystr(path)} has shape {tuple(np.shape(got))}, "
                f"expected {tuple(want.shape)}"
            )
    arrays = jax.tree.map(lambda want, got: jnp.asarray(got, want.dtype), expected, params)
    nnx.replace_by_pure_dict(state, arrays)
    return nnx.merge(graphdef, state)


def read_safetensors(path: str | os.PathLike, *, progress: bool | None = None) -> dict[str, Any]:
    """All tensors of a checkpoint directory (`model.safetensors` or a sharded index) as numpy."""
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e!r}") from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"{index} is not a valid safetensors index: weight_map must map tensor names "
                "to shard file names (strings)"
            )
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(os.path.join(path, fname), []).append(name)
    elif os.path.isfile(single):
        files = {single: []}  # empty: every tensor in the file
    else:
        raise CheckpointNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {path}"
        )
    for fname in files:
        if not os.path.isfile(fname):
            raise CheckpointNotFoundError(f"checkpoint shard {fname} does not exist")

    total = sum(os.path.getsize(f) for f in files)
    show = total > PROGRESS_BYTES if progress is None else progress
    tensors: dict[str, Any] = {}
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading tensors")
    try:
        for fname, names in files.items():
            with safe_open(fname, framework="numpy") as f:
                keys = list(f.keys())
                for name in names:
                    if name not in keys:
                        raise CheckpointError(f"index maps {name} to {fname}, which lacks it")
                for name in names or keys:
                    tensors[name] = f.get_tensor(name)
            if bar is not None:
                bar.update(os.path.getsize(fname))
    except SafetensorError as e:
        raise CheckpointError(f"cannot read {fname}: {e}") from e
    finally:
        if bar is not None:
            bar.close()
    return tensors


def load_model(
    path: str | os.PathLike, dtype=jnp.float32, *, progress: bool | None = None
) -> CausalLM:
    """Load a checkpoint into a `CausalLM`: a Hugging Face directory of any supported family
    (MLA: deepseek_v2, deepseek_v3, glm4_moe_lite; GQA: llama), or a `.gguf` file of the llama
    architecture (`leyline_jax.gguf`: dequantized, its Q/K rows un-permuted).

    Reads `config.json` and `model.safetensors` (or a sharded `model.safetensors.index.json`),
    converts names, layouts and dtype. Any problem raises before a model exists: `ConfigError`
    for an unknown family or unsupported field, `CheckpointNotFoundError` for missing files,
    `CheckpointError` for missing/unexpected/mis-shaped tensors or unreadable files.
    """
    path = os.fspath(path)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"GGUF file {path} does not exist")
        from leyline_jax import gguf

        try:
            hf, tensors = gguf.read_gguf(path)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(str(e)) from e
        except ValueError as e:  # not a GGUF, another architecture, missing tensors
            raise CheckpointError(str(e)) from e
        config = config_from_hf(hf)
    else:
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
        try:
            config = config_from_hf(path)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(str(e)) from e
        tensors = read_safetensors(path, progress=progress)
    params = convert_hf_params(config, tensors, dtype)
    return model_from_params(config, params, dtype)


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "config_from_dict",
    "config_from_hf",
    "convert_hf_params",
    "hf_tensor_shapes",
    "load_model",
    "model_from_params",
    "read_safetensors",
]
