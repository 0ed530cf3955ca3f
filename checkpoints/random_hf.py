"""Random Hugging Face checkpoints at real model sizes, written without holding them in memory.

`write_random_hf(out, hf_config)` writes `config.json`, sharded
`model-0000X-of-0000N.safetensors` files and `model.safetensors.index.json` for any supported
config; `v2_lite_config(layers)` is DeepSeek-V2-Lite's own `config.json` (hidden 2048, 16 heads,
kv_lora_rank 512, no q_lora, 64 routed experts top-6 of a softmax greedy router, 2 shared
experts, one dense first layer, YaRN x40, vocabulary 102400) with any layer count. So loading,
memory and speed can be exercised at real shapes without downloading weights.

Streaming: each shard's header is written first, from the tensor table's shapes
(`leyline_jax.loader.hf_tensor_shapes`), then each tensor's bytes a chunk at a time, so memory
stays at one chunk (`CHUNK` values) whatever the model's size.

Values are random bit patterns, not floats computed one by one (a normal draw plus a bfloat16
cast runs at ~20 M values/s here; this runs at ~300 M/s): a random sign and mantissa with one of
four exponents, so |w| lies in [2^-8, 2^-4) (rms ~0.027, like `initializer_range` 0.02) and a
forward stays finite. Norm weights are 1, expert-score correction biases 0.

Command line: `python -m checkpoints.random_hf OUT --layers N [--dtype bf16|fp32]`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from leyline_jax.loader import config_from_hf, hf_tensor_shapes

# deepseek-ai/DeepSeek-V2-Lite's config.json (training-only fields left out), as a file so that
# the device suite (which imports no jax in its Hugging Face process) reads the same one
V2_LITE_CONFIG: dict[str, Any] = json.loads(
    (Path(__file__).parent / "v2_lite_config.json").read_text()
)

# name on the command line -> (safetensors dtype, bytes per value, config.json's dtype)
DTYPES = {"bf16": ("BF16", 2, "bfloat16"), "fp32": ("F32", 4, "float32")}

CHUNK = 1 << 22  # values generated and written at a time


def v2_lite_config(layers: int) -> dict[str, Any]:
    """DeepSeek-V2-Lite's config with `layers` decoder layers (layer 0 dense, the rest MoE)."""
    return dict(V2_LITE_CONFIG, num_hidden_layers=layers)


def _bf16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """u16[n]: bfloat16 bit patterns, a random sign and mantissa, exponent 2^-8 .. 2^-5."""
    r = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    return (r & 0x807F) | ((119 + ((r >> 7) & 3)) << 7)


def _chunks(rng: np.random.Generator, name: str, size: int, dtype: str):
    """The bit patterns of one tensor of `size` values (u16 for bf16, u32 for fp32), `CHUNK`
    values at a time."""
    for start in range(0, size, CHUNK):
        n = min(CHUNK, size - start)
        if name.endswith("norm.weight"):
            bits = np.full(n, 0x3F80, np.uint16)  # 1.0
        elif name.endswith("e_score_correction_bias"):
            bits = np.zeros(n, np.uint16)
        else:
            bits = _bf16_bits(rng, n)
        # fp32: the same values, widened (a bfloat16's bits are a float32's top half)
        yield bits if dtype == "bf16" else bits.astype(np.uint32) << 16


def shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in table order, each shard at most `max_shard_bytes` (or one
    tensor, if a tensor alone is larger); `sizes`: each tensor's bytes."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shard(path: Path, names, shapes, dtype: str, rng: np.random.Generator) -> int:
    """One safetensors file: the header (data offsets from the shapes), then each tensor's
    bytes. Returns the data size."""
    st_dtype, itemsize, _ = DTYPES[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = math.prod(shapes[name]) * itemsize
        header[name] = {
            "dtype": st_dtype,
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            for chunk in _chunks(rng, name, math.prod(shapes[name]), dtype):
                f.write(chunk)
    return offset


def write_shards(out: Path, shards: list[list[str]], write: Callable[[Path, list], int]) -> None:
    """Each shard's file, `model-0000i-of-0000N.safetensors` (`write(path, names)` writes it and
    returns its data size), then `model.safetensors.index.json`."""
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write(out / fname, names)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_random_hf(
    out_dir: str | os.PathLike,
    hf_config: dict[str, Any],
    *,
    dtype: str = "bf16",
    seed: int = 0,
    max_shard_bytes: int = 1 << 30,
) -> Path:
    """Write a random checkpoint of `hf_config` (every tensor in `dtype`: "bf16" or "fp32") to
    `out_dir`, sharded at `max_shard_bytes` with an index, one chunk of values in memory at a
    time. Deterministic in `seed`. Returns `out_dir` as a `Path`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = hf_tensor_shapes(config_from_hf(hf_config))
    rng = np.random.default_rng(seed)
    sizes = {name: math.prod(shape) * DTYPES[dtype][1] for name, shape in shapes.items()}
    plan = shard_plan(sizes, max_shard_bytes)
    write_shards(out, plan, lambda path, names: _write_shard(path, names, shapes, dtype, rng))
    config_json = {**hf_config, "dtype": DTYPES[dtype][2]}
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the checkpoint folder to write")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers (V2-Lite has 27)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-mib", type=int, default=1024, help="largest shard, in MiB")
    args = ap.parse_args(argv)
    path = write_random_hf(
        args.out,
        v2_lite_config(args.layers),
        dtype=args.dtype,
        seed=args.seed,
        max_shard_bytes=args.shard_mib << 20,
    )
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"{path}: {args.layers} layers, {size / 2**30:.2f} GiB of {args.dtype} tensors")


if __name__ == "__main__":
    main()
