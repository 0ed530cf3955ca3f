"""What the jax parts share: the device's description, timing, the machine's rates measured in
the same run, and a random model made on the device."""

from __future__ import annotations

import functools
import importlib.metadata
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.device.shapes import SPEC_PEAKS
from leyline_jax.loader import model_from_params
from leyline_jax.model import CausalLM


def device_info() -> dict:
    d = jax.devices()[0]
    return dict(
        platform=d.platform,
        device_kind=d.device_kind,
        device_count=jax.device_count(),
        jax=jax.__version__,
        jaxlib=importlib.metadata.version("jaxlib"),
        spec_peaks=SPEC_PEAKS.get(d.device_kind),
    )


def times(fn: Callable[[], object], *, repeats: int, warmup: int = 1, iters: int = 1) -> list:
    """Seconds per call of `fn()`, `repeats` samples after `warmup` calls. A sample issues
    `iters` calls back to back and blocks once at the end: dispatch is asynchronous, so the
    device stays busy and a sub-millisecond pass is not charged the host's launch latency."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            result = fn()
        jax.block_until_ready(result)
        out.append((time.perf_counter() - t0) / iters)
    return out


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of `fn()`, its result blocked on."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def copy_bandwidth(nbytes: int, iters: int = 10) -> dict:
    """Bytes/s of read + write passes over `nbytes` (fp32 `x + 1`), medians of 5: in place on a
    donated buffer, and into a fresh one. `bytes_s` is the better of the two: the reference a
    splice's bandwidth is a fraction of."""
    n = nbytes // 4
    inplace = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    fresh = jax.jit(lambda a: a + 1.0)
    box = {"x": jnp.zeros((n,), jnp.float32)}

    def run_inplace():
        box["x"] = inplace(box["x"])
        return box["x"]

    src = jnp.zeros((n,), jnp.float32)
    rates = {
        "inplace_bytes_s": 2
        * n
        * 4
        / statistics.median(times(run_inplace, repeats=5, iters=iters)),
        "fresh_bytes_s": 2
        * n
        * 4
        / statistics.median(times(lambda: fresh(src), repeats=5, iters=iters)),
    }
    return {"bytes": 2 * n * 4, **rates, "bytes_s": max(rates.values())}


def matmul_rate(n: int, iters: int = 5) -> float:
    """bf16 flop/s of an n x n x n matmul of random values (a GPU runs zeros faster), median
    of 5 samples."""
    a = jax.random.uniform(jax.random.key(0, impl="rbg"), (n, n), jnp.bfloat16, -1.0, 1.0)
    mm = jax.jit(lambda x: x @ x)
    return 2 * n**3 / statistics.median(times(lambda: mm(a), repeats=5, iters=iters))


@functools.partial(jax.jit, static_argnums=1)
def _random_params(key, specs, std) -> list:
    """One array per (shape, dtype, is_norm) of `specs`, all in one program: one compile (a
    program per shape, or normals' erfinv, cost the CPU smoke seconds of compiling)."""
    keys = jax.random.split(key, len(specs))
    half = std * 3**0.5  # uniform on [-half, half] has standard deviation std
    return [
        jnp.ones(shape, dtype)
        if norm
        else jax.random.uniform(k, shape, jnp.float32, -half, half).astype(dtype)
        for (shape, dtype, norm), k in zip(specs, keys, strict=True)
    ]


def random_model(config, dtype=jnp.bfloat16, *, std: float = 0.02, seed: int = 0) -> CausalLM:
    """A model of `config` with random weights made on the default device from the abstract
    model's shapes (nothing is built on the host): norms 1, everything else uniform with
    standard deviation `std` (0.02, V2-Lite's initializer_range: 27 layers of bf16 activations
    stay finite; the generator is XLA's own, "rbg", quick to compile and to run). The
    routers' weights are random too, so tokens spread over the experts as a trained router
    spreads them rather than all picking the same few."""
    abstract = nnx.eval_shape(lambda: CausalLM(config, dtype))
    spec = nnx.to_pure_dict(nnx.split(abstract)[1])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(spec)
    specs = tuple(
        (tuple(leaf.shape), jnp.dtype(leaf.dtype), "norm" in jax.tree_util.keystr(path))
        for path, leaf in leaves
    )
    params = _random_params(jax.random.key(seed, impl="rbg"), specs, std)
    return model_from_params(config, jax.tree_util.tree_unflatten(treedef, params), dtype)
