"""(b') Ragged paged attention of one layer against the HBM floor, measured in the same run.

    python -m benchmarks.device.attention --out attention.json [--smoke] [--quick] [--budget S]

One layer of V2-Lite's cache as the paged state stores it (bf16 `c_kv` [P, 16, 512] as raw
bits, fp32 `k_pe` [P, 16, 64]; 16 heads, absorbed form). Decode steps: C rows of one query
each over `context` cached tokens, every row's pages scattered over the pool; a prefill chunk
(outside --quick): one row of `attention_chunk` queries at the end of the first context. Timed:
the public entry `ragged_paged_attention` jitted (impl None: the platform's kernel, whatever it
is; each row names the kernel call its lowered program holds) with the keyword arguments
`schedule_kwargs` makes on the host from the step's metadata (none today) and, on an
accelerator outside --quick, the jnp path beside it. Bytes = the cache rows the step must read,
C x context x (R x 2 B + Dr x 4 B); fraction = bytes / time / the copy bandwidth measured here
(targets at 32k context, issue 49: >= 0.6 at C >= 32, >= 0.25 at C = 1). Each row also gives the
largest error of row 0's output against float64 numpy over the same pages, relative to its
largest magnitude.
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.device import measure, report
from benchmarks.device.measure import kernel_in
from benchmarks.device.shapes import sizes
from leyline_jax.allocator import pages_for
from leyline_jax.loader import config_from_hf
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


def schedule_kwargs(config, meta: tuple[np.ndarray, ...]) -> dict:
    """HOOK: keyword arguments of `ragged_paged_attention` made on the host from a step's
    metadata (`meta`: kv_lens, page_indices, cu_q_lens, num_rows as numpy arrays), passed to
    every timed call of the default path as traced arguments of its jitted step (arrays, or
    pytrees of arrays). Returns {}: the entry point takes no schedule today. Where the split-KV
    decode attention takes a host-computed split schedule, make it here and return it under the
    keyword the entry point names; the rows then record the keywords given (`schedule`)."""
    del config, meta
    return {}


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _random_arrays(key, pages: int, ps: int, r: int, dr: int, t: int, n: int):
    """c_kv (bf16 as bits), k_pe, q_lat, q_pe of standard deviation 1, in one program (eager
    normals compiled a program per op: seconds of the CPU smoke)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    half = 3**0.5  # uniform on [-half, half]: standard deviation 1

    def draw(k, shape, dtype):
        return jax.random.uniform(k, shape, dtype, -half, half)

    c_kv = jax.lax.bitcast_convert_type(draw(k1, (pages, ps, r), jnp.bfloat16), jnp.uint16)
    k_pe = draw(k2, (pages, ps, dr), jnp.float32)
    return c_kv, k_pe, draw(k3, (t, n, r), jnp.float32), draw(k4, (t, n, dr), jnp.float32)


def step_args(config, c: int, context: int, queries: int, ps: int, seed: int = 0):
    """One step's arrays: c rows of `queries` queries at the end of `context` tokens."""
    r, dr, n = config.kv_lora_rank, config.qk_rope_head_dim, config.num_attention_heads
    w = pages_for(context, ps)
    pages = c * w
    key = jax.random.key(seed, impl="rbg")
    c_kv, k_pe, q_lat, q_pe = _random_arrays(key, pages, ps, r, dr, c * queries, n)
    table = np.random.default_rng(seed).permutation(pages).reshape(c, w).astype(np.int32)
    meta = (
        np.full((c,), context, np.int32),
        table,
        np.arange(c + 1, dtype=np.int32) * queries,
        np.array([c], np.int32),
    )
    return (q_lat, q_pe, c_kv, k_pe, *map(jnp.asarray, meta)), meta


def row0_error(out, args, scale: float, queries: int) -> float:
    """Row 0's output against float64 numpy over its pages, relative to its largest value (only
    row 0's pages leave the device)."""
    kv = int(args[4][0])
    ps = args[2].shape[1]
    pages = args[5][0, : pages_for(kv, ps)]
    bits = args[2][pages].reshape(-1, args[2].shape[-1])[:kv]
    c = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.bfloat16), np.float64)
    k = np.asarray(args[3][pages].reshape(-1, args[3].shape[-1])[:kv], np.float64)
    q_lat = np.asarray(args[0][:queries], np.float64)
    q_pe = np.asarray(args[1][:queries], np.float64)
    scores = scale * (q_lat @ c.T + q_pe @ k.T)
    s = np.arange(kv)
    pos = kv - queries + np.arange(queries)
    scores = np.where((s[None, :] <= pos[:, None])[:, None, :], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ c
    got = np.asarray(out[:queries], np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def main(argv=None) -> None:
    args = report.parser(__doc__.splitlines()[0]).parse_args(argv)
    sz = sizes(args.smoke, args.quick)
    with report.Part("attention", args) as part:
        config = config_from_hf(sz.hf)
        scale = config.softmax_scale
        bw = harness.copy_bandwidth(sz.copy_bytes, iters=10, fresh=True)
        part.set(device=measure.device_info(), copy_bandwidth=bw, page_size=sz.page_size)
        kw = dict(scale=scale, kv_dtype=jnp.bfloat16)
        cases = [
            ("decode", c, ctx, 1) for ctx in sz.attention_contexts for c in sz.attention_batches
        ]
        if sz.attention_chunk:
            cases.append(("prefill", 1, sz.attention_contexts[0], sz.attention_chunk))
        per_token = config.kv_lora_rank * 2 + config.qk_rope_head_dim * 4
        default = jax.jit(lambda a, s: ragged_paged_attention(*a, **s, **kw))
        beside = jax.jit(lambda a, s: ragged_paged_attention(*a, impl="jnp", **kw))
        for kind, c, ctx, queries in part.each(cases, "{}"):
            a, meta = step_args(config, c, ctx, queries, sz.page_size)
            schedule = schedule_kwargs(config, meta)
            kernel = kernel_in(default.lower(a, schedule).as_text())
            arms = [(None, kernel, default, sz.attention_repeats)]
            arms += [("jnp", None, beside, 3)] if kernel and sz.beside_jnp else []
            for impl, name, f, repeats in arms:
                samples = harness.times(lambda f=f, a=a, s=schedule: f(a, s), repeats=repeats)
                t = statistics.median(samples)
                nbytes = c * ctx * per_token
                row = dict(kind=kind, batch=c, context=ctx, queries=queries, impl=impl)
                row |= dict(kernel=name, step_s=t, samples_s=samples, bytes=nbytes)
                row |= dict(fraction_of_copy_bw=nbytes / t / bw["bytes_s"])
                row |= dict(schedule=sorted(schedule) if impl is None else [])
                part.add(row | dict(error_row0=row0_error(f(a, schedule), a, scale, queries)))
            del a


if __name__ == "__main__":
    main()
