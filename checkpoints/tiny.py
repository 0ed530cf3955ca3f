"""Tiny random checkpoints of each family (MLA and GQA), in the Hugging Face on-disk layout.

Two writers:
- `write_random_checkpoint` needs only numpy + safetensors (the embedded default `make run` uses;
  a library user never needs torch). Tensor names and shapes come from
  `leyline_jax.loader.hf_tensor_shapes`; a test proves transformers loads the result with no
  missing or unexpected tensor and agrees with our logits.
- `make_hf_checkpoint` builds the model with transformers' own classes and `save_pretrained`
  (needs torch; used by the parity tests, so the reference writes its own files).

The configs exercise: q_lora_rank None and int, YaRN (old-style `rope_scaling` and new-style
`rope_parameters`, with and without mscale), softmax group-limited and sigmoid grouped routing,
shared experts, dense first layers, tied and untied embeddings, interleaved and halves rope;
and for GQA (`TINY_GQA_CONFIGS`, Llama layout) grouped KV heads with tied and untied embeddings.

Command line: `python -m checkpoints.tiny --out DIR [--hf]` writes one folder per family.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from checkpoints.random_hf import shard_plan, write_shards
from leyline_jax.loader import config_from_hf, hf_tensor_shapes

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    max_position_embeddings=2048,
    hidden_act="silu",
    # large enough that attention is peaked and RoPE errors move the logits
    initializer_range=0.1,
    bos_token_id=0,
    eos_token_id=1,
)

TINY_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(
        _COMMON,
        model_type="deepseek_v2",
        architectures=["DeepseekV2ForCausalLM"],
        q_lora_rank=None,
        n_shared_experts=2,
        num_experts_per_tok=3,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=1024,  # = factor x original, as YaRN expects
        # old-style RoPE fields; mscale != mscale_all_dim so the YaRN attention factor is not 1
        rope_theta=10000.0,
        rope_scaling=dict(
            type="yarn",
            factor=4.0,
            original_max_position_embeddings=256,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=0.707,
        ),
    ),
    "deepseek_v3": dict(
        _COMMON,
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        q_lora_rank=48,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_interleave=True,
        num_nextn_predict_layers=1,
        max_position_embeddings=1024,  # = factor x original, as YaRN expects
        # new-style RoPE; no mscale: the attention factor comes from the factor alone
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=128
        ),
    ),
    "glm4_moe_lite": dict(
        _COMMON,
        model_type="glm4_moe_lite",
        architectures=["Glm4MoeLiteForCausalLM"],
        q_lora_rank=48,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.8,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_interleave=True,
        mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
}

# A variant for tests: a V3 checkpoint whose rope band is stored in halves (rope_interleave=False).
TINY_HF_VARIANTS: dict[str, dict[str, Any]] = {
    "deepseek_v3_halves": dict(
        TINY_HF_CONFIGS["deepseek_v3"], rope_interleave=False, tie_word_embeddings=False
    ),
}

# The GQA family (Llama layout, as SmolLM2): 4 query heads over 2 KV heads.
_GQA_COMMON: dict[str, Any] = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    bos_token_id=0,
    eos_token_id=1,
)
TINY_GQA_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_GQA_COMMON, tie_word_embeddings=True, rope_theta=100000.0),
    "llama_untied": dict(
        _GQA_COMMON, tie_word_embeddings=False, rope_theta=10000.0, num_key_value_heads=1
    ),
}


def _random_tensor(rng: np.random.Generator, name: str, shape, std: float) -> np.ndarray:
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (std * rng.standard_normal(shape)).astype(np.float32)


def write_random_checkpoint(
    out_dir: str | os.PathLike,
    hf_config: dict[str, Any],
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `config.json` + safetensors (sharded with an index when `max_shard_bytes` is set)
    holding random weights for `hf_config`. numpy + safetensors only."""
    import ml_dtypes
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = config_from_hf(hf_config)
    rng = np.random.default_rng(seed)
    std = float(hf_config.get("initializer_range", 0.02))
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    tensors = {
        name: _random_tensor(rng, name, shape, std).astype(
            np.float32 if "mlp.gate." in name else np_dtype  # routers stay fp32, as HF keeps them
        )
        for name, shape in hf_tensor_shapes(config).items()
    }
    tensors.update(extra_tensors or {})

    def write(path: Path, names) -> int:
        save_file({n: tensors[n] for n in names}, str(path), metadata={"format": "pt"})
        return sum(tensors[n].nbytes for n in names)

    if max_shard_bytes is None:
        write(out / "model.safetensors", list(tensors))
    else:
        sizes = {name: t.nbytes for name, t in tensors.items()}
        write_shards(out, shard_plan(sizes, max_shard_bytes), write)
    (out / "config.json").write_text(json.dumps({**hf_config, "dtype": dtype}, indent=2))
    return out


def make_hf_checkpoint(
    out_dir: str | os.PathLike,
    hf_config: dict[str, Any],
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> Path:
    """Build the model with transformers' own classes and `save_pretrained` it (needs torch).

    Norm weights and the V3/GLM expert-score correction bias are randomised too (transformers
    initialises them to 1 and 0, which would leave those code paths untested)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(hf_config["model_type"], **kwargs)
    config.architectures = hf_config["architectures"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(out_dir), **kw)
    return Path(out_dir)


def ensure_default_checkpoints(root: str | os.PathLike = ".checkpoints") -> dict[str, Path]:
    """The embedded default: one numpy-written tiny checkpoint per family under `root`,
    written only if missing. Returns {family: path}."""
    paths = {}
    for family, cfg in TINY_HF_CONFIGS.items():
        path = Path(root) / family
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            write_random_checkpoint(path, cfg, seed=0)
        paths[family] = path
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".checkpoints", help="folder for one subfolder per family")
    ap.add_argument("--hf", action="store_true", help="write with transformers (needs torch)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for family, cfg in {**TINY_HF_CONFIGS, **TINY_GQA_CONFIGS}.items():
        path = Path(args.out) / family
        if args.hf:
            make_hf_checkpoint(path, cfg, seed=args.seed)
        else:
            write_random_checkpoint(path, cfg, seed=args.seed)
        print(f"{family}: {path}")


if __name__ == "__main__":
    main()
