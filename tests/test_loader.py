"""Checkpoint loading: layouts (single file, sharded), what is ignored, every bad input, orbax."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_CONFIGS, random_tokens
from safetensors.numpy import load_file, save_file

import leyline_jax as ll
from checkpoints.orbax_io import restore_params, save_params
from checkpoints.tiny import write_random_checkpoint
from leyline_jax.loader import config_from_hf, convert_hf_params, hf_tensor_shapes


@pytest.fixture
def ckpt(tmp_path, np_ckpt):
    """A private copy of the numpy-written V3 checkpoint that a test may damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(np_ckpt("deepseek_v3"), dst)
    return dst


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_sharded_equals_single_file(tmp_path):
    cfg = ALL_CONFIGS["glm4_moe_lite"]
    single = write_random_checkpoint(tmp_path / "single", cfg, seed=5)
    sharded = write_random_checkpoint(tmp_path / "sharded", cfg, seed=5, max_shard_bytes=100_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    tokens = random_tokens(64)
    a = ll.load_model(single)(tokens)
    b = ll.load_model(sharded)(tokens)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mtp_layers_are_ignored(tmp_path):
    """V3/GLM checkpoints carry multi-token-prediction layers after the last decoder layer; the
    reference ignores them, and so do we. The same tensors on deepseek_v2 are unexpected."""
    cfg = ALL_CONFIGS["deepseek_v3"]
    n = cfg["num_hidden_layers"]
    extra = {
        f"model.layers.{n}.eh_proj.weight": np.ones((64, 128), np.float32),
        f"model.layers.{n}.enorm.weight": np.ones((64,), np.float32),
    }
    plain = write_random_checkpoint(tmp_path / "plain", cfg, seed=1)
    mtp = write_random_checkpoint(tmp_path / "mtp", cfg, seed=1, extra_tensors=extra)
    tokens = random_tokens(32)
    np.testing.assert_array_equal(
        np.asarray(ll.load_model(plain)(tokens)), np.asarray(ll.load_model(mtp)(tokens))
    )
    v2 = dict(ALL_CONFIGS["deepseek_v2"])
    with pytest.raises(ll.CheckpointError, match="unexpected"):
        write_random_checkpoint(tmp_path / "v2", v2, extra_tensors=extra)
        ll.load_model(tmp_path / "v2")
    # one layer past the MTP layers is unexpected even on V3
    far = {f"model.layers.{n + 1}.enorm.weight": np.ones((64,), np.float32)}
    write_random_checkpoint(tmp_path / "far", cfg, extra_tensors=far)
    with pytest.raises(ll.CheckpointError, match="unexpected"):
        ll.load_model(tmp_path / "far")


def test_bf16_checkpoint_loads(tmp_path):
    path = write_random_checkpoint(tmp_path / "bf16", ALL_CONFIGS["deepseek_v2"], dtype="bfloat16")
    model = ll.load_model(path)  # bf16 on disk, fp32 params: a widening cast
    assert model.embed[...].dtype == jnp.float32
    assert model.layers[1].mlp.router.weight[...].dtype == jnp.float32
    model16 = ll.load_model(path, dtype=jnp.bfloat16)
    assert model16.embed[...].dtype == jnp.bfloat16
    assert model16.layers[1].mlp.router.weight[...].dtype == jnp.float32  # router stays fp32


def test_progress_bar(ckpt, capsys):
    ll.load_model(ckpt, progress=True)
    assert "loading tensors" in capsys.readouterr().err
    ll.load_model(ckpt)  # tiny: no bar by default
    assert "loading tensors" not in capsys.readouterr().err


# ---- bad inputs -----------------------------------------------------------------------------
def test_missing_directory(tmp_path):
    with pytest.raises(ll.CheckpointNotFoundError, match="does not exist"):
        ll.load_model(tmp_path / "nowhere")
    assert issubclass(ll.CheckpointNotFoundError, FileNotFoundError)


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ll.CheckpointNotFoundError, match="config.json"):
        ll.load_model(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ll.CheckpointNotFoundError, match="model.safetensors"):
        ll.load_model(ckpt)


def test_missing_shard(tmp_path):
    path = write_random_checkpoint(
        tmp_path / "s", ALL_CONFIGS["deepseek_v2"], max_shard_bytes=100_000
    )
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ll.CheckpointNotFoundError, match=victim.name):
        ll.load_model(path)


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3"}))
    with pytest.raises(ll.ConfigError, match="qwen3"):
        ll.load_model(ckpt)


BIG = 10**400  # a JSON integer no size can be


@pytest.mark.parametrize(
    "family, text, match",
    [
        ("deepseek_v3", b"[]", "JSON object"),
        ("deepseek_v3", b"null", "JSON object"),
        ("deepseek_v3", b'{"model_type": "\xff"}', "not valid JSON"),
        ("deepseek_v3", {"model_type": ["deepseek_v3"]}, "model_type"),
        ("deepseek_v3", {"num_hidden_layers": BIG}, "num_hidden_layers"),
        ("deepseek_v3", {"hidden_size": BIG}, "hidden_size"),
        ("deepseek_v3", {"num_hidden_layers": "2"}, "num_hidden_layers"),
        ("deepseek_v3", {"rope_theta": "1e4"}, "rope_theta"),
        ("deepseek_v3", {"rope_theta": BIG}, "rope_theta"),
        ("llama", {"num_hidden_layers": BIG}, "num_hidden_layers"),
        ("llama", {"num_attention_heads": 0}, "num_attention_heads"),
        ("llama", {"num_key_value_heads": [1]}, "num_key_value_heads"),
        ("llama", {"intermediate_size": 4.0}, "intermediate_size"),
        ("llama", {"rope_scaling": [1]}, "rope_scaling"),
        ("llama", {"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ],
)  # fmt: skip
def test_every_malformed_config_is_a_config_error(tmp_path, family, text, match):
    """Whatever a config.json holds, reading it raises ConfigError naming what is wrong (not
    AttributeError, TypeError, UnicodeDecodeError or OverflowError); a dict is a change of the
    family's tiny config."""
    if isinstance(text, dict):
        text = json.dumps({**ALL_CONFIGS[family], **text}).encode()
    (tmp_path / "config.json").write_bytes(text)
    with pytest.raises(ll.ConfigError, match=match):
        config_from_hf(tmp_path)


def test_missing_tensor(ckpt):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _rewrite(ckpt, lambda t: t.pop(name))
    with pytest.raises(ll.CheckpointError, match="missing.*kv_b_proj"):
        ll.load_model(ckpt)


def test_unexpected_tensor(ckpt):
    _rewrite(
        ckpt,
        lambda t: t.__setitem__("model.layers.0.self_attn.rotary.inv_freq", np.ones(8, np.float32)),
    )
    with pytest.raises(ll.CheckpointError, match="unexpected.*rotary"):
        ll.load_model(ckpt)


def test_misshaped_tensor(ckpt):
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, np.ones((31, 64), np.float32)))
    with pytest.raises(ll.CheckpointError, match=r"experts\.3\.up_proj.*\(31, 64\)"):
        ll.load_model(ckpt)


def test_corrupt_weights_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(ll.CheckpointError, match="cannot read"):
        ll.load_model(ckpt)


def test_broken_index(tmp_path):
    path = write_random_checkpoint(
        tmp_path / "s", ALL_CONFIGS["deepseek_v2"], max_shard_bytes=100_000
    )
    (path / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(ll.CheckpointError, match="index"):
        ll.load_model(path)


def test_converter_is_pure_and_checks_shapes():
    config = ll.MLAConfig.from_hf(ALL_CONFIGS["deepseek_v2"])
    rng = np.random.default_rng(0)
    tensors = {
        k: rng.standard_normal(s).astype(np.float32) for k, s in hf_tensor_shapes(config).items()
    }
    before = {k: v.copy() for k, v in tensors.items()}
    params = convert_hf_params(config, tensors)
    assert all(np.array_equal(before[k], tensors[k]) for k in tensors)  # input untouched
    assert params["layers"][1]["mlp"]["experts"]["gate"].shape == (8, 64, 32)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:3]
    with pytest.raises(ll.CheckpointError, match="model.norm.weight"):
        convert_hf_params(config, tensors)


# ---- the model's own input checks -----------------------------------------------------------
@pytest.mark.parametrize(
    "tokens, needle",
    [
        ([0, 1, 256], "256"),
        ([-1, 3], "-1"),
        ([[1, 2]], "1-D"),
        ([], "1-D"),
        ([0.5, 1.0], "int"),
    ],
)
def test_bad_tokens(ckpt, tokens, needle):
    model = ll.load_model(ckpt)
    with pytest.raises(ValueError, match=needle):
        model(np.asarray(tokens))


# ---- orbax ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_orbax_roundtrip(tmp_path, ckpt, dtype):
    model = ll.load_model(ckpt, dtype=dtype)
    save_params(tmp_path / "saved", model)
    restored = restore_params(tmp_path / "saved")
    assert restored.config == model.config and restored.dtype == model.dtype
    tokens = random_tokens(48)
    np.testing.assert_array_equal(np.asarray(restored(tokens)), np.asarray(model(tokens)))
    with pytest.raises(FileExistsError):
        save_params(tmp_path / "saved", model)


def test_orbax_roundtrip_gqa(tmp_path, np_ckpt):
    """A GQA model saves and restores as its own family (the config says which)."""
    model = ll.load_model(np_ckpt("llama"))
    save_params(tmp_path / "saved", model)
    restored = restore_params(tmp_path / "saved")
    assert isinstance(restored.config, ll.GQAConfig) and restored.config == model.config
    tokens = random_tokens(48)
    np.testing.assert_array_equal(np.asarray(restored(tokens)), np.asarray(model(tokens)))


def test_orbax_missing(tmp_path):
    with pytest.raises(ll.CheckpointNotFoundError):
        restore_params(tmp_path / "nothing")


def test_orbax_refuses_another_params_layout(tmp_path, ckpt):
    """A save made before the k_up / v_up split (no layout field: layout 1) is refused with a
    message saying what to do, not an orbax tree mismatch."""
    import json

    save_params(tmp_path / "saved", ll.load_model(ckpt))
    meta_file = tmp_path / "saved" / "mla_config.json"
    meta = json.loads(meta_file.read_text())
    del meta["params_layout"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ll.CheckpointError, match="layout 1.*convert the Hugging Face"):
        restore_params(tmp_path / "saved")
