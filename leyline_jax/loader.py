"""Hugging Face checkpoint (or GGUF file) -> `CausalLM`, streamed one param at a time.

Per family, one table names every tensor a checkpoint holds and its shape, and one converter
maps a flat mapping of those tensors to our params; `hf_tensor_shapes(config)` and
`convert_hf_params` dispatch to them by the config's type (MLA's live here, GQA's in
`leyline_jax.gqa`; `_FAMILIES` is the one registry: adding a family is a module and a line
there). A converter returns lazy leaves: each is a zero-argument callable that reads only the
tensors its param needs and builds it. `convert_hf_params` builds them all (pure, eager: the
parity tests and the tiny checkpoint writer use it); `load_model` builds, places and drops them
one at a time from safetensors files read on demand, so the host never holds the checkpoint,
only what is placed plus the param being built. Names and shapes are checked against the
table before anything is read.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

import jax
import jax.numpy as jnp
import ml_dtypes
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
from leyline_jax.sharding import key_path

# Above this many bytes (of params placed, or of tensors read) the loader shows a progress bar
# (unless told otherwise).
PROGRESS_BYTES = 256 << 20

# safetensors dtype names -> numpy dtypes (bfloat16 and float8 from ml_dtypes, as jax uses)
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


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


_TILE = 256  # rows and columns of one block of a transposing copy


def _contiguous(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`a` as a C-contiguous array (copied into `out` if given). A transposed view (the last
    two axes swapped, as `.T` makes) is copied block by block, so that reads and writes both
    stay in cache (numpy's own copy strides across whole rows on one side: 4-8x slower on an
    embedding-sized matrix), as unsigned integers of the same width (bit-exact; faster than
    numpy's copy of a custom dtype such as bfloat16)."""
    if out is None:
        if a.flags.c_contiguous:
            return a
        out = np.empty(a.shape, a.dtype)
    if a.ndim < 2 or not a.swapaxes(-1, -2).flags.c_contiguous:
        out[...] = a
        return out
    bits = f"u{a.dtype.itemsize}"
    src, dst = a.view(bits), out.view(bits)
    rows, cols = a.shape[-2:]
    for i in range(0, rows, _TILE):
        for j in range(0, cols, _TILE):
            dst[..., i : i + _TILE, j : j + _TILE] = src[..., i : i + _TILE, j : j + _TILE]
    return out


class _MLALeaves:
    """Lazy leaves of MLA params: each method returns a zero-argument callable that reads the
    tensors it needs (names and shapes already checked) and builds the param as numpy in
    `dtype`: linear weights transposed to `[in, out]`, `kv_b_proj` split into head-major `k_up`
    `[N, Dn, R]` and `v_up` `[N, R, Dv]`, experts stacked, interleaved rope rows permuted to
    the halves layout."""

    def __init__(self, config: MLAConfig, tensors: Mapping[str, Any], dtype):
        c = self.c = config
        self.tensors, self.dtype = tensors, dtype
        self.perm = rope.deinterleave_perm(c.qk_rope_head_dim) if c.rope_interleave else None

    def get(self, name, out_dtype=None):  # a fresh array (a lazy tensor's read is one already)
        return np.array(self.tensors[name], dtype=out_dtype or self.dtype)

    def plain(self, name, out_dtype=None):
        return lambda: self.get(name, out_dtype)

    def linear(self, name, out_dtype=None):  # [out, in] -> [in, out]
        return {"kernel": lambda: self.get(name, out_dtype).T}

    def _rope_rows(self, w, axis: int):  # the trailing Dr rows of `axis` in the halves layout
        if self.perm is None:
            return w
        cut = w.shape[axis] - len(self.perm)
        head, band = np.split(w, [cut], axis=axis)
        return np.concatenate([head, np.take(band, self.perm, axis=axis)], axis)

    def q_proj(self, name):  # [N*Dqk, in]: each head's rope rows permuted, then [in, N*Dqk]
        c = self.c
        shape = (c.num_attention_heads, c.qk_head_dim, -1)
        return {"kernel": lambda: self._rope_rows(self.get(name).reshape(shape), 1)
                .reshape(c.num_attention_heads * c.qk_head_dim, -1).T}  # fmt: skip

    def kv_a_proj(self, name):  # [R + Dr, H]: the rope rows permuted, then [H, R + Dr]
        return {"kernel": lambda: self._rope_rows(self.get(name), 0).T}

    def kv_up(self, name) -> dict:  # [N * (Dn + Dv), R] -> k_up [N, Dn, R], v_up [N, R, Dv]
        c = self.c
        n, dn = c.num_attention_heads, c.qk_nope_head_dim

        def kv_b():
            return self.get(name).reshape(n, dn + c.v_head_dim, c.kv_lora_rank)

        return {"k_up": lambda: kv_b()[:, :dn], "v_up": lambda: kv_b()[:, dn:].transpose(0, 2, 1)}

    def experts(self, names):  # E x [out, in] -> [E, in, out], filled one expert at a time
        def build():
            d_out, d_in = np.shape(self.tensors[names[0]])
            out = np.empty((len(names), d_in, d_out), np.dtype(self.dtype))
            for e, name in enumerate(names):
                _contiguous(self.get(name).T, out=out[e])
            return out

        return build

    def mlp(self, prefix) -> dict:
        return {
            k: self.linear(f"{prefix}.{k}.weight") for k in ("gate_proj", "up_proj", "down_proj")
        }

    def attention(self, a: str) -> dict:
        attn: dict[str, Any] = {}
        if self.c.q_lora_rank is None:
            attn["q_proj"] = self.q_proj(f"{a}.q_proj.weight")
        else:
            attn["q_a_proj"] = self.linear(f"{a}.q_a_proj.weight")
            attn["q_a_norm"] = {"weight": self.plain(f"{a}.q_a_layernorm.weight")}
            attn["q_b_proj"] = self.q_proj(f"{a}.q_b_proj.weight")
        attn["kv_a_proj"] = self.kv_a_proj(f"{a}.kv_a_proj_with_mqa.weight")
        attn["kv_a_norm"] = {"weight": self.plain(f"{a}.kv_a_layernorm.weight")}
        attn["o_proj"] = self.linear(f"{a}.o_proj.weight")
        return attn | self.kv_up(f"{a}.kv_b_proj.weight")

    def moe(self, p: str) -> dict:  # the router and its bias stay float32
        ex = [f"{p}.mlp.experts.{e}" for e in range(self.c.n_routed_experts)]
        moe: dict[str, Any] = {
            "router": {"weight": self.linear(f"{p}.mlp.gate.weight", np.float32)["kernel"]},
            "experts": {
                k: self.experts([f"{e}.{k}_proj.weight" for e in ex])
                for k in ("gate", "up", "down")
            },
        }
        if self.c.router == ROUTER_SIGMOID_GROUPED:
            moe["router"]["bias"] = self.plain(f"{p}.mlp.gate.e_score_correction_bias", np.float32)
        if self.c.n_shared_experts:
            moe["shared"] = self.mlp(f"{p}.mlp.shared_experts")
        return moe

    def layer(self, i: int) -> dict:
        p = f"model.layers.{i}"
        return {
            "input_norm": {"weight": self.plain(f"{p}.input_layernorm.weight")},
            "post_attention_norm": {"weight": self.plain(f"{p}.post_attention_layernorm.weight")},
            "attn": self.attention(f"{p}.self_attn"),
            "mlp": self.moe(p) if self.c.is_sparse(i) else self.mlp(f"{p}.mlp"),
        }


def _mla_lazy_hf_params(config: MLAConfig, tensors: Mapping[str, Any], dtype) -> dict[str, Any]:
    """MLA, lazily: the nested params of `CausalLM`, each leaf a zero-argument callable
    (`_MLALeaves`)."""
    leaves = _MLALeaves(config, tensors, dtype)
    params: dict[str, Any] = {
        "embed": leaves.plain("model.embed_tokens.weight"),
        "layers": {i: leaves.layer(i) for i in range(config.num_hidden_layers)},
        "final_norm": {"weight": leaves.plain("model.norm.weight")},
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = leaves.linear("lm_head.weight")
    return params


# model_type -> (config class, tensor table, lazy converter): the one place a family is registered
_FAMILIES = {
    **{t: (MLAConfig, _mla_tensor_shapes, _mla_lazy_hf_params) for t in MLA_MODEL_TYPES},
    **{t: (gqa.GQAConfig, gqa.hf_tensor_shapes, gqa.lazy_hf_params) for t in gqa.MODEL_TYPES},
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
        value = _contiguous(np.asarray(value, want.dtype))
    _check_param_shape(path, np.shape(value), want.shape)
    if mesh is None:
        sharding = None  # the default device, uncommitted (as `jnp.asarray` places)
    else:
        sharding = mesh.param_sharding(key_path(path), tuple(value.shape))
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
    with _progress_bar(total, progress) as advance:
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


@contextlib.contextmanager
def _progress_bar(total: int, progress: bool | None) -> Iterator[Callable[[int], object]]:
    """`advance(nbytes)` for a bar of `total` bytes, shown above `PROGRESS_BYTES` unless told."""
    if not (total > PROGRESS_BYTES if progress is None else progress):
        yield lambda nbytes: None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="loading tensors") as bar:
        yield bar.update


def _shard_files(path: str) -> dict[str, list[str]]:
    """{file: the tensor names the index maps to it, or [] for every tensor of the file}."""
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
        files = {single: []}
    else:
        raise CheckpointNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {path}"
        )
    for fname in files:
        if not os.path.isfile(fname):
            raise CheckpointNotFoundError(f"checkpoint shard {fname} does not exist")
    return files


def _header(fname: str, f: BinaryIO) -> tuple[int, dict[str, Any]]:
    """(byte offset of the data, {name: entry}) of the safetensors file `fname`, open as `f`.
    safetensors' own reader checks the file first (a valid header whose tensors cover the data
    exactly, so a truncated file fails here); only the header's bytes are read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(fname, framework="numpy"):
            pass
    except SafetensorError as e:
        raise CheckpointError(f"cannot read {fname}: {e}") from e
    size = int.from_bytes(f.read(8), "little")
    entries = json.loads(f.read(size))
    entries.pop("__metadata__", None)
    return 8 + size, entries


class _LazyTensor:
    """One tensor of a safetensors file: `shape`, `dtype` and `nbytes` without reading it;
    `np.asarray(t)` reads it (a fresh array each time)."""

    def __init__(self, files: _Safetensors, name: str, fname: str, entry: Mapping[str, Any]):
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name} in {fname} has unknown dtype {entry['dtype']}")
        self._files, self.name, self.fname = files, name, fname
        self.shape = tuple(entry["shape"])
        self.dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
        self.offset = entry["data_offsets"][0]  # from the start of the file's data
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None):  # every call reads: always a fresh array
        a = self._files.read(self)
        return a if dtype is None else a.astype(dtype, copy=False)


class _Safetensors(Mapping[str, _LazyTensor]):
    """The tensors of a checkpoint directory (`model.safetensors` or a sharded index), read
    only when asked for. Opening opens every file (until `close`) and checks it (missing,
    corrupt, truncated, an index naming a tensor its shard lacks), reading only the headers;
    reading a tensor reads exactly its bytes into a fresh array. A file removed or replaced
    by a rename after opening still reads as it was (its descriptor holds it); one cut short
    in place fails the read that meets its end. No memory map: the pages of a mapped file that
    reads touch count as the process's resident memory until it is unmapped, so one mapped
    shard would hold a whole shard's worth."""

    def __init__(self, path: str):
        self._tensors: dict[str, _LazyTensor] = {}
        self._open: dict[str, BinaryIO] = {}  # file name -> the file, unbuffered
        self._data_start: dict[str, int] = {}
        try:
            for fname, names in _shard_files(path).items():
                f = self._open[fname] = open(fname, "rb", buffering=0)
                self._data_start[fname], entries = _header(fname, f)
                for name in names:
                    if name not in entries:
                        raise CheckpointError(f"index maps {name} to {fname}, which lacks it")
                for name in names or entries:
                    self._tensors[name] = _LazyTensor(self, name, fname, entries[name])
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> _LazyTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def read(self, t: _LazyTensor) -> np.ndarray:
        """Raises `CheckpointError` if the file ends early (cut short since it was opened)."""
        f = self._open[t.fname]
        out = np.empty(t.shape, t.dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        start = self._data_start[t.fname] + t.offset
        f.seek(start)
        done = 0
        while done < t.nbytes:
            n = f.readinto(buf[done:])
            if not n:
                raise CheckpointError(
                    f"cannot read {t.fname}: it ends at byte {start + done}, inside tensor "
                    f"{t.name} (bytes {start}..{start + t.nbytes}): truncated since it was opened"
                )
            done += n
        return out

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self) -> _Safetensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_safetensors(path: str | os.PathLike, *, progress: bool | None = None) -> dict[str, Any]:
    """All tensors of a checkpoint directory (`model.safetensors` or a sharded index) as numpy,
    at once (`load_model` reads them one at a time instead)."""
    with _Safetensors(os.fspath(path)) as files:
        tensors = {}
        with _progress_bar(sum(t.nbytes for t in files.values()), progress) as advance:
            for name, t in files.items():
                tensors[name] = np.asarray(t)
                advance(t.nbytes)
        return tensors


def load_model(
    path: str | os.PathLike, dtype=jnp.float32, *, progress: bool | None = None, mesh=None
) -> CausalLM:
    """Load a checkpoint into a `CausalLM`: a Hugging Face directory of any supported family
    (MLA: deepseek_v2, deepseek_v3, glm4_moe_lite; GQA: llama), or a `.gguf` file of the llama
    architecture (`leyline_jax.gguf`: dequantized, its Q/K rows un-permuted).

    Reads `config.json` and `model.safetensors` (or a sharded `model.safetensors.index.json`),
    converts names, layouts and dtype, streaming: each param reads only its tensors, is built,
    placed (on the default device, or where `mesh.param_sharding(path, shape)` says: see
    `model_from_params`) and its host copy dropped before the next is read. Peak host memory
    beyond the process's own: the params placed in host memory (all of them on CPU, none on an
    accelerator) plus at most twice the largest tensor or param (the array being built and the
    one it is built from; measured on CPU: about once). A progress bar over the params placed
    shows above `PROGRESS_BYTES` (or with `progress=True`). A GGUF file is dequantized whole
    first, then placed the same way.

    Any problem with the files raises before anything is read: `ConfigError` for an unknown
    family or unsupported field, `CheckpointNotFoundError` for missing files, `CheckpointError`
    for missing/unexpected/mis-shaped tensors or unreadable files. The files stay open until
    the load ends: one cut short in place meanwhile raises `CheckpointError` when a read meets
    its end; one removed or renamed over still reads as it was when opened.
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
    with _Safetensors(path) as tensors:
        lazy = _lazy_hf_params(config, tensors, dtype)
        return _build_model(config, lazy, dtype, mesh=mesh, progress=progress)


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
