"""Shared benchmark helpers: medians, machine floors measured in the same run, configs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.tiny import TINY_HF_CONFIGS

# DeepSeek-V2-Lite attention shapes with few layers. Dense MLPs (intermediate 4096) and a 32k
# vocabulary keep CPU runs short; attention and the cache are what these benchmarks measure.
BENCH_HF_CONFIG = dict(
    TINY_HF_CONFIGS["deepseek_v2"],
    vocab_size=32000,
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    intermediate_size=4096,
    num_hidden_layers=2,
    first_k_dense_replace=2,
    max_position_embeddings=163840,  # = factor x original, as V2-Lite
    initializer_range=0.02,
    rope_scaling=dict(
        type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
)


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` in seconds (results are blocked on)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of an in-place elementwise pass (read + write counted), median of 5. The buffer
    is donated so no fresh output pages are faulted in inside the timed region."""
    step = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    box = {"x": jnp.ones((nbytes // 4,), jnp.float32)}

    def run():
        box["x"] = step(box["x"])
        return box["x"]

    return 2 * nbytes / median_time(run)


def measure_read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of a reduction over a buffer (read only), median of 5."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return nbytes / median_time(lambda: total(x))


def measure_matmul_rate(n: int = 2048) -> float:
    """fp32 flop/s of an n x n x n matmul, median of 5."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    return 2 * n**3 / median_time(lambda: mm(a))
