"""Streaming loading: the same params as the eager conversion, bit for bit, in bounded memory;
every bad file still a clear error, before anything is read where the files show it; the mesh
hook asked once per param; random checkpoints at DeepSeek-V2-Lite's real shapes."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_CONFIGS, FAMILIES, GQA_NAMES, random_tokens
from flax import nnx
from safetensors.numpy import load_file

import leyline_jax as ll
from checkpoints.random_hf import v2_lite_config, write_random_hf
from checkpoints.tiny import write_random_checkpoint
from leyline_jax.loader import (
    config_from_hf,
    convert_hf_params,
    hf_tensor_shapes,
    model_from_params,
)
from leyline_jax.safetensors import read_safetensors

ROOT = Path(__file__).resolve().parents[1]


def _params(model) -> dict[tuple[str, ...], np.ndarray]:
    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {tuple(str(k.key) for k in path): np.asarray(leaf) for path, leaf in flat}


def _eager(path, dtype):
    """The loader before streaming: every tensor read, every param built, then placed."""
    config = config_from_hf(path)
    params = convert_hf_params(config, read_safetensors(path), dtype)
    return model_from_params(config, params, dtype)


def _assert_same_params(a, b) -> None:
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert pa[key].dtype == pb[key].dtype, key
        np.testing.assert_array_equal(pa[key], pb[key], err_msg=str(key))


class RecordingMesh:
    """A one-device stand-in for `leyline_jax.sharding.MeshConfig`: it records each question
    and runs `on_first` (if given) when asked the first one, i.e. after the first param is
    built and before it is placed."""

    def __init__(self, on_first=None):
        self.calls: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
        self.on_first = on_first

    def param_sharding(self, path, shape):
        if not self.calls and self.on_first is not None:
            self.on_first()
        self.calls.append((path, shape))
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])


@pytest.fixture(scope="module")
def scratch():
    """A folder for checkpoints of hundreds of MB to a GB, removed after the module: RAM-backed
    (/dev/shm) where there is one, so a slow shared disk stays out of the test's time."""
    shm = "/dev/shm"
    root = tempfile.mkdtemp(dir=shm if os.access(shm, os.W_OK) else None, prefix="leyline-")
    yield Path(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sharded(tmp_path):
    """A tiny V2 checkpoint in several shards that a test may damage, and its shard files."""
    path = write_random_checkpoint(
        tmp_path / "s", ALL_CONFIGS["deepseek_v2"], seed=3, max_shard_bytes=100_000
    )
    return path, sorted(path.glob("model-*.safetensors"))


# ---- the same params as the eager conversion ----------------------------------------------------
@pytest.mark.parametrize("name", [*FAMILIES, *GQA_NAMES])
def test_stream_equals_eager(np_ckpt, name):
    path = np_ckpt(name)
    _assert_same_params(ll.load_model(path), _eager(path, jnp.float32))


def test_stream_equals_eager_bf16_sharded(tmp_path):
    """bf16 on disk and in the model, in several shards."""
    cfg = ALL_CONFIGS["deepseek_v3"]
    path = write_random_checkpoint(
        tmp_path / "c", cfg, dtype="bfloat16", max_shard_bytes=50_000, seed=4
    )
    _assert_same_params(ll.load_model(path, jnp.bfloat16), _eager(path, jnp.bfloat16))


def test_read_safetensors_equals_the_library(tmp_path):
    """Our reader (positioned reads from the header's offsets) against safetensors' own."""
    path = write_random_checkpoint(
        tmp_path / "c", ALL_CONFIGS["deepseek_v2"], dtype="bfloat16", max_shard_bytes=80_000
    )
    ours = read_safetensors(path)
    theirs = {}
    for shard in path.glob("model-*.safetensors"):
        theirs.update(load_file(str(shard)))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype, name
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


# ---- the mesh hook ------------------------------------------------------------------------------
def test_mesh_is_asked_once_per_param_with_its_path_and_shape(np_ckpt):
    path = np_ckpt("deepseek_v2")
    mesh = RecordingMesh()
    model = ll.load_model(path, mesh=mesh)
    params = _params(model)
    asked = dict(mesh.calls)
    assert len(mesh.calls) == len(asked) == len(params)
    assert asked == {key: value.shape for key, value in params.items()}
    assert asked[("embed",)] == (256, 64)
    assert asked[("layers", "1", "mlp", "experts", "gate")] == (8, 64, 32)
    assert asked[("layers", "0", "attn", "k_up")] == (4, 16, 32)
    assert model.layers[1].mlp.experts.gate[...].committed  # placed where the mesh said
    _assert_same_params(model, ll.load_model(path))


def test_model_from_params_asks_the_mesh_too(np_ckpt):
    path = np_ckpt("llama")
    config = config_from_hf(path)
    mesh = RecordingMesh()
    model = model_from_params(config, convert_hf_params(config, read_safetensors(path)), mesh=mesh)
    assert dict(mesh.calls) == {k: v.shape for k, v in _params(model).items()}


# ---- bad files: the clear errors, before anything is read where the files show it -------------
def test_misshaped_tensor_in_a_shard_fails_before_reading(tmp_path):
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    path = write_random_checkpoint(
        tmp_path / "s",
        ALL_CONFIGS["deepseek_v2"],
        max_shard_bytes=100_000,
        extra_tensors={name: np.ones((64, 31), np.float32)},
    )
    mesh = RecordingMesh()
    with pytest.raises(ll.CheckpointError, match=r"experts\.5\.down_proj.*\(64, 31\)"):
        ll.load_model(path, mesh=mesh)
    assert mesh.calls == []  # nothing was built or placed


def test_truncated_shard_fails_before_reading(sharded):
    path, shards = sharded
    os.truncate(shards[2], shards[2].stat().st_size - 10)
    mesh = RecordingMesh()
    with pytest.raises(ll.CheckpointError, match=f"cannot read .*{shards[2].name}"):
        ll.load_model(path, mesh=mesh)
    assert mesh.calls == []


def test_shard_truncated_while_streaming(sharded):
    """A shard cut short after the load has opened the files (a copy still being written, a
    rewrite): the read that meets the end fails with a CheckpointError, not a crash."""
    path, shards = sharded
    last = shards[-1]
    mesh = RecordingMesh(on_first=lambda: os.truncate(last, last.stat().st_size // 2))
    with pytest.raises(ll.CheckpointError, match=f"{last.name}.*truncated since it was opened"):
        ll.load_model(path, mesh=mesh)
    assert len(mesh.calls) >= 1  # it failed while streaming, not before


def test_shard_removed_while_streaming_still_reads(sharded):
    """The load holds every file open from the start: a shard removed meanwhile (or replaced
    by a rename) still reads as it was."""
    path, shards = sharded
    intact = ll.load_model(path)
    mesh = RecordingMesh(on_first=shards[-1].unlink)
    _assert_same_params(ll.load_model(path, mesh=mesh), intact)
    assert not shards[-1].exists()


# ---- DeepSeek-V2-Lite's real shapes -------------------------------------------------------------
def test_v2_lite_shaped_checkpoint_loads_and_runs(scratch):
    """One layer (the dense one) at V2-Lite's real shapes: a GB of bf16, loaded as bf16."""
    path = write_random_hf(scratch / "v2_lite_1", v2_lite_config(1), max_shard_bytes=300 << 20)
    assert len(list(path.glob("model-0000?-of-0000?.safetensors"))) > 1
    model = ll.load_model(path, jnp.bfloat16)
    c = model.config
    assert (c.hidden_size, c.num_attention_heads, c.kv_lora_rank) == (2048, 16, 512)
    assert c.q_lora_rank is None and (c.n_routed_experts, c.num_experts_per_tok) == (64, 6)
    assert model.embed[...].shape == (102400, 2048) and model.embed[...].dtype == jnp.bfloat16
    logits = np.asarray(model(random_tokens(8, vocab=102400)))
    assert logits.shape == (8, 102400) and np.isfinite(logits).all()
    assert 0 < np.abs(logits).max() < 1e3
    shutil.rmtree(path)


# ---- peak memory, each load in a fresh process -------------------------------------------------
# V2-Lite's hidden size and dense MLP, a 16k vocabulary, one layer: ~290 MB of bf16
_MEMORY_CONFIG = dict(v2_lite_config(1), vocab_size=16000)
_SLACK = 64 << 20  # the runtime's own allocations during a load (measured: ~15 MB)


@pytest.fixture(scope="module")
def memory_ckpt(scratch):
    return write_random_hf(scratch / "memory", _MEMORY_CONFIG)


def _measure(loader: str, path) -> dict:
    """The benchmark's own measurement (`benchmarks.load_bench`): one load in a fresh process."""
    cmd = [sys.executable, "-m", "benchmarks.load_bench", "--child", loader, str(path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM")
@pytest.mark.parametrize("loader, within", [("stream", True), ("eager", False)])
def test_peak_memory_bound(memory_ckpt, loader, within):
    """Streaming stays within placed + 2 x the largest tensor (+ slack); the eager composition
    (every tensor, then every param, then the model) does not, so the bound can fail."""
    row = _measure(loader, memory_ckpt)
    shapes = hf_tensor_shapes(config_from_hf(_MEMORY_CONFIG)).values()
    largest = max(max(math.prod(s) for s in shapes) * 2, row["largest_param_bytes"])  # bf16
    bound = row["placed_bytes"] + 2 * largest + _SLACK
    assert (row["growth_bytes"] <= bound) is within, (row, bound)
