"""Grouped vs dense MoE dispatch at DeepSeek-V2-Lite expert shapes, on this machine's CPU.

    python -m benchmarks.moe_bench [--tokens 1,8,32,128,512] [--dtypes float32,bfloat16]
                                   [--ragged-tokens 1,32] [--crossover]
                                   [--out benchmarks/results_moe.json]

One MoE layer's routed experts as V2-Lite has them (E=64, top-6, hidden 2048, moe_intermediate
1408; random weights, each token's 6 experts drawn uniformly and distinct, as a router gives
them): per dtype and token count T, the step time of `moe_experts_dense` and of
`moe_experts_grouped` (each jitted, compile excluded, their repeats interleaved so that a
neighbour's load on this shared machine falls on both, medians), and what `prefers_grouped`
picks. Beside each time, the active-expert floor measured in the same run: the larger of the
routed flops (2 * 3 * T * k * H * I) over the machine's matmul rate in that dtype (a square
matmul of 2048) and the bytes of the experts the tokens chose (each read once) over its read
bandwidth. At `--ragged-tokens` (fp32) also the grouped dispatch through `jax.lax.ragged_dot`,
which jax lowers on CPU to a dense masked matmul over every expert.

`--crossover` adds the sweep `prefers_grouped` was drawn from: small shapes (E*H*I from 2^14 to
2^21, fp32), T in 1, 16, 256; dense and grouped times and their ratio per point.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from leyline_jax.moe import moe_experts_dense, moe_experts_grouped, prefers_grouped

# DeepSeek-V2-Lite's routed experts
V2_LITE = dict(e=64, k=6, h=2048, i=1408)
# (H, I, E, k) of the crossover sweep: the tiny test configs' experts (64 x 32, E=8) upwards
CROSSOVER = ((64, 32, 8, 2), (64, 32, 8, 6), (64, 32, 16, 2), (128, 64, 8, 2), (64, 32, 32, 4),
             (128, 64, 16, 4), (256, 128, 8, 2), (256, 128, 64, 6))  # fmt: skip
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def experts(rng, e: int, h: int, i: int, dtype):
    """Random gate, up [E, H, I] and down [E, I, H] weights (std 0.02, as an initializer)."""
    shapes = ((e, h, i), (e, h, i), (e, i, h))
    return tuple(jnp.asarray(0.02 * rng.standard_normal(s, np.float32), dtype) for s in shapes)


def routing(rng, t: int, e: int, k: int):
    """f32[T, k] weights, i32[T, k] expert ids: k distinct experts per token, uniformly."""
    idx = np.argsort(rng.random((t, e)), axis=1)[:, :k]
    return jnp.asarray(rng.random((t, k)), jnp.float32), jnp.asarray(idx, jnp.int32)


def auto(e: int, h: int, i: int) -> str:
    """What `prefers_grouped` picks for E experts of H x I."""
    return "grouped" if prefers_grouped(e, h, i) else "dense"


def dispatch_times(x, weights, idx, w, repeats: int, ragged: bool = False) -> list[float]:
    """Median times of the dense and the grouped dispatch (and of grouped through ragged_dot)."""
    fns = [moe_experts_dense, moe_experts_grouped]
    if ragged:
        fns.append(functools.partial(moe_experts_grouped, ragged=True))
    jitted = [jax.jit(fn) for fn in fns]
    calls = {i: lambda f=f: f(x, weights, idx, *w) for i, f in enumerate(jitted)}
    return list(harness.interleaved(calls, repeats).values())


def bench_v2_lite(tokens, dtype_names, ragged_tokens, repeats: int, read_bw: float) -> list[dict]:
    e, k, h, i = V2_LITE["e"], V2_LITE["k"], V2_LITE["h"], V2_LITE["i"]
    rows = []
    for name in dtype_names:
        dtype = DTYPES[name]
        rate = harness.matmul_rate(2048, dtype)
        rng = np.random.default_rng(0)
        w = experts(rng, e, h, i, dtype)
        for t in tokens:
            x = jnp.asarray(rng.standard_normal((t, h), np.float32), dtype)
            weights, idx = routing(rng, t, e, k)
            ragged = name == "float32" and t in ragged_tokens
            dense_s, grouped_s, *ragged_s = dispatch_times(x, weights, idx, w, repeats, ragged)
            ragged_s = ragged_s[0] if ragged else float("nan")
            active = len(np.unique(np.asarray(idx)))
            flop_floor = 2 * 3 * t * k * h * i / rate
            byte_floor = active * 3 * h * i * jnp.dtype(dtype).itemsize / read_bw
            floor = max(flop_floor, byte_floor)
            r = dict(dtype=name, tokens=t, active_experts=active)
            r |= dict(dense_s=dense_s, grouped_s=grouped_s, ragged_dot_s=ragged_s)
            r |= dict(dense_over_grouped=dense_s / grouped_s, flop_floor_s=flop_floor)
            r |= dict(byte_floor_s=byte_floor, matmul_flop_s=rate, auto=auto(e, h, i))
            r |= {f"{k}_over_floor": r[f"{k}_s"] / floor for k in ("dense", "grouped")}
            rows.append(r)
            print(
                f"{name:8s} T={t:4d} active={active:2d} dense {dense_s * 1e3:9.1f} ms  "
                f"grouped {grouped_s * 1e3:8.1f} ms  dense/grouped {r['dense_over_grouped']:5.1f}  "
                f"floor {floor * 1e3:6.1f} ms  dense/floor {r['dense_over_floor']:6.1f}  "
                f"grouped/floor {r['grouped_over_floor']:5.1f}  "
                f"ragged_dot {ragged_s * 1e3:7.1f} ms",
                flush=True,
            )
    return rows


def bench_crossover() -> list[dict]:
    rows = []
    rng = np.random.default_rng(1)
    for h, i, e, k in CROSSOVER:
        w = experts(rng, e, h, i, jnp.float32)
        for t in (1, 16, 256):
            x = jnp.asarray(rng.standard_normal((t, h), np.float32))
            weights, idx = routing(rng, t, e, k)
            dense_s, grouped_s = dispatch_times(x, weights, idx, w, repeats=15)
            r = dict(hidden=h, inter=i, experts=e, k=k, tokens=t, ehi=e * h * i)
            r |= dict(dense_s=dense_s, grouped_s=grouped_s, dense_over_grouped=dense_s / grouped_s)
            rows.append(r | dict(auto=auto(e, h, i)))
            print(
                f"H={h:3d} I={i:3d} E={e:2d} k={k} T={t:3d} E*H*I={e * h * i:7d}  "
                f"dense {dense_s * 1e3:8.3f} ms  grouped {grouped_s * 1e3:8.3f} ms  "
                f"dense/grouped {dense_s / grouped_s:5.2f}  auto {rows[-1]['auto']}",
                flush=True,
            )
    return rows


def main(argv=None) -> None:
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--tokens", default="1,8,32,128,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ragged-tokens", default="1,32")
    ap.add_argument("--crossover", action="store_true", help="also the small-shape sweep")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    start = time.perf_counter()
    read_bw = harness.read_bandwidth()
    print(f"machine: read bandwidth {read_bw / 1e9:.1f} GB/s, {harness.platform()}", flush=True)
    tokens, ragged = ([int(t) for t in a.split(",")] for a in (args.tokens, args.ragged_tokens))
    result = dict(command=" ".join(["python -m benchmarks.moe_bench", *argv]), jax=jax.__version__)
    result |= dict(platform=jax.devices()[0].platform, read_bytes_s=read_bw, shapes=V2_LITE)
    result["v2_lite"] = bench_v2_lite(tokens, args.dtypes.split(","), ragged, args.repeats, read_bw)
    if args.crossover:
        result["crossover"] = bench_crossover()
    result["wall_s"] = time.perf_counter() - start
    print(f"wall {result['wall_s']:.0f} s")
    harness.save_json(args.out, result)


if __name__ == "__main__":
    main()
