"""AMORTIZE splice vs FORGET re-prefill, against the splice's byte floor, in one run.

    python -m benchmarks.splice_bench [--lengths 512,2048,8192,32768] [--out splice.json]
        [--repeats 3] [--splice-only]

Bench config (DeepSeek-V2-Lite attention shapes, 2 layers; `benchmarks.common`), fp32 params,
default cache dtypes (bf16 `c_kv`, fp32 `k_pe`), page size 16. Sequence: a 1024-token prefix,
a 64-token span, then D downstream tokens. The directive replaces the span by a 16-token stub.

- `splice`: the fused move+rotate pass alone (the directive's jitted splice step: `splice_rotate`
  over the plan's slots in each layer's pool).
- `amortize`: `apply_directive(..., AMORTIZE)` end to end: host planning, the splice, and the
  stub's prefill.
- `forget`: re-prefilling stub + downstream after the prefix, which is what FORGET (and a prefix
  cache that ends at the first changed token) pays.
- floor: D x layers x (kv_lora_rank x 2 B + qk_rope_head_dim x 4 B) x 2 (read + write) over
  the copy bandwidth measured in the same run.

The downstream KV is filled with random values through the state's own append path (its values do
not change the cost of moving it); the prefix and stub go through the model. Medians of
`--repeats` runs after a warm-up; re-prefill of 8k tokens and more runs once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from benchmarks.common import BENCH_HF_CONFIG, measure_copy_bandwidth, median_time
from checkpoints.tiny import write_random_checkpoint
from leyline_jax import directives as dv
from leyline_jax import kv_state as kv
from leyline_jax.model import _inv_freq
from pallas_kernels.splice_rotate import phase_table

PREFIX, SPAN, STUB, PAGE = 1024, 64, 16, 16


@jax.jit
def _random_kv(pools, slots, key):
    """Write random KV at `slots` (i32[n]) in every layer (no model)."""
    for layer in range(pools.num_layers):
        k1, k2, key = jax.random.split(key, 3)
        c = jax.random.normal(k1, (*slots.shape, pools.moved[0].shape[-1]))
        k = jax.random.normal(k2, (*slots.shape, pools.rotated[0].shape[-1]))
        pools = kv.write_kv(pools, layer, slots, c, k)
    return pools


def _append_random(state, seq: int, tokens, key):
    """Reserve slots for `tokens` (host bookkeeping) and write random KV there."""
    state, plan = kv.append(state, [seq], [np.asarray(tokens, np.int32)])
    return state.replace(pools=_random_kv(state.pools, jnp.asarray(plan.slots[0]), key))


def build(model, downstream: int):
    """A state holding prefix + span (through the model) + `downstream` random tokens."""
    c = model.config
    total = PREFIX + SPAN + downstream + STUB
    state = ll.init_state(
        c,
        num_pages=2 * (total // PAGE) + 8,
        page_size=PAGE,
        max_seqs=2,
        max_seq_len=(total // PAGE + 2) * PAGE,
    )
    rng = np.random.default_rng(0)
    state, _ = ll.prefill(model, state, 0, rng.integers(0, c.vocab_size, PREFIX + SPAN))
    toks = rng.integers(0, c.vocab_size, downstream)
    return _append_random(state, 0, toks, jax.random.PRNGKey(0))


def time_amortize(model, downstream: int, repeats: int) -> float:
    directive = ll.Directive(PREFIX, PREFIX + SPAN, list(range(STUB)))
    times = []
    for i in range(repeats + 1):  # the first run compiles
        state = jax.block_until_ready(build(model, downstream))
        t0 = time.perf_counter()
        state = jax.block_until_ready(ll.apply_directive(model, state, 0, directive))
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_splice_only(model, downstream: int, repeats: int) -> float:
    """The move+rotate pass alone over the same slot counts (fresh pages after the old ones)."""
    c = model.config
    state = build(model, downstream)
    first = (PREFIX // PAGE) * PAGE
    old = np.asarray(state.page_table)[0]
    i = np.concatenate(
        [np.arange(first, PREFIX), np.arange(PREFIX + SPAN, PREFIX + SPAN + downstream)]
    )
    j = np.where(i < PREFIX, i, i - SPAN + STUB)
    free = np.flatnonzero(np.asarray(state.refcount) == 0)
    row = np.concatenate([old[: first // PAGE], free])
    src = jnp.asarray(old[i // PAGE] * PAGE + i % PAGE, jnp.int32)
    dst = jnp.asarray(row[j // PAGE] * PAGE + j % PAGE, jnp.int32)
    inv = jnp.asarray(_inv_freq(c))
    table = phase_table(inv, state.max_seq_len)  # what apply_directive looks rotations up in
    box = {"pools": state.pools}
    pos_from, pos_to = jnp.asarray(i, jnp.int32), jnp.asarray(j, jnp.int32)

    def run():  # the step apply_directive runs: `splice_rotate` on each layer's pool, donated
        box["pools"] = dv._splice_step(
            box["pools"], src, dst, pos_from, pos_to, inv, table, impl="jnp"
        )
        return box["pools"].rotated[-1]

    return median_time(run, repeats=repeats)


def time_reprefill(model, downstream: int, repeats: int) -> float:
    c = model.config
    rng = np.random.default_rng(1)
    tail = rng.integers(0, c.vocab_size, STUB + downstream)
    times = []
    for i in range(repeats + 1):
        state = ll.init_state(
            c,
            num_pages=(PREFIX + STUB + downstream) // PAGE + 4,
            page_size=PAGE,
            max_seqs=1,
            max_seq_len=((PREFIX + STUB + downstream) // PAGE + 2) * PAGE,
        )
        state, _ = ll.prefill(model, state, 0, rng.integers(0, c.vocab_size, PREFIX))
        state = jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, logits = ll.prefill(model, state, 0, tail)
        jax.block_until_ready(logits)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--splice-only", action="store_true", help="time the move+rotate pass alone (fast)"
    )
    args = ap.parse_args(argv)
    bw = measure_copy_bandwidth()
    print(
        f"machine: copy bandwidth {bw / 1e9:.1f} GB/s (in place, read + write); "
        f"jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(BENCH_HF_CONFIG)
        model = ll.load_model(write_random_checkpoint(os.path.join(tmp, "bench"), cfg))
        c = model.config
        for d in (int(x) for x in args.lengths.split(",")):
            per_token = c.num_hidden_layers * (c.kv_lora_rank * 2 + c.qk_rope_head_dim * 4)
            floor = d * per_token * 2 / bw
            splice = time_splice_only(model, d, args.repeats)
            if args.splice_only:
                print(
                    f"D={d:6d} floor {floor * 1e3:8.3f} ms | splice {splice * 1e3:8.3f} ms "
                    f"({splice / floor:.1f}x floor)",
                    flush=True,
                )
                rows.append(
                    dict(
                        downstream=d,
                        floor_s=floor,
                        splice_s=splice,
                        splice_over_floor=splice / floor,
                    )
                )
                continue
            amortize = time_amortize(model, d, args.repeats)
            forget = time_reprefill(model, d, 1 if d >= 8192 else args.repeats)
            rows.append(
                dict(
                    downstream=d,
                    floor_s=floor,
                    splice_s=splice,
                    amortize_s=amortize,
                    forget_s=forget,
                    splice_over_floor=splice / floor,
                    amortize_over_floor=amortize / floor,
                    forget_over_amortize=forget / amortize,
                )
            )
            r = rows[-1]
            print(
                f"D={d:6d} floor {floor * 1e3:8.3f} ms | splice {splice * 1e3:8.3f} ms "
                f"({r['splice_over_floor']:.1f}x floor) | amortize {amortize * 1e3:8.2f} ms "
                f"({r['amortize_over_floor']:.1f}x floor) | forget {forget * 1e3:9.1f} ms "
                f"({r['forget_over_amortize']:.0f}x amortize)",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
