"""Hugging Face checkpoint (or GGUF file) -> `CausalLM`, streamed one param at a time.

Per family, one table names every tensor a checkpoint holds and its shape, and one converter
maps a flat mapping of those tensors to our params (`hf_tensor_shapes` and `lazy_hf_params` in
`leyline_jax.mla` and `leyline_jax.gqa`); `_FAMILIES` is the one registry: adding a family is a
module and a line there. A converter returns lazy leaves: each is a zero-argument callable that
reads only the tensors its param needs and builds it. `convert_hf_params` builds them all
(pure, eager: the parity tests and the tiny checkpoint writer use it); `load_model` builds,
places and drops them one at a time from safetensors files read on demand
(`leyline_jax.safetensors`), so the host never holds the checkpoint, only what is placed plus
the param being built. Names and shapes are checked against the table before anything is read.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from leyline_jax import gqa, mla
from leyline_jax.config import MLAConfig
from leyline_jax.hf_config import FAMILIES as MLA_MODEL_TYPES
from leyline_jax.hf_config import ConfigError, read_hf_config
from leyline_jax.layers import contiguous
from leyline_jax.model import CausalLM
from leyline_jax.safetensors import (
    CheckpointError,
    CheckpointNotFoundError,
    Safetensors,
    progress_bar,
)
from leyline_jax.sharding import key_path


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


# model_type -> (config class, tensor table, lazy converter): the one place a family is registered
_FAMILIES = {
    **{t: (MLAConfig, mla.hf_tensor_shapes, mla.lazy_hf_params) for t in MLA_MODEL_TYPES},
    **{t: (gqa.GQAConfig, gqa.hf_tensor_shapes, gqa.lazy_hf_params) for t in gqa.MODEL_TYPES},
}


def _family(model_type):
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
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


def _lazy_hf_params(config, tensors: Mapping[str, Any], dtype) -> dict[str, Any]:
    _check_names_and_shapes(config, tensors)
    return _family(config.model_type)[2](config, tensors, dtype)


def _build_all(tree: Mapping[Any, Any]) -> dict[Any, Any]:
    return {k: _build_all(v) if isinstance(v, Mapping) else v() for k, v in tree.items()}


def convert_hf_params(config, tensors: Mapping[str, Any], dtype=jnp.float32) -> dict[str, Any]:
    """Pure: flat dict of HF tensors (numpy-convertible) -> nested params of `CausalLM`, by the
    family's converter, every param built now (fresh arrays: none aliases an input). Raises
    `CheckpointError` naming the tensor for any missing, unexpected or mis-shaped tensor,
    before converting anything."""
    return _build_all(_lazy_hf_params(config, tensors, dtype))


def _check_param_shape(path, got, want) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(
            f"param {jax.tree_util.keystr(path)} has shape {tuple(got)}, expected {tuple(want)}"
        )


def _place(leaf, want: jax.ShapeDtypeStruct, path, mesh) -> jax.Array:
    """One param on its device(s), built first if `leaf` is lazy. `jax.device_put` copies (on
    CPU too; `jnp.asarray` would hold a second host copy); blocking until the copy is done lets
    the host array go on return rather than a queue of them pile up behind transfers."""
    value = leaf() if callable(leaf) else leaf
    if isinstance(value, jax.Array):  # already on a device (orbax restores): cast it there
        value = jnp.asarray(value, want.dtype)
    else:  # contiguous here, so the strided original is freed before jax copies this one
        value = contiguous(np.asarray(value, want.dtype))
    _check_param_shape(path, np.shape(value), want.shape)
    # no mesh: the default device, uncommitted (as `jnp.asarray` places)
    sharding = None if mesh is None else mesh.param_sharding(key_path(path), tuple(value.shape))
    return jax.device_put(value, sharding).block_until_ready()


def _build_model(config, params: Mapping[str, Any], dtype, *, mesh, progress) -> CausalLM:
    if mesh is not None and not callable(getattr(mesh, "param_sharding", None)):
        raise ValueError(
            f"mesh must be a leyline_jax.sharding.MeshConfig (or have param_sharding), got {mesh!r}"
        )
    abstract = nnx.eval_shape(lambda: CausalLM(config, dtype))
    graphdef, state = nnx.split(abstract)
    expected, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    given = dict(jax.tree_util.tree_leaves_with_path(params))
    want_paths = {path for path, _ in expected}
    if want_paths != set(given):
        missing = sorted(map(jax.tree_util.keystr, want_paths - set(given)))
        extra = sorted(map(jax.tree_util.keystr, set(given) - want_paths))
        raise CheckpointError(
            f"params do not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for path, want in expected:  # given arrays: every shape checked before anything is placed
        if not callable(given[path]):
            _check_param_shape(path, np.shape(given[path]), want.shape)
    total = sum(want.size * want.dtype.itemsize for _, want in expected)
    placed = []
    with progress_bar(total, progress) as advance:
        for path, want in expected:
            placed.append(_place(given.pop(path), want, path, mesh))
            # jax lets go of a host buffer it copied from only when Python's collector runs
            # (a `gc.callbacks` hook); a young-generation pass frees this param's host copy now
            gc.collect(0)
            advance(want.size * want.dtype.itemsize)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, placed))
    return nnx.merge(graphdef, state)


def model_from_params(
    config, params: Mapping[str, Any], dtype=jnp.float32, *, mesh=None
) -> CausalLM:
    """Build a `CausalLM` around a nested params dict: arrays (as `convert_hf_params` returns)
    or zero-argument callables that build one (a family converter's lazy leaves), evaluated,
    checked and placed one param at a time.

    `mesh`: None places every param on the default device; otherwise any object with
    `param_sharding(path, shape) -> jax.sharding.Sharding` (`leyline_jax.sharding.MeshConfig`),
    asked once per param with its key path in the params dict, every key a string
    (`("layers", "3", "mlp", "experts", "gate")`, `("embed",)`), and its shape.
    Raises `CheckpointError` for params that do not match the model's names or shapes (given
    arrays are all checked before anything is placed; a lazy leaf when it is built).
    """
    return _build_model(config, params, dtype, mesh=mesh, progress=False)


def load_model(
    path: str | os.PathLike, dtype=jnp.float32, *, progress: bool | None = None, mesh=None
) -> CausalLM:
    """Load a checkpoint into a `CausalLM`: a Hugging Face directory of any supported family
    (MLA: deepseek_v2, deepseek_v3, glm4_moe_lite; GQA: llama), or a `.gguf` file of the llama
    architecture (`leyline_jax.gguf`: dequantized whole, its Q/K rows un-permuted, then placed
    as below).

    Streams `config.json` and `model.safetensors` (or a sharded index): each param reads only
    its tensors, is converted, placed (on the default device, or where
    `mesh.param_sharding(path, shape)` says: see `model_from_params`) and its host copy dropped
    before the next. Peak host memory beyond the process's own: the params placed in host
    memory (all of them on CPU) plus at most twice the largest tensor or param (measured on
    CPU: about once). A progress bar shows above `safetensors.PROGRESS_BYTES` (or with
    `progress=True`).

    Raises before anything is read: `ConfigError` (unknown family, unsupported field),
    `CheckpointNotFoundError` (missing files), `CheckpointError` (missing, unexpected or
    mis-shaped tensors, unreadable files). The files stay open until the load ends: one cut
    short in place meanwhile raises `CheckpointError` when a read meets its end; one removed or
    renamed over still reads as it was when opened.
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
        lazy = _lazy_hf_params(config, tensors, dtype)
        return _build_model(config, lazy, dtype, mesh=mesh, progress=False)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
    try:
        config = config_from_hf(path)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(str(e)) from e
    with Safetensors(path) as tensors:
        lazy = _lazy_hf_params(config, tensors, dtype)
        return _build_model(config, lazy, dtype, mesh=mesh, progress=progress)


__all__ = [
    "config_from_dict",
    "config_from_hf",
    "convert_hf_params",
    "hf_tensor_shapes",
    "load_model",
    "model_from_params",
]
