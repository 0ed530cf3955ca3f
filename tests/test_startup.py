"""Startup's memory: the server's engine for SmolLM2 with the default pools, warmed up, in a
process of its own (what `python -m serve.http --model smollm2 --warmup` holds once ready); the
weights in the dtype `--dtype` asks for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import UNOPTIMIZED

# What a process holds beyond the params and the KV pools after warmup, at most: the Python and
# JAX runtime, the tokenizer, the compiled programs, XLA's buffers (measured 1.03 GB: BENCHMARKS.md)
OVERHEAD = 1.3e9

SCRIPT = """
import json, re, sys
import jax
from flax import nnx
from serve import compile_cache
from serve.engine import EngineConfig
from serve.http.backend import load_backend

compile_cache.enable(sys.argv[3])  # on, as the server's command line has it by default
backend = load_backend("smollm2", EngineConfig(num_pages=int(sys.argv[1])))
engine = backend.worker.engine
shapes = engine.warmup() if sys.argv[2] == "warmup" else 0
params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(engine.model)))
pools = sum(x.nbytes for x in jax.tree.leaves(engine.state.pools))
peak = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
print(json.dumps(dict(shapes=shapes, params=params, pools=pools, peak=peak)))
"""


def _measure(num_pages: int, warmup: bool, cache) -> dict:
    args = [sys.executable, "-c", SCRIPT, str(num_pages), "warmup" if warmup else "no", str(cache)]
    # as a user runs it: XLA's own settings, not the suite's (tests/conftest.py)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", UNOPTIMIZED)}
    out = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.usefixtures("smollm2_file")
def test_smollm2_after_warmup_fits_its_memory_bound(tmp_path):
    """After warming up every shape (30 at the defaults), the process's peak resident memory is
    at most 2.5 GB, and at most params + KV pools + OVERHEAD. The measure can fail: the same
    process with a pool of 8192 pages (~4.5 GB of KV), not even warmed up, is past 2.5 GB, and
    still within params + pools + OVERHEAD (it follows what the process holds)."""
    r = _measure(512, warmup=True, cache=tmp_path)  # an empty cache: a cold start
    assert r["shapes"] == 30
    assert r["peak"] <= 2.5e9, r
    assert r["peak"] <= r["params"] + r["pools"] + OVERHEAD, r
    big = _measure(8192, warmup=False, cache=tmp_path)
    assert big["peak"] > 2.5e9, big
    assert big["peak"] <= big["params"] + big["pools"] + OVERHEAD, big


def test_the_server_loads_its_weights_in_the_dtype_asked(tmp_path):
    """`--dtype bf16` (`load_backend(dtype=...)`): every param in bfloat16 but the MoE router's
    (kept in float32 by the loader, for routing), half the bytes of the default fp32; a name it
    does not know is refused."""
    import jax
    from flax import nnx

    from serve.http.backend import load_backend

    def params(dtype) -> dict:
        model = load_backend("tiny", root=str(tmp_path), dtype=dtype).worker.engine.model
        flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
        return {jax.tree_util.keystr(k): x for k, x in flat}

    half, full = params("bf16"), params("fp32")
    assert {str(x.dtype) for x in full.values()} == {"float32"}
    router = {k for k in half if "'router'" in k}
    assert router and {str(half[k].dtype) for k in router} == {"float32"}
    rest = set(half) - router
    assert {str(half[k].dtype) for k in rest} == {"bfloat16"}
    assert 2 * sum(half[k].nbytes for k in rest) == sum(full[k].nbytes for k in rest)
    with pytest.raises(ValueError, match="dtype='fp16'"):
        load_backend("tiny", root=str(tmp_path), dtype="fp16")
