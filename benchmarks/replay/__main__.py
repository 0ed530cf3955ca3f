"""The replay benchmark's command line: `python -m benchmarks.replay`.

Renders the traces, runs the warm-up pass, times every arm at every concurrency and writes
DIR/results.json (a row of `KEYS` per arm and concurrency), DIR/results.md and DIR/results.png
(see `benchmarks.replay`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import leyline_jax as ll
from benchmarks import harness, replay, traces
from benchmarks.replay import ARMS, COUNTS, REASONING_RULES, compiled, make_engine, run_arm
from checkpoints.tiny import ensure_default_checkpoints
from serve import compile_cache
from serve.chat import model_path, tokenizer_for
from serve.engine.config import EngineConfig

WARMUPS = ("compile", "replay", "none")
# a results.json row's keys, in order
KEYS = ("arm", "concurrency", "policy", "steps", "hit_rate", *(f"{k}_tokens" for k in COUNTS))
KEYS += ("latency_p50_s", "latency_p95_s", "latency_mean_s", "ttft_p50_s", "ttft_p95_s")
KEYS += ("total_s", "compiles")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=replay.__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="JSONL traces (benchmarks.traces format)")
    ap.add_argument("--arms", default="radix,amortize,forget")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--policy", default=None, help="truncate | clear_tool_uses (default: none)")
    ap.add_argument("--keep", type=int, default=2, help="the policy's keep")
    model = "checkpoint directory, .gguf file, or smollm2 (default: the embedded tiny one)"
    ap.add_argument("--model", default=None, help=model)
    ap.add_argument("--root", default=".checkpoints")
    ap.add_argument("--limit", type=int, default=None, help="first N traces")
    ap.add_argument("--sample", type=int, default=None, help="a seeded random sample of N traces")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    harness.add_compile_cache(ap)
    ap.add_argument("--max-new", type=int, default=4, help="tokens generated per step")
    EngineConfig.add_arguments(ap, fields=("page_size", "kv_dtype", "prefill_chunk"))
    warmup = "before the timed runs: compile every step shape (default), replay it all untimed, "
    warmup += "or nothing"
    ap.add_argument("--warmup", choices=WARMUPS, default="compile", help=warmup)
    ap.add_argument("--no-warmup", action="store_true", help="the same as --warmup none")
    rule = "reasoning traces: the history drops every earlier reply's reasoning (r1), or only "
    rule += "that of earlier user turns (interleaved: DeepSeek-V3.2 / Qwen3 with tools)"
    ap.add_argument("--reasoning-rule", choices=REASONING_RULES, default="r1", help=rule)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", required=True)
    return ap


def load(args: argparse.Namespace) -> tuple:
    """(the model, its path, per trace per step: the tokens sent, the spans SCRATCH marks)."""
    path = model_path(args.model) if args.model else None
    path = path or ensure_default_checkpoints(args.root)["deepseek_v3"]
    model = ll.load_model(path)
    tok, vocab = tokenizer_for(path), model.config.vocab_size
    trace_list = list(traces.read(args.traces, args.limit))
    if args.sample is not None:
        trace_list = replay.seeded_sample(trace_list, args.sample, args.seed)
    kw = {"keep": args.keep} if args.policy else {}
    interleaved = args.reasoning_rule == "interleaved"
    work, resent = replay.rendered(trace_list, tok, vocab, args.policy, kw, interleaved)
    work, marks = replay.with_replies(trace_list, tok, work, vocab, resent if interleaved else None)
    return model, path, work, marks


def warm_up(how: str, model, work, marks, arms, conc, size: dict) -> None:
    """The untimed pass before the timed runs (`--warmup`)."""
    t0 = time.perf_counter()
    if how == "compile":
        before = compiled()
        runs = make_engine(model, work, **size).warmup()
        print(
            f"compile pass: {compiled() - before} shapes compiled ({runs} runs) in "
            f"{time.perf_counter() - t0:.1f} s"
        )
    elif how == "replay":
        for c in conc:
            for arm in arms:
                run_arm(model, work, arm, c, scratch=marks, **size)
        print(f"warm-up pass (the same replay, untimed): {time.perf_counter() - t0:.1f} s")


def main(argv=None) -> list[dict]:
    ap = parser()
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arm {bad[0]!r}: {', '.join(ARMS)}")
    conc = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    compile_cache.enable(args.compile_cache)
    model, path, work, marks = load(args)
    policy = f"{args.policy}(keep={args.keep})" if args.policy else "none"
    print(f"{len(work)} traces, {sum(len(w) for w in work)} steps, model {path}, policy {policy}")
    size = dict(slots=max(conc), max_new=args.max_new, config=EngineConfig.from_args(args))
    warm_up("none" if args.no_warmup else args.warmup, model, work, marks, arms, conc, size)
    rows = []
    for c in conc:
        for arm in arms:
            row, _ = run_arm(model, work, arm, c, progress=True, scratch=marks, **size)
            row["policy"] = policy
            rows.append({k: row[k] for k in KEYS})
            print(
                f"{arm:9s} C={c:<3d} hit {row['hit_rate']:6.1%}  prefilled "
                f"{row['prefilled_tokens']:8d}  spliced {row['spliced_tokens']:8d}  latency "
                f"p50 {row['latency_p50_s'] * 1e3:8.1f} ms mean {row['latency_mean_s'] * 1e3:8.1f}"
                f" ms  total {row['total_s']:.1f} s  compiles {row['compiles']}",
                flush=True,
            )
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    (out / "results.md").write_text(markdown(rows))
    if not args.no_plot:
        plot(rows, out / "results.png")
    return rows


def markdown(rows) -> str:
    header = ["policy", "arm", "C", "hit rate", *COUNTS, "latency p50", "p95", "mean"]
    header += ["TTFT p50", "total", "compiles"]
    times = ("latency_p50_s", "latency_p95_s", "latency_mean_s", "ttft_p50_s")
    cells = [
        [r["policy"], r["arm"], str(r["concurrency"]), f"{r['hit_rate']:.1%}"]
        + [str(r.get(f"{k}_tokens", 0)) for k in COUNTS]
        + [f"{r[k] * 1e3:.1f} ms" for k in times]
        + [f"{r['total_s']:.1f} s", str(r["compiles"])]
        for r in rows
    ]
    return "\n".join(harness.table(header, cells, "ll" + "r" * 14)) + "\n"


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        for pol in dict.fromkeys(r["policy"] for r in rows):
            rs = [r for r in rows if r["arm"] == arm and r["policy"] == pol]
            if not rs:
                continue
            c = [r["concurrency"] for r in rs]
            label = f"{arm} ({pol})"
            axes[0].plot(c, [100 * r["hit_rate"] for r in rs], marker="o", label=label)
            axes[1].plot(c, [1e3 * r["latency_mean_s"] for r in rs], marker="o", label=label)
    hits = "replay cache-hit rate (%)"
    axes[0].set(xlabel="concurrency", ylabel=hits, xscale="log", ylim=(0, 100))
    axes[1].set(xlabel="concurrency", ylabel="mean step latency (ms)", xscale="log")
    for ax in axes:
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
