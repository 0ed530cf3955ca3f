"""AMORTIZE splice vs FORGET re-prefill, against the splice's byte floor, in one run.

    python -m benchmarks.splice_bench [--lengths 512,2048,8192,32768] [--out splice.json]
        [--repeats 3] [--layers N] [--splice-only | --by-depth 8,30,60 [--rounds 3]]

Bench config (DeepSeek-V2-Lite attention shapes, 2 layers unless `--layers`;
`benchmarks.harness`), fp32 params, default cache dtypes (bf16 `c_kv` stored as bits, fp32
`k_pe`), page size 16. Sequence: a 1024-token prefix, a 64-token span, then D downstream
tokens. The directive replaces the span by a 16-token stub.

- `splice`: the fused move+rotate pass alone (the directive's jitted splice step:
  `splice_rotate` over the plan's runs in every layer's pool).
- `amortize`: `apply_directive(..., AMORTIZE)` end to end: host planning, the splice, and the
  stub's prefill.
- `forget`: re-prefilling stub + downstream after the prefix, which is what FORGET (and a prefix
  cache that ends at the first changed token) pays.
- floor: D x layers x (kv_lora_rank x 2 B + qk_rope_head_dim x 4 B) x 2 (read + write) over
  the copy bandwidth measured in the same run.

`--splice-only` times the splice pass alone (no model: pools at the config's shapes, random
KV), in two layouts, each with the implementations side by side (interleaved, medians):
`pages in order` (the state as a fresh pool lays it out; the 64 -> 16 edit shifts by whole
pages, so every run is a whole page) and `pages shuffled` (sources and destinations on pages
in no order, as in a pool that has served for a while, and a 13-token stub: each page splits
into two runs, 13 and 3 rows). Implementations: `splice` (what the directive runs now:
`splice_pools`, runs, `splice_rotate_jnp`, one program a layer on this CPU), `whole` (the same
step as one program over every layer, as an accelerator runs it: `splice_step`), `rows` (the
row-by-row reference per layer: the pass before runs) and `pieces` (runs moved as dynamic
slices of power-of-two pieces: the alternative measured and not taken). Floors: the bytes
over a memcpy of one large buffer (`memcpy`, the brief's floor) and over the in-place copy pass
the full mode uses.

`--by-depth` asks what a splice costs by depth, as one program a layer (what this CPU runs:
`splice_step` on each layer's pools in turn) and as one program over every layer (what an
accelerator runs), each depth and form in a fresh process, `--rounds` rounds in turns: a splice
shape's compile time (the first call of 16 and of 512 runs, all padding, less a second call) and
a splice of 2048 downstream tokens (pages in order; median of `--repeats`). Medians over rounds.

The downstream KV is filled with random values through the state's own append path (its values do
not change the cost of moving it); the prefix and stub go through the model. Medians of
`--repeats` runs after a warm-up; re-prefill of 8k tokens and more runs once.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from benchmarks.device.floors import kv_bytes_per_token
from checkpoints.tiny import write_random_checkpoint
from leyline_jax import allocator, splice
from leyline_jax import kv_pools as kv
from pallas_kernels.splice_rotate import splice_rotate_ref
from pallas_kernels.splice_runs import Runs, phase_table, plan_runs

PREFIX, SPAN, STUB, PAGE = 1024, 64, 16, 16
IMPLS = ("splice", "whole", "rows", "pieces")  # the splice pass's forms (`--splice-only`)


def init_state(config, tokens: int, num_pages: int, max_seqs: int):
    """A paged state whose sequences hold up to `tokens` tokens (and two pages more)."""
    size = dict(num_pages=num_pages, page_size=PAGE, max_seqs=max_seqs)
    return ll.init_state(config, **size, max_seq_len=(tokens // PAGE + 2) * PAGE)


def moves(downstream: int, stub: int, old, fresh):
    """(src, dst, pos_from, pos_to) rows of the splice (a `stub`-token stub): the rows from the
    prefix's last page on, from the sequence's pages `old` to its new pages (`old` up to that
    page, then `fresh`)."""
    first = (PREFIX // PAGE) * PAGE
    after = np.arange(PREFIX + SPAN, PREFIX + SPAN + downstream)
    i = np.concatenate([np.arange(first, PREFIX), after])
    j = np.where(i < PREFIX, i, i - SPAN + stub)
    row = np.concatenate([old[: first // PAGE], fresh])
    return old[i // PAGE] * PAGE + i % PAGE, row[j // PAGE] * PAGE + j % PAGE, i, j


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
    state, plan = allocator.append(state, [seq], [np.asarray(tokens, np.int32)])
    return state.replace(pools=_random_kv(state.pools, jnp.asarray(plan.slots[0]), key))


def build(model, downstream: int):
    """A state holding prefix + span (through the model) + `downstream` random tokens."""
    c = model.config
    total = PREFIX + SPAN + downstream + STUB
    state = init_state(c, total, 2 * (total // PAGE) + 8, max_seqs=2)
    rng = np.random.default_rng(0)
    state, _ = ll.prefill(model, state, 0, rng.integers(0, c.vocab_size, PREFIX + SPAN))
    toks = rng.integers(0, c.vocab_size, downstream)
    return _append_random(state, 0, toks, jax.random.PRNGKey(0))


def time_amortize(model, downstream: int, repeats: int) -> float:
    directive = ll.Directive(PREFIX, PREFIX + SPAN, list(range(STUB)))
    times = []
    for _ in range(repeats + 1):  # the first run compiles
        state = jax.block_until_ready(build(model, downstream))
        times.append(harness.timed(lambda s=state: ll.apply_directive(model, s, 0, directive)))
    return statistics.median(times[1:])


def time_splice_only(model, downstream: int, repeats: int) -> float:
    """The move+rotate pass alone over the same slot counts (fresh pages after the old ones)."""
    c = model.config
    state = build(model, downstream)
    free = np.flatnonzero(np.asarray(state.refcount) == 0)
    old = np.asarray(state.page_table)[0]
    runs = splice.padded_runs(plan_runs(*moves(downstream, STUB, old, free)))
    inv = jnp.asarray(c.rope_inv_freq())
    table = phase_table(inv, state.max_seq_len)  # what apply_directive looks rotations up in
    box = {"pools": state.pools}

    def run():  # the step apply_directive runs: `splice_rotate` over every layer's pool, donated
        box["pools"] = splice.splice_pools(box["pools"], runs, inv, table, impl="jnp")
        return box["pools"].rotated[-1]

    return harness.median_time(run, repeats=repeats)


# ---- the splice pass alone, implementations side by side ----------------------------------
LAYOUTS = {"pages in order": STUB, "pages shuffled": 13}  # layout -> stub length


def splice_moves(downstream: int, layout: str, num_pages: int):
    """(src, dst, pos_from, pos_to) rows of the splice, in a pool of `num_pages` pages: the old
    pages (prefix, span, downstream) first and the fresh ones after them, or both drawn from
    the pool in no order ("pages shuffled")."""
    n_old = allocator.pages_for(PREFIX + SPAN + downstream, PAGE)
    pages = np.arange(num_pages)
    if layout == "pages shuffled":
        pages = np.random.default_rng(0).permutation(num_pages)
    return moves(downstream, LAYOUTS[layout], pages[:n_old], pages[n_old:])


@functools.partial(jax.jit, static_argnames="k_dtype", donate_argnums=0)
def _rows_pass(pools, rows, inv, table, *, k_dtype):
    """The pass before runs: the row-by-row reference on each layer's pool in turn (`rows`:
    src, dst, pos_from, pos_to)."""

    def one(c, k):
        c, k = c.reshape(1, -1, c.shape[-1]), k.reshape(1, -1, k.shape[-1])
        return splice_rotate_ref(c, k, *rows, inv, k_dtype=k_dtype, table=table)

    out = [one(c, k) for c, k in zip(pools.moved, pools.rotated, strict=True)]
    return dataclasses.replace(
        pools,
        moved=tuple(a[0].reshape(c.shape) for (a, _), c in zip(out, pools.moved, strict=True)),
        rotated=tuple(b[0].reshape(k.shape) for (_, b), k in zip(out, pools.rotated, strict=True)),
    )


@functools.partial(jax.jit, static_argnames=("k_dtype", "max_run"), donate_argnums=0)
def _pieces_pass(pools, runs, inv, table, *, k_dtype, max_run):
    """Runs as dynamic slices (the alternative measured, not taken): each run cut into
    power-of-two pieces, one loop per piece size over the runs with that bit, every layer
    moved in one loop step."""
    slots = pools.num_pages * pools.page_size
    cs = tuple(x.reshape(slots, -1) for x in pools.moved)
    ks = tuple(x.reshape(slots, -1) for x in pools.rotated)
    h = inv.shape[0]
    for bit in reversed(range(max_run.bit_length())):
        n = 1 << bit
        has = (runs.length >> bit) & 1 == 1
        (which,) = jnp.nonzero(has, size=has.shape[0], fill_value=0)
        off = runs.length[which] & -(2 * n)
        pieces = [a[which] + off for a in (runs.src, runs.dst, runs.pos_from, runs.pos_to)]

        def body(q, ck, n=n, pieces=pieces):
            s, d, pf, pt = (a[q] for a in pieces)
            a, b = (jax.lax.dynamic_slice_in_dim(table, p, n) for p in (pf, pt))
            ca, sa, cb, sb = a[:, :h], a[:, h:], b[:, :h], b[:, h:]
            cos, sin = cb * ca + sb * sa, sb * ca - cb * sa

            def move(x, rotate):
                y = jax.lax.dynamic_slice_in_dim(x, s, n)
                if rotate:
                    y = kv.from_storage(y, k_dtype).astype(jnp.float32)
                    y1, y2 = y[:, :h], y[:, h:]
                    y = jnp.concatenate([y1 * cos - y2 * sin, y2 * cos + y1 * sin], -1)
                    y = kv.to_storage(y, k_dtype)
                return jax.lax.dynamic_update_slice_in_dim(x, y, d, 0)

            return tuple(move(x, False) for x in ck[0]), tuple(move(x, True) for x in ck[1])

        cs, ks = jax.lax.fori_loop(0, jnp.sum(has), body, (cs, ks))
    return dataclasses.replace(
        pools,
        moved=tuple(x.reshape(o.shape) for x, o in zip(cs, pools.moved, strict=True)),
        rotated=tuple(x.reshape(o.shape) for x, o in zip(ks, pools.rotated, strict=True)),
    )


def splice_passes(config, downstream: int, layout: str, repeats: int) -> dict:
    """Seconds per splice pass of each implementation (interleaved medians), and the runs."""
    total = PREFIX + SPAN + downstream + STUB
    num_pages = 2 * (total // PAGE) + 8
    src, dst, pos_from, pos_to = splice_moves(downstream, layout, num_pages)
    runs = plan_runs(src, dst, pos_from, pos_to, max_run=PAGE)
    n_runs, mean_run = len(runs.src), float(runs.length.mean())
    runs = splice.padded_runs(runs)
    m = 1 << (len(src) - 1).bit_length()
    fills = (0, num_pages * PAGE, 0, 0)  # padding rows: destination "nowhere"
    rows = [
        jnp.asarray(np.pad(a, (0, m - len(a)), constant_values=f))
        for a, f in zip((src, dst, pos_from, pos_to), fills, strict=True)
    ]
    inv = jnp.asarray(config.rope_inv_freq())
    table = phase_table(inv, total + PAGE)
    pools = ll.init_state(config, num_pages=num_pages, page_size=PAGE, max_seqs=1).pools
    pools = _random_kv(pools, jnp.asarray(src, jnp.int32), jax.random.PRNGKey(0))
    k_dtype = pools.rotated_dtype
    steps = {
        "splice": lambda p: splice.splice_pools(p, runs, inv, table, impl="jnp"),
        "whole": lambda p: splice.splice_step(p, runs, inv, table, impl="jnp"),
        "rows": lambda p: _rows_pass(p, rows, inv, table, k_dtype=k_dtype),
        "pieces": lambda p: _pieces_pass(p, runs, inv, table, k_dtype=k_dtype, max_run=PAGE),
    }
    boxes = {name: {"pools": jax.tree.map(jnp.copy, pools)} for name in steps}
    del pools

    def run(name):  # one pass of `name` on its own pools (donated)
        boxes[name]["pools"] = steps[name](boxes[name]["pools"])
        return boxes[name]["pools"].rotated[-1]

    out = harness.interleaved({name: functools.partial(run, name) for name in steps}, repeats)
    return dict(runs=n_runs, mean_run=mean_run, **{f"{k}_s": v for k, v in out.items()})


def splice_only(args, cfg: dict) -> list[dict]:
    config = ll.MLAConfig.from_hf(cfg)
    memcpy, inplace = harness.memcpy_bandwidth(), harness.copy_bandwidth()["inplace_bytes_s"]
    print(
        f"memcpy {memcpy / 1e9:.1f} GB/s, in-place pass {inplace / 1e9:.1f} GB/s (read + write);"
        f" {config.num_hidden_layers} layers",
        flush=True,
    )
    rows, rates = [], dict(memcpy_bytes_s=memcpy, inplace_bytes_s=inplace)
    for d in (int(x) for x in args.lengths.split(",")):
        nbytes = d * kv_bytes_per_token(config) * 2
        for layout in LAYOUTS:
            r = splice_passes(config, d, layout, args.repeats)
            floor, floor_inplace = nbytes / memcpy, nbytes / inplace
            row = dict(downstream=d, layers=config.num_hidden_layers, layout=layout, bytes=nbytes)
            row |= rates | dict(floor_s=floor, floor_inplace_s=floor_inplace) | r
            row |= {f"{k}_over_floor": r[f"{k}_s"] / floor for k in IMPLS}
            rows.append(row | dict(splice_over_inplace_floor=r["splice_s"] / floor_inplace))
            times = [f"{k} {r[f'{k}_s'] * 1e3:7.1f} ms ({r[f'{k}_s'] / floor:.2f}x)" for k in IMPLS]
            head = f"D={d:6d} {layout:15s} {r['runs']:5d} runs ({r['mean_run']:4.1f} rows)"
            print(" | ".join([head, f"floor {floor * 1e3:6.1f} ms", *times]), flush=True)
    return rows


# ---- by depth: one program a layer against one program over every layer -------------------
FORMS = ("layer by layer", "one program")
DEPTH_TOKENS = 2048  # downstream tokens of the timed splice (`--by-depth`)


def one_depth(layers: int, form: str, repeats: int) -> dict:
    """Run in a fresh process: `--by-depth`'s measures at `layers` layers, the step run as
    `form` (one of FORMS)."""
    cfg = harness.BENCH_HF_CONFIG | dict(num_hidden_layers=layers, first_k_dense_replace=layers)
    config = ll.MLAConfig.from_hf(cfg)
    total = PREFIX + SPAN + DEPTH_TOKENS + STUB
    num_pages = 2 * (total // PAGE) + 8
    rows = splice_moves(DEPTH_TOKENS, "pages in order", num_pages)
    runs = splice.padded_runs(plan_runs(*rows, max_run=PAGE))
    inv = jnp.asarray(config.rope_inv_freq())
    table = phase_table(inv, total + PAGE)
    box = {"pools": ll.init_state(config, num_pages=num_pages, page_size=PAGE, max_seqs=1).pools}

    def call(r):  # one splice of the state's pools (donated) as `form`
        if form == FORMS[0]:
            box["pools"] = box["pools"].by_layer(splice.splice_step, r, inv, table, impl="jnp")
        else:
            box["pools"] = splice.splice_step(box["pools"], r, inv, table, impl="jnp")
        return box["pools"].rotated[-1]

    row = dict(layers=layers, form=form)
    for m in (16, 512):
        padding = Runs(*[jnp.zeros(m, jnp.int32)] * 5)
        first = harness.timed(lambda p=padding: call(p))
        row[f"compile_{m}_s"] = first - harness.timed(lambda p=padding: call(p))
    return row | dict(run_s=harness.median_time(lambda: call(runs), repeats=repeats))


def by_depth(args) -> list[dict]:
    samples: dict = {}
    for _ in range(args.rounds):
        for layers in map(int, args.by_depth.split(",")):
            for form in FORMS:
                one = f"{layers}:{FORMS.index(form)}"
                cmd = [sys.executable, "-m", "benchmarks.splice_bench", "--one-depth", one]
                out = subprocess.run(cmd + ["--repeats", str(args.repeats)], capture_output=True)
                if out.returncode:
                    sys.exit(out.stderr.decode())
                row = json.loads(out.stdout.decode().strip().splitlines()[-1])
                samples.setdefault((layers, form), []).append(row)
    keys = ("compile_16_s", "compile_512_s", "run_s")
    rows = [
        dict(layers=layers, form=form, rounds=got)
        | {k: statistics.median(r[k] for r in got) for k in keys}
        for (layers, form), got in samples.items()
    ]
    header = ["layers", "form", "compile, 16 runs", "compile, 512 runs", f"run, {DEPTH_TOKENS}"]
    for line in harness.table(
        header,
        [
            [str(r["layers"]), r["form"], f"{r['compile_16_s']:.2f} s",
             f"{r['compile_512_s']:.2f} s", f"{r['run_s'] * 1e3:.1f} ms"]
            for r in rows
        ],
    ):  # fmt: skip
        print(line)
    return rows


def time_reprefill(model, downstream: int, repeats: int) -> float:
    c = model.config
    rng = np.random.default_rng(1)
    tail = rng.integers(0, c.vocab_size, STUB + downstream)
    times = []
    total = PREFIX + STUB + downstream
    for _ in range(repeats + 1):
        state = init_state(c, total, total // PAGE + 4, max_seqs=1)
        state, _ = ll.prefill(model, state, 0, rng.integers(0, c.vocab_size, PREFIX))
        state = jax.block_until_ready(state)
        times.append(harness.timed(lambda s=state: ll.prefill(model, s, 0, tail)))
    return statistics.median(times[1:])  # the first run compiles


def main(argv=None) -> None:
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--layers", type=int, default=harness.BENCH_HF_CONFIG["num_hidden_layers"])
    only = "time the move+rotate pass alone (no model)"
    ap.add_argument("--splice-only", action="store_true", help=only)
    depths = "compile and run the splice at these depths, a program a layer and one in all"
    ap.add_argument("--by-depth", default=None, metavar="L,L,...", help=depths)
    ap.add_argument("--rounds", type=int, default=3, help="--by-depth's rounds")
    ap.add_argument("--one-depth", default=None, help=argparse.SUPPRESS)  # L:form, in a child
    args = ap.parse_args(argv)
    if args.one_depth:  # a depth's own process (`by_depth`)
        layers, form = map(int, args.one_depth.split(":"))
        print(json.dumps(one_depth(layers, FORMS[form], args.repeats)))
        return
    layers = dict(num_hidden_layers=args.layers, first_k_dense_replace=args.layers)
    cfg = harness.BENCH_HF_CONFIG | layers
    print(harness.platform())
    if args.by_depth:
        rows = by_depth(args)
    else:
        rows = (splice_only if args.splice_only else amortize_vs_forget)(args, cfg)
    harness.save_json(args.out, rows)


def amortize_vs_forget(args, cfg: dict) -> list[dict]:
    bw = harness.copy_bandwidth()["inplace_bytes_s"]
    print(f"machine: copy bandwidth {bw / 1e9:.1f} GB/s (in place, read + write)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = ll.load_model(write_random_checkpoint(os.path.join(tmp, "bench"), cfg))
        for d in (int(x) for x in args.lengths.split(",")):
            floor = d * kv_bytes_per_token(model.config) * 2 / bw
            splice = time_splice_only(model, d, args.repeats)
            amortize = time_amortize(model, d, args.repeats)
            forget = time_reprefill(model, d, 1 if d >= 8192 else args.repeats)
            r = dict(downstream=d, floor_s=floor, splice_s=splice, amortize_s=amortize)
            r |= dict(forget_s=forget, splice_over_floor=splice / floor)
            r |= dict(amortize_over_floor=amortize / floor, forget_over_amortize=forget / amortize)
            rows.append(r)
            print(
                f"D={d:6d} floor {floor * 1e3:8.3f} ms | splice {splice * 1e3:8.3f} ms "
                f"({r['splice_over_floor']:.1f}x floor) | amortize {amortize * 1e3:8.2f} ms "
                f"({r['amortize_over_floor']:.1f}x floor) | forget {forget * 1e3:9.1f} ms "
                f"({r['forget_over_amortize']:.0f}x amortize)",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
