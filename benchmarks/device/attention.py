"""(b') Ragged paged attention of one layer against the HBM floor, measured in the same run.

    python -m benchmarks.device.attention --out attention.json [--smoke] [--budget S]

One layer of V2-Lite's cache as the paged state stores it (bf16 `c_kv` [P, 16, 512] as raw
bits, fp32 `k_pe` [P, 16, 64]; 16 heads, absorbed form). Decode steps: C rows of one query
each over `context` cached tokens, every row's pages scattered over the pool; a prefill chunk:
one row of `attention_chunk` queries at the end of the first context. Timed: the dispatch
`ragged_paged_attention` jitted (impl None: the platform's kernel; each row names the kernel
call its lowered program holds) and, on an accelerator, the jnp path beside it. Bytes = the
cache rows the step must read, C x context x (R x 2 B + Dr x 4 B); floor = bytes / the copy
bandwidth measured here (target for decode at 32k: >= 0.5 of it). Each row also gives the
largest error of row 0's output against float64 numpy over the same pages, relative to its
largest magnitude.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.device import measure, report
from benchmarks.device.shapes import sizes
from benchmarks.device.splice import kernel_in
from leyline_jax.allocator import pages_for
from leyline_jax.loader import config_from_hf
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


def step_args(config, c: int, context: int, queries: int, ps: int, seed: int = 0):
    """One step's arrays: c rows of `queries` queries at the end of `context` tokens."""
    r, dr, n = config.kv_lora_rank, config.qk_rope_head_dim, config.num_attention_heads
    w = pages_for(context, ps)
    pages = c * w
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    c_kv = jax.random.normal(k1, (pages, ps, r), jnp.bfloat16)
    c_kv = jax.lax.bitcast_convert_type(c_kv, jnp.uint16)
    k_pe = jax.random.normal(k2, (pages, ps, dr), jnp.float32)
    t = c * queries
    q_lat = jax.random.normal(k3, (t, n, r), jnp.float32)
    q_pe = jax.random.normal(k4, (t, n, dr), jnp.float32)
    table = np.random.default_rng(seed).permutation(pages).reshape(c, w).astype(np.int32)
    meta = (
        jnp.full((c,), context, jnp.int32),
        jnp.asarray(table),
        jnp.arange(c + 1, dtype=jnp.int32) * queries,
        jnp.array([c], jnp.int32),
    )
    return (q_lat, q_pe, c_kv, k_pe, *meta)


def row0_error(out, args, scale: float, queries: int) -> float:
    """Row 0's output against float64 numpy over its pages, relative to its largest value."""
    q_lat, q_pe, c_kv, k_pe, kv_lens, table = (np.asarray(a) for a in args[:6])
    kv, ps = int(kv_lens[0]), c_kv.shape[1]
    s = np.arange(kv)
    pages = table[0, s // ps]
    c = np.asarray(
        jax.lax.bitcast_convert_type(jnp.asarray(c_kv[pages, s % ps]), jnp.bfloat16), np.float64
    )
    k = k_pe[pages, s % ps].astype(np.float64)
    scores = scale * (q_lat[:queries].astype(np.float64) @ c.T + q_pe[:queries] @ k.T)
    pos = kv - queries + np.arange(queries)
    scores = np.where((s[None, :] <= pos[:, None])[:, None, :], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ c
    got = np.asarray(out[:queries], np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def main(argv=None) -> None:
    args = report.parser(__doc__.splitlines()[0]).parse_args(argv)
    sz = sizes(args.smoke)
    with report.Part("attention", args) as part:
        config = config_from_hf(sz.hf)
        scale = config.softmax_scale
        bw = harness.copy_bandwidth(sz.copy_bytes, iters=10, fresh=True)
        part.set(device=measure.device_info(), copy_bandwidth=bw, page_size=sz.page_size)
        kw = dict(scale=scale, kv_dtype=jnp.bfloat16)
        cases = [
            ("decode", c, ctx, 1) for ctx in sz.attention_contexts for c in sz.attention_batches
        ]
        cases.append(("prefill", 1, sz.attention_contexts[0], sz.attention_chunk))
        per_token = config.kv_lora_rank * 2 + config.qk_rope_head_dim * 4
        for kind, c, ctx, queries in part.each(cases, "{}"):
            a = step_args(config, c, ctx, queries, sz.page_size)
            fn = jax.jit(lambda *x: ragged_paged_attention(*x, **kw))
            kernel = kernel_in(fn.lower(*a).as_text())
            arms = [(None, kernel)] + ([("jnp", None)] if kernel else [])
            for impl, name in arms:
                f = (
                    fn
                    if impl is None
                    else jax.jit(lambda *x: ragged_paged_attention(*x, impl="jnp", **kw))
                )
                samples = harness.times(lambda f=f, a=a: f(*a), repeats=5 if impl is None else 3)
                t = statistics.median(samples)
                nbytes = c * ctx * per_token
                row = dict(kind=kind, batch=c, context=ctx, queries=queries, impl=impl)
                row |= dict(kernel=name, step_s=t, samples_s=samples, bytes=nbytes)
                row |= dict(fraction_of_copy_bw=nbytes / t / bw["bytes_s"])
                part.add(row | dict(error_row0=row0_error(f(*a), a, scale, queries)))
            del a


if __name__ == "__main__":
    main()
