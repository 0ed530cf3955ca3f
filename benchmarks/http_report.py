"""The HTTP benchmark's report (`benchmarks.http_bench`): each arm's repeats summarised beside
the in-process arm's, the printed tables, the profiles, and the run's JSON."""

from __future__ import annotations

import concurrent.futures
import cProfile
import pstats
import statistics
import sys
import time

import jax
import numpy as np

from benchmarks import harness
from benchmarks.http_workload import ENGINE, Rig, first_content, http_arms

CPU_COLUMNS = ("loop", "engine", "clients", "main", "process")
FIELDS = (("latency", ""), ("ttft", "ttft_"), ("ttfc", "ttfc_"))  # a record's times, key prefix
SEGMENTS = {  # an openai or raw turn's time, split by the server's timestamps: (from, to)
    "pre": ("t0", "arrived"),
    "handoff": ("arrived", "submitted"),
    "engine": ("submitted", "finished"),
    "post": ("finished", "t1"),
}


def records(run: dict) -> list[dict]:
    """A workload's records, every session's turns."""
    return [r for session in run["records"] for r in session]


def flat(run: dict, field: str) -> list[float]:
    return [r[field] for r in records(run) if r.get(field) is not None]


def pooled(rs: list[dict], field: str) -> list[float]:
    return [x for run in rs for x in flat(run, field)]


def pairs(rs: list[dict], base: list[dict]):
    """(record, in-process record) of the same repeat, session and turn."""
    for run, brun in zip(rs, base, strict=True):
        for sess, bsess in zip(run["records"], brun["records"], strict=True):
            yield from zip(sess, bsess, strict=True)


def ms(xs, q: float) -> float:
    """The q-th percentile of seconds `xs`, in ms."""
    return harness.percentile(xs, q) * 1e3


def medians(rs) -> dict:
    """Wall ms of the workload and CPU ms per turn by thread (medians over repeats)."""
    cpu = {k: statistics.median(r["cpu"][k] for r in rs) * 1e3 for k in rs[0]["cpu"]}
    return {"wall_ms": statistics.median(r["wall"] for r in rs) * 1e3, "cpu_ms_per_turn": cpu}


def summarize(runs: dict, arms, cs, tok) -> dict:
    """runs[(c, arm)] -> list over repeats of {records, wall, cpu}: per C, per arm."""
    out = {}
    for c in cs:
        base = runs[(c, "inproc")]
        inproc = {f"{pre}p{q}_ms": ms(pooled(base, f), q) for f, pre in FIELDS for q in (50, 95)}
        inproc |= medians(base) | {"n": len(pooled(base, "latency"))}
        out[str(c)] = {"inproc": inproc} | {
            arm: summarize_arm(arm, runs[(c, arm)], base, tok) for arm in http_arms(arms)
        }
    return out


def summarize_arm(arm: str, rs: list[dict], base: list[dict], tok) -> dict:
    """An HTTP arm's repeats beside the in-process arm's (`base`): percentiles, overheads,
    and where the time goes."""
    d = medians(rs)
    compared = ("latency", "ttfc") if arm == "stream" else ("latency",)
    for field, pre in ((f, pre) for f, pre in FIELDS if f in compared):
        xs, bs = pooled(rs, field), pooled(base, field)
        for q in (50, 95):
            h, b = harness.percentile(xs, q), harness.percentile(bs, q)
            d[f"{pre}p{q}_ms"] = h * 1e3
            d[f"{pre}overhead_p{q}_ms"] = (h - b) * 1e3
            d[f"{pre}ratio_p{q}"] = h / b
        paired = [r[field] - b[field] for r, b in pairs(rs, base)
                  if r.get(field) is not None and b.get(field) is not None]  # fmt: skip
        d[f"{pre}paired_median_overhead_ms"] = statistics.median(paired) * 1e3
        d[f"{pre}n"] = len(xs)
    seg = segments(arm, [r for run in rs for r in records(run)], tok)
    d["segments_p50_ms"] = {k: ms(v, 50) for k, v in seg.items()}
    if arm != "stream":
        d["segments_mean_ms"] = {k: float(np.mean(v)) * 1e3 for k, v in seg.items()}
    return d


def segments(arm: str, recs: list[dict], tok) -> dict[str, list[float]]:
    """Where each turn's time went, by the server's timestamps: an openai or raw turn's
    `SEGMENTS`; a stream turn's first content (its token handed to the loop -> the client)."""
    if arm != "stream":
        return {k: [r[b] - r[a] for r in recs] for k, (a, b) in SEGMENTS.items()}
    seg = {"first_content_delivery": [], "engine": [], "after_last_token": []}
    for r in recs:
        k = first_content(tok, r["output"])
        if r.get("ttfc") is not None and k is not None and r["handed"]:
            handed = r["handed"][min(k, len(r["handed"]) - 1)]
            seg["first_content_delivery"].append(r["t0"] + r["ttfc"] - handed)
        seg["engine"].append(r["finished"] - r["submitted"])
        seg["after_last_token"].append(r["t1"] - r["finished"])
    return seg


def per_repeat(run: dict) -> dict:
    """One repeat of one arm, in ms: wall time, p50/p95 of latency (and TTFT, TTFC)."""
    out = {"wall": round(run["wall"] * 1e3, 2)}
    for field, _ in FIELDS:
        xs = flat(run, field)
        if xs:
            out |= {f"{field}_p{q}": round(ms(xs, q), 2) for q in (50, 95)}
    return out


def agreement(runs: dict, arms, cs) -> dict:
    """Turns whose prompt or output differs from inproc's (same repeat, session, turn)."""
    res = {}
    for c, arm in ((c, a) for c in cs for a in http_arms(arms)):
        turns = list(pairs(runs[(c, arm)], runs[(c, "inproc")]))
        bad = sum(r["prompt"] != b["prompt"] or r["output"] != b["output"] for r, b in turns)
        res[f"{c}/{arm}"] = {"differ": bad, "turns": len(turns)}
    return res


def overhead_rows(summary: dict, cs, arms) -> list[list[str]]:
    """Per C and HTTP arm (and its TTFC beside the in-process arm's, streaming): the
    overhead table's cells."""
    rows = []
    for c, arm in ((c, a) for c in cs for a in http_arms(arms)):
        d, b = summary[str(c)][arm], summary[str(c)]["inproc"]
        for pre, name in (("", arm), ("ttfc_", f"{arm} TTFC")):
            if f"{pre}p50_ms" not in d:
                continue
            cells = [f"{x[f'{pre}p{q}_ms']:.1f}" for x in (d, b) for q in (50, 95)]
            over = [(d[f"{pre}overhead_p{q}_ms"], d[f"{pre}ratio_p{q}"]) for q in (50, 95)]
            cells += [f"{ms:+.1f} ({ratio:.2f}x)" for ms, ratio in over]
            cells.append(f"{d[f'{pre}paired_median_overhead_ms']:+.1f}")
            rows.append([str(c), name, *cells, f"{d['wall_ms']:.0f} ({b['wall_ms']:.0f})"])
    return rows


def tables(summary: dict, cs, arms) -> str:
    """The printed report: overheads; where an HTTP turn's time goes; streaming; CPU."""
    s = {c: summary[str(c)] for c in cs}
    header = ["C", "arm", "p50 ms", "p95 ms", "in-proc p50", "in-proc p95"]
    header += ["overhead p50 ms (ratio)", "overhead p95 ms (ratio)", "paired Δ p50 ms"]
    header += ["workload wall ms (in-proc)"]
    lines = harness.table(header, overhead_rows(summary, cs, arms), "rl" + "r" * 8)
    seg_arms = [a for a in arms if a in ("openai", "raw")]
    if seg_arms:
        header = ["C", "arm", "pre (client → handler)", "hand-off (→ engine)", "engine"]
        header += ["post (→ parsed reply)", "in-proc latency p50"]
        rows = [
            [str(c), arm, *(f"{s[c][arm]['segments_p50_ms'][k]:.2f}" for k in SEGMENTS)]
            + [f"{s[c]['inproc']['p50_ms']:.2f}"]
            for c in cs
            for arm in seg_arms
        ]
        caption = "Where an HTTP turn's time goes (p50 ms of each segment, server timestamps):"
        lines += harness.section(caption, header, rows, "rl" + "r" * 5)
    if "stream" in arms:
        keys = ("first_content_delivery", "engine", "after_last_token")
        rows = [
            [str(c), *(f"{s[c]['stream']['segments_p50_ms'][k]:.2f}" for k in keys)] for c in cs
        ]
        caption = "Streaming (p50 ms): first-content delivery = the token that makes the first "
        caption += "content handed to the event loop -> its chunk parsed by the client; the "
        caption += "engine's span; the last token -> the parsed [DONE]:"
        header = ["C", "first-content delivery", "engine", "after the last token"]
        lines += harness.section(caption, header, rows, "rrrr")
    header = ["C", "arm", "event loop", "engine thread", "clients", "in-proc main", "process"]
    rows = [
        [str(c), arm, *(f"{u[k]:.2f}" if k in u else "-" for k in CPU_COLUMNS)]
        for c in cs
        for arm in arms
        for u in [s[c][arm]["cpu_ms_per_turn"]]
    ]
    caption = "CPU ms per turn by thread (median over repeats; XLA's threads only in `process`):"
    return "\n".join(lines + harness.section(caption, header, rows, "rl" + "r" * 5))


# ---- profiles -----------------------------------------------------------------------------------
def _group(key) -> str:
    """The package (or builtin) a profiled function belongs to."""
    file, _, name = key
    if file == "~":  # "<method 'decode' of 'tokenizers.Tokenizer' objects>", "<built-in ...>"
        if " of " in name:
            return "C:" + name.split(" of ")[-1].removesuffix(" objects>").strip("'")
        return "C:" + name.strip("<>").removeprefix("built-in method ")
    parts = file.replace("\\", "/").split("/")
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].removesuffix(".py")
    for top in ("serve", "leyline_jax", "benchmarks"):
        if top in parts:
            return "/".join(parts[parts.index(top) :])
    return "stdlib:" + parts[-1].removesuffix(".py")


def profile_summary(profs, top: int = 14) -> dict:
    """Self time by package and the top functions by self time, of merged cProfile runs."""
    st = pstats.Stats(profs[0])
    for p in profs[1:]:
        st.add(p)
    groups: dict[str, float] = {}
    for key, v in st.stats.items():
        groups[_group(key)] = groups.get(_group(key), 0.0) + v[2]
    funcs = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return dict(
        total_s=sum(v[2] for v in st.stats.values()),
        by_package=dict(sorted(groups.items(), key=lambda kv: -kv[1])[:top]),
        top_functions=[
            dict(
                func=f"{k[0].split('site-packages/')[-1]}:{k[1]}({k[2]})", self_s=v[2], calls=v[1]
            )  # fmt: skip
            for k, v in funcs
        ],
    )


def profile_pass(rig: Rig, arms, c: int) -> dict:
    """One more (untimed) workload per HTTP arm under cProfile timed by each thread's CPU
    clock (a wall clock would charge GIL waits to whatever call was pending): the event loop's
    thread and the client threads, self time by package (shares more than times: the
    profiler slows Python)."""
    loop, out = rig.ctx["loop"], {}

    def on_loop(fn):
        fut = concurrent.futures.Future()
        loop.call_soon_threadsafe(lambda: (fn(), fut.set_result(None)))
        fut.result(30)

    for arm in http_arms(arms):
        prof, clients = cProfile.Profile(time.thread_time), []
        on_loop(prof.enable)
        rig.run(arm, c, f"prof-{arm}", clients)
        on_loop(prof.disable)
        out[arm] = dict(event_loop=profile_summary([prof]), clients=profile_summary(clients))
        out[arm]["turns"] = c * rig.turns
    return out


def print_profiles(profiles: dict, c: int) -> None:
    for arm, d in profiles.items():
        for side in ("event_loop", "clients"):
            p = d[side]
            share = ", ".join(
                f"{k} {v / p['total_s']:.0%}" for k, v in list(p["by_package"].items())[:8]
            )
            print(f"profile C={c} {arm} {side}: {p['total_s'] * 1e3 / d['turns']:.2f} ms CPU "
                  f"per turn (profiled): {share}")  # fmt: skip


def report(args, cs, arms, runs: dict, tok, fl: dict, profiles, times: tuple) -> dict:
    """Print the tables and return the run's JSON; `times`: (the run's start, the warm-up's
    seconds, the timed repeats')."""
    t_all, t_warm, t_timed = times
    summary, agree = summarize(runs, arms, cs, tok), agreement(runs, arms, cs)
    outputs = [len(r["output"]) for run in runs[(cs[0], "inproc")] for r in records(run)]
    print()
    print(tables(summary, cs, arms))
    print()
    print(
        f"floors: GET /v1/models {fl['models_openai_ms']:.2f} ms (openai client), "
        f"{fl['models_raw_ms']:.2f} ms (http.client); rendering a {fl['render_tokens']}-token "
        f"prompt {fl['render_ms']:.2f} ms"
    )
    print(f"agreement with inproc (prompt and output ids): {agree}")
    if profiles:
        print_profiles(profiles, max(cs))
    print(f"completion tokens per turn: mean {np.mean(outputs):.1f} (max {args.max_tokens})")
    wall = time.perf_counter() - t_all
    print(f"wall: {wall:.0f} s (warmup {t_warm:.0f} s, timed repeats {t_timed:.0f} s)")
    config = {k: getattr(args, k) for k in ("repeats", "turns", "max_tokens")}
    config |= dict(concurrency=cs, arms=arms, engine={k: str(v) for k, v in ENGINE.items()})
    config |= dict(model="tiny deepseek_v3", python=sys.version.split()[0])
    config |= dict(switch_interval_s=sys.getswitchinterval(), jax=jax.__version__)
    return dict(
        config=config | dict(backend=jax.default_backend()),
        summary=summary,
        floors=fl,
        agreement=agree,
        profiles=profiles,
        completion_tokens_mean=float(np.mean(outputs)),
        wall_s=wall,
        warmup_s=t_warm,
        timed_s=t_timed,
        repeats_ms={  # per repeat: the workload's wall time and latency percentiles
            f"{c}/{a}": [per_repeat(run) for run in runs[(c, a)]] for c in cs for a in arms
        },
    )
