"""Peak host memory of loading a DeepSeek-V2-Lite-shaped random checkpoint: streaming vs eager.

Writes a random bf16 checkpoint at V2-Lite's real shapes (`checkpoints.random_hf`, `--layers`
decoder layers) under `--dir`, then loads it as bf16 in a fresh process per loader and reports
the growth of its peak resident memory (`VmHWM`, Linux) over the same process's peak after
importing jax and starting its backend, beside the model's placed size and the largest tensor:

- `stream`: `leyline_jax.load_model` (each param read, built, placed, its host copy dropped);
- `eager`: the composition the loader was before streaming, from the same public functions:
  `read_safetensors` (every tensor) + `convert_hf_params` (every param) + `model_from_params`.

On CPU the placed params live in host memory, so they count; the streaming loader's stated
bound is placed + 2 x the largest tensor or param (see `load_model`). The checkpoint is deleted
afterwards (unless `--keep`).

    python -m benchmarks.load_bench [--layers 4] [--dir /tmp/leyline_load_bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

from checkpoints.random_hf import DTYPES, v2_lite_config, write_random_hf
from leyline_jax.loader import config_from_hf, hf_tensor_shapes

RESULTS = Path(__file__).with_name("results_load.json")
LOADERS = ("stream", "eager")


def _child(how: str, path: str) -> None:
    """Runs in the fresh process: load once, print one JSON line of what it measured."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from leyline_jax import loader, safetensors

    def peak() -> int:
        """Bytes: the peak resident set of this process since it started (`VmHWM`). Not
        `ru_maxrss`: Linux carries that across exec from the parent at fork time, so a child of
        a big process (a pytest run) would start at its parent's peak."""
        return _proc_bytes("/proc/self/status", "VmHWM")

    jax.devices()  # the backend starts before the baseline, not inside the load
    baseline = peak()
    t0 = time.perf_counter()
    if how == "stream":
        model = loader.load_model(path, jnp.bfloat16, progress=False)
    else:
        config = loader.config_from_hf(path)
        tensors = safetensors.read_safetensors(path, progress=False)
        params = loader.convert_hf_params(config, tensors, jnp.bfloat16)
        model = loader.model_from_params(config, params, jnp.bfloat16)
        del tensors, params
    seconds = time.perf_counter() - t0
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    row = {
        "loader": how,
        "baseline_bytes": baseline,
        "peak_bytes": peak(),
        "growth_bytes": peak() - baseline,
        "placed_bytes": sum(p.nbytes for p in params),
        "largest_param_bytes": max(p.nbytes for p in params),
        "seconds": round(seconds, 2),
    }
    print(json.dumps(row))


def measure(loader: str, path: str | Path) -> dict:
    """One load of `path` (bf16) by `loader` in a fresh process: its peak-memory row."""
    if loader not in LOADERS:
        raise ValueError(f"loader {loader!r}: one of {LOADERS}")
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.load_bench", "--child", loader, str(path)],
        cwd=Path(__file__).resolve().parents[1],  # where `benchmarks` imports from
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def largest_tensor_bytes(hf_config: dict, dtype: str = "bf16") -> int:
    """The largest tensor of a `write_random_hf` checkpoint (every tensor in `dtype`)."""
    shapes = hf_tensor_shapes(config_from_hf(hf_config)).values()
    return max(math.prod(s) for s in shapes) * DTYPES[dtype][1]


def _proc_bytes(path: str, key: str) -> int:
    """The `key:` line of a /proc file (Linux reports it in kB), in bytes."""
    with open(path) as f:
        line = next(line for line in f if line.startswith(f"{key}:"))
    return int(line.split()[1]) << 10


# what each loader needs, as a multiple of the checkpoint (measured here: ~1.1x and ~3.5x), plus
# a margin: a loader the machine's free memory cannot hold is skipped, not run into the OOM killer
NEEDS = {"stream": 1.5, "eager": 4.0}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dir", default="/tmp/leyline_load_bench")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--child", nargs=2, metavar=("LOADER", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(*args.child)

    path = Path(args.dir)
    hf_config = v2_lite_config(args.layers)
    largest = largest_tensor_bytes(hf_config)
    rows = []
    try:
        t0 = time.perf_counter()
        write_random_hf(path, hf_config, dtype="bf16")
        write_s = time.perf_counter() - t0
        disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        for loader in LOADERS:
            need, free = NEEDS[loader] * disk, _proc_bytes("/proc/meminfo", "MemAvailable")
            if need > free:
                rows.append({"loader": loader, "skipped": f"needs ~{need:.3g} B, {free:.3g} free"})
                continue
            row = measure(loader, path)
            big = max(largest, row["largest_param_bytes"])
            row["bound_bytes"] = row["placed_bytes"] + 2 * big
            row["within_bound"] = row["growth_bytes"] <= row["bound_bytes"]
            row["growth_over_placed"] = round(row["growth_bytes"] / row["placed_bytes"], 3)
            rows.append(row)
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python -m benchmarks.load_bench --layers {args.layers}",
        "config": f"DeepSeek-V2-Lite shapes, {args.layers} layers, bf16 on disk, loaded as bf16",
        "checkpoint_bytes": disk,
        "largest_tensor_bytes": largest,
        "write_seconds": round(write_s, 1),
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    gib = 2**30
    print(f"checkpoint {disk / gib:.2f} GiB, largest tensor {largest / gib:.3f} GiB")
    for row in rows:
        if "skipped" in row:
            print(f"{row['loader']:>6}: skipped ({row['skipped']})")
            continue
        print(
            f"{row['loader']:>6}: peak growth {row['growth_bytes'] / gib:.2f} GiB "
            f"(placed {row['placed_bytes'] / gib:.2f}, bound {row['bound_bytes'] / gib:.2f}, "
            f"{row['growth_over_placed']}x placed) in {row['seconds']} s"
        )


if __name__ == "__main__":
    main()
