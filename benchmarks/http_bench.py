"""The HTTP server's own overhead: the same turns over `serve.http` and through the engine alone.

Two identically sized engines over the tiny default model (`deepseek_v3`, fp32 KV, 512 pages
of 16, 16 sequences), both warmed (`Engine.warmup()`, then an untimed pass of the whole
workload). One serves HTTP (`serve.http.ServerThread`, uvicorn in a thread, the engine on its
worker thread, DeepSeek's tokenizer with ids modulo the vocabulary, as tests/test_http.py);
the other is driven in-process. The workload at concurrency C: C sessions of `--turns` turns;
each turn adds a tool output and a user message to the history, re-sends all of it and asks
for `--max-tokens` tokens, greedy, with the server's stop tokens (the chat format's end of
turn); the reply goes back into the history as text (the server swaps in its sampled ids).
Arms, one workload each, in alternating order from repeat to repeat (drift hits all alike):

- `inproc`: per turn, the C prompts rendered as the server renders them (`chat.render` plus
  `ReplyMemory.substitute`, outside the timed span), submitted together
  (`Engine.submit_prompt`), then `engine.step()` until all are done, as the server's worker
  steps them; latency = the request's submission to its last token (`TurnStats.latency_s`);
- `openai`: C client threads (one shared official `openai` client), each running its session
  with `X-Session-Id`, non-streaming; latency = the client call, from call to parsed reply;
- `stream`: the same with `stream=True`; latency = through `[DONE]`; TTFC (time to first
  content) = the first chunk with content, against the in-process arm's submission to the
  token that lets the server send content (the server holds back an incomplete UTF-8
  character, and the tiny model's ids modulo 256 often begin with one: the first content
  usually comes with the 2nd-4th token, so the engine's TTFT would flatter the in-process
  side; the role chunk the server sends before any token does not count);
- `raw`: the same requests as `openai`, non-streaming, over `http.client` with `json` (one
  keep-alive connection per thread): the server's cost without the openai client's.

Every arm's prompts and outputs are compared with `inproc`'s (same session, turn, repeat);
the report says whether they all agree. Overhead = HTTP - in-process at the same percentile,
in ms and as a ratio (pooled over repeats; `paired` = the median of per-turn differences,
same session and turn in the same repeat).

Where the time goes. The server's own timestamps of each turn (the handler's `Job.arrived`,
the engine's `submitted_s` and `finished_s`, and when each token was handed to the event loop),
read through two calls the worker thread makes (its metrics' `turn_done` and its `_publish`,
wrapped as instance attributes: the server's code is untouched), split an `openai` or `raw`
turn into pre (client call to the handler's job: the client building and sending, uvicorn,
pydantic validation, rendering), hand-off (the job to the engine on the worker thread),
engine (submission to the last token, as `inproc`'s latency) and post (last token to the
parsed reply: the event back to the loop, the response JSON, the client's parse); a `stream`
turn's first content into delivery (its token handed to the loop -> the chunk parsed by the
client). CPU per turn of each thread (the event loop's, the engine worker's, the clients',
the in-process driver's; the process's, XLA's threads included). Floors: a `GET /v1/models`
round trip (openai client and raw), and rendering one prompt. `--profile`: one more workload
per HTTP arm at the largest C under cProfile on the threads' CPU clocks, self time by package.

Everything runs in one process (the clients too, as in tests/test_http.py), so the client
threads share the GIL and the machine's cores with uvicorn and the engine thread.

    python -m benchmarks.http_bench [--repeats 10] [--turns 6] [--max-tokens 16]
        [--concurrency 1,16] [--arms inproc,openai,stream,raw]
        [--profile] [--switch-interval S] [--out benchmarks/results_http.json]
        [--compile-cache DIR|off]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import dataclasses
import http.client
import json
import pstats
import statistics
import sys
import threading
import time
import types
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from checkpoints.tiny import ensure_default_checkpoints
from serve import chat, compile_cache
from serve.engine import Engine, SamplingParams
from serve.http import Backend, ServerThread
from serve.http.history import ReplyMemory
from serve.http.text import ModVocabTokenizer, OutputText

ENGINE = dict(num_pages=512, page_size=16, max_seqs=16, kv_dtype=jnp.float32)
MODEL = "tiny"
SYSTEM = "You are a terse assistant. Tool results arrive in tool messages."
HTTP_ARMS = ("openai", "stream", "raw")
CPU_COLUMNS = ("loop", "engine", "clients", "main", "process")
EXTRA = {"leyline": {"return_token_ids": True}}  # every HTTP request's extra body
FIELDS = (("latency", ""), ("ttft", "ttft_"), ("ttfc", "ttfc_"))  # a record's times, key prefix
SEGMENTS = {  # an openai or raw turn's time, split by the server's timestamps: (from, to)
    "pre": ("t0", "arrived"),
    "handoff": ("arrived", "submitted"),
    "engine": ("submitted", "finished"),
    "post": ("finished", "t1"),
}


@dataclasses.dataclass
class Rig:
    """What every workload runs on: the in-process arm's engine, the tokenizer, the server (its
    engine is the other one) with the timestamps it logs (`hook_server_log`), the client."""

    engine: Engine
    tok: ModVocabTokenizer
    server: ServerThread
    client: object  # one shared official openai client
    server_log: dict  # session key -> the server's timestamps of each finished turn
    ctx: dict  # "loop": the server's event loop
    turns: int
    max_tokens: int

    def run(self, arm: str, c: int, tag: str, profiles: list | None = None) -> dict:
        """One workload: {records (per session, per turn), wall, cpu (seconds per turn)}."""
        if arm == "inproc":
            return run_inproc(self, c, tag)
        return run_http(self, arm, c, tag, profiles)


def conversation(i: int, turn: int) -> list[dict]:
    """The messages session i adds at `turn` (tests/test_http.py's conversation)."""
    tool = json.dumps({"session": i, "turn": turn, "result": "ok" * (3 + i + turn)})
    return [{"role": "tool", "content": tool}, {"role": "user", "content": f"Turn {turn}: and?"}]


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds a running thread has used (its own clock: XLA's threads not included)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if xs else float("nan")


def connect(url: str, timeout: float) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def first_content(tok, output: list[int]) -> int | None:
    """Index of the token whose arrival lets the server stream its first content (the
    server's `OutputText` holds back an incomplete UTF-8 character: with the tiny model's ids
    taken modulo 256, often the first tokens); None: the reply has no content."""
    text = OutputText(tok, tok.stop_tokens, [], ())
    for k in range(len(output)):
        if text.update(output[: k + 1]):
            return k
    return len(output) - 1 if text.update(output, final=True) else None


# ---- the in-process arm -----------------------------------------------------------------------
def run_inproc(rig: Rig, c: int, tag: str) -> dict:
    """C sessions in lockstep: per turn, render all, submit all together, step until all are
    done (as the server's worker steps them)."""
    engine, tok, replies = rig.engine, rig.tok, ReplyMemory()
    sp = SamplingParams(max_new_tokens=rig.max_tokens, temperature=0.0, stop_tokens=tok.stop_tokens)
    keys = [f"{tag}-{i}" for i in range(c)]
    sids = [engine.open_session() for _ in range(c)]
    msgs = [[{"role": "system", "content": SYSTEM}] for _ in range(c)]
    recs: list[list[dict]] = [[] for _ in range(c)]
    cpu0, proc0, t_start = time.thread_time(), time.process_time(), time.perf_counter()
    for t in range(rig.turns):
        prompts = []
        for i in range(c):
            msgs[i] += conversation(i, t)
            prompts.append(replies.substitute(keys[i], msgs[i], chat.render(tok, msgs[i])).tokens)
        reqs = [engine.submit_prompt(sids[i], prompts[i], sampling=sp) for i in range(c)]
        seen: list[list[float]] = [[] for _ in reqs]  # when each token was seen
        while not all(r.finished for r in reqs):
            engine.step()
            now = time.perf_counter()
            for r, ts in zip(reqs, seen, strict=True):
                ts.extend([now] * (len(r.output) - len(ts)))
        for i, r in enumerate(reqs):
            if r.error is not None:
                raise r.error
            out, text = list(r.output), OutputText(tok, tok.stop_tokens, [], ())
            text.update(out, final=True)
            ids = out[:-1] if out and out[-1] in tok.stop_tokens else out
            replies.remember(keys[i], text.text, ids)  # what the server's remember_reply does
            msgs[i].append({"role": "assistant", "content": text.text})
            k, st = first_content(tok, out), r.stats
            ttfc = None if k is None else seen[i][k] - st.submitted_s
            times = dict(latency=st.latency_s, ttft=st.ttft_s, ttfc=ttfc)
            recs[i].append(dict(times, prompt=prompts[i], output=out))
    wall, n = time.perf_counter() - t_start, c * rig.turns
    cpu = dict(main=(time.thread_time() - cpu0) / n, process=(time.process_time() - proc0) / n)
    for s in sids:
        engine.close_session(s)
    return dict(records=recs, wall=wall, cpu=cpu)


# ---- the HTTP arms ------------------------------------------------------------------------------
def ask(arm: str, client, conn, key: str, kw: dict) -> tuple[dict, str, dict]:
    """One turn over HTTP: (its record: t0 and t1 around the call, for `stream` TTFC; the
    reply's content; the response's `leyline` field)."""
    headers = {"X-Session-Id": key}
    if arm == "raw":
        body = json.dumps({**kw, **EXTRA}).encode()
        t0 = time.perf_counter()
        headers = {"Content-Type": "application/json", **headers}
        conn.request("POST", "/v1/chat/completions", body, headers)
        resp = conn.getresponse()
        data = json.loads(resp.read())
        rec = dict(t0=t0, t1=time.perf_counter())
        assert resp.status == 200, data
        return rec, data["choices"][0]["message"]["content"], data["leyline"]
    create = client.chat.completions.create
    t0 = time.perf_counter()
    if arm == "openai":
        r = create(**kw, extra_headers=headers, extra_body=EXTRA)
        rec = dict(t0=t0, t1=time.perf_counter())
        return rec, r.choices[0].message.content, r.model_extra["leyline"]
    parts, ttfc, last = [], None, None
    for ch in create(**kw, stream=True, extra_headers=headers, extra_body=EXTRA):
        if ch.choices and ch.choices[0].delta.content:
            if ttfc is None:
                ttfc = time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content)
        last = ch
    rec = dict(ttfc=ttfc, t0=t0, t1=time.perf_counter())
    return rec, "".join(parts), last.model_extra["leyline"]


def http_session(rig: Rig, arm: str, i: int, key: str, out: list, shared) -> None:
    """Session i over HTTP, one turn after another (the client re-sends the whole history),
    its records into `out`. Adds the thread's CPU seconds to `shared.cpu`; profiles itself
    when `shared.profiles` is a list."""
    prof = cProfile.Profile(time.thread_time) if shared.profiles is not None else None
    try:
        msgs = [{"role": "system", "content": SYSTEM}]
        conn = connect(rig.server.url, 120) if arm == "raw" else None
        shared.barrier.wait()
        c0 = time.thread_time()
        if prof is not None:
            prof.enable()
        for t in range(rig.turns):
            msgs += conversation(i, t)
            kw = dict(model=MODEL, messages=msgs, max_tokens=rig.max_tokens, temperature=0)
            rec, content, ley = ask(arm, rig.client, conn, key, kw)
            ids = dict(prompt=ley["prompt_token_ids"], output=ley["output_token_ids"])
            out.append(dict(rec, latency=rec["t1"] - rec["t0"], **ids))
            msgs.append({"role": "assistant", "content": content})
        if prof is not None:
            prof.disable()
            shared.profiles.append(prof)
        shared.cpu.append(time.thread_time() - c0)
        if conn is not None:
            conn.close()
    except BaseException as e:  # reported by the main thread
        shared.errors.append((key, repr(e)))
        shared.barrier.abort()


def run_http(rig: Rig, arm: str, c: int, tag: str, profiles: list | None = None) -> dict:
    """C client threads, one session each, started together; the server's timestamps of each
    turn joined to its record; the sessions deleted afterwards."""
    keys = [f"{tag}-{i}" for i in range(c)]
    recs: list[list[dict]] = [[] for _ in range(c)]
    shared = types.SimpleNamespace(
        barrier=threading.Barrier(c + 1), errors=[], cpu=[], profiles=profiles
    )
    threads = [
        threading.Thread(target=http_session, args=(rig, arm, i, keys[i], recs[i], shared))
        for i in range(c)
    ]
    for th in threads:
        th.start()
    server_threads = dict(loop=rig.server.thread, engine=rig.server.backend.worker.thread)
    cpu0, p0 = {k: thread_cpu(th) for k, th in server_threads.items()}, time.process_time()
    shared.barrier.wait()
    t_start = time.perf_counter()
    for th in threads:
        th.join(600)
    wall, n = time.perf_counter() - t_start, c * rig.turns
    cpu = {k: (thread_cpu(th) - cpu0[k]) / n for k, th in server_threads.items()}
    cpu |= dict(clients=sum(shared.cpu) / n, process=(time.process_time() - p0) / n)
    if shared.errors:
        raise RuntimeError(f"{arm}: {shared.errors[:3]}")
    for k, session in zip(keys, recs, strict=True):  # server timestamps, matched in order
        for rec, srv in zip(session, rig.server_log.pop(k, []), strict=True):
            rec.update(srv)
        req = urllib.request.Request(f"{rig.server.url}/v1/sessions/{k}", method="DELETE")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["deleted"]
    return dict(records=recs, wall=wall, cpu=cpu)


def hook_server_log(backend) -> tuple[dict, dict]:
    """Record (arrived, submitted, first token, finished, when each token was handed to the
    event loop) of every finished turn, per session, through two calls the worker thread
    makes: its metrics' `turn_done` and its `_publish` after each step, wrapped as instance
    attributes before the worker starts (the server's code is untouched; the wrapper adds one
    length check per job and step). Also the server's event loop (`ctx["loop"]`)."""
    log: dict[str, list[dict]] = {}
    ctx: dict = {"loop": None}
    worker, metrics = backend.worker, backend.metrics
    turn_done_, publish_ = metrics.turn_done, worker._publish
    handed: dict[int, list[float]] = {}  # id(job) -> when each of its tokens was posted

    def publish():
        now = time.perf_counter()
        for job in worker.jobs:
            ts = handed.setdefault(id(job), [])
            ts.extend([now] * (len(job.request.output) - len(ts)))
        publish_()

    def turn_done(job):
        turn_done_(job)
        ctx["loop"] = job.loop
        st, ts = job.request.stats, handed.pop(id(job), [])
        times = dict(submitted=st.submitted_s, first=st.first_token_s, finished=st.finished_s)
        log.setdefault(job.session_key, []).append(dict(arrived=job.arrived, **times, handed=ts))

    metrics.turn_done, worker._publish = turn_done, publish
    return log, ctx


# ---- the report ---------------------------------------------------------------------------------
def http_arms(arms) -> list[str]:
    return [a for a in arms if a != "inproc"]


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


def cpu_median(rs) -> dict:
    """CPU ms per turn by thread (median over repeats)."""
    return {k: statistics.median(r["cpu"][k] for r in rs) * 1e3 for k in rs[0]["cpu"]}


def summarize(runs: dict, arms, cs, tok) -> dict:
    """runs[(c, arm)] -> list over repeats of {records, wall, cpu}: per C, per arm."""
    out = {}
    for c in cs:
        base = runs[(c, "inproc")]
        inproc = {
            f"{pre}p{q}_ms": pct(pooled(base, f), q) * 1e3 for f, pre in FIELDS for q in (50, 95)
        }
        wall = statistics.median(r["wall"] for r in base) * 1e3
        inproc |= dict(
            wall_ms=wall, n=len(pooled(base, "latency")), cpu_ms_per_turn=cpu_median(base)
        )
        out[str(c)] = {"inproc": inproc} | {
            arm: summarize_arm(arm, runs[(c, arm)], base, tok) for arm in http_arms(arms)
        }
    return out


def summarize_arm(arm: str, rs: list[dict], base: list[dict], tok) -> dict:
    """An HTTP arm's repeats beside the in-process arm's (`base`): percentiles, overheads,
    and where the time goes."""
    d = {
        "wall_ms": statistics.median(r["wall"] for r in rs) * 1e3,
        "cpu_ms_per_turn": cpu_median(rs),
    }
    compared = ("latency", "ttfc") if arm == "stream" else ("latency",)
    for field, pre in ((f, pre) for f, pre in FIELDS if f in compared):
        xs, bs = pooled(rs, field), pooled(base, field)
        for q in (50, 95):
            h, b = pct(xs, q), pct(bs, q)
            d[f"{pre}p{q}_ms"] = h * 1e3
            d[f"{pre}overhead_p{q}_ms"] = (h - b) * 1e3
            d[f"{pre}ratio_p{q}"] = h / b
        paired = [r[field] - b[field] for r, b in pairs(rs, base)
                  if r.get(field) is not None and b.get(field) is not None]  # fmt: skip
        d[f"{pre}paired_median_overhead_ms"] = statistics.median(paired) * 1e3
        d[f"{pre}n"] = len(xs)
    seg = segments(arm, [r for run in rs for r in records(run)], tok)
    d["segments_p50_ms"] = {k: pct(v, 50) * 1e3 for k, v in seg.items()}
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
            out[f"{field}_p50"] = round(pct(xs, 50) * 1e3, 2)
            out[f"{field}_p95"] = round(pct(xs, 95) * 1e3, 2)
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
        caption = (
            "Streaming (p50 ms): first-content delivery = the token that makes the first "
            "content handed to the event loop -> its chunk parsed by the client; the engine's "
            "span; the last token -> the parsed [DONE]:"
        )
        header = ["C", "first-content delivery", "engine", "after the last token"]
        lines += harness.section(caption, header, rows, "rrrr")
    header = ["C", "arm", "event loop", "engine thread", "clients", "in-proc main", "process"]
    rows = [
        [str(c), arm, *(f"{u[k]:.2f}" if k in u else "-" for k in CPU_COLUMNS)]
        for c in cs
        for arm in arms
        for u in [s[c][arm]["cpu_ms_per_turn"]]
    ]
    caption = (
        "CPU ms per turn by thread (median over repeats; XLA's own threads only in `process`):"
    )
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


# ---- floors -------------------------------------------------------------------------------------
def floors(rig: Rig, n: int = 50) -> dict:
    """A no-engine round trip (GET /v1/models: openai client and raw http.client) and the
    server-side rendering of one turn's prompt, p50 of n."""

    def p50(fn):
        return harness.median_time(fn, repeats=n) * 1e3

    conn = connect(rig.server.url, 60)

    def raw_models():
        conn.request("GET", "/v1/models")
        json.loads(conn.getresponse().read())

    msgs = [{"role": "system", "content": SYSTEM}]
    for t in range(4):
        msgs += conversation(0, t) + [{"role": "assistant", "content": "ok"}]
    res = dict(
        models_openai_ms=p50(lambda: rig.client.models.list()),
        models_raw_ms=p50(raw_models),
        render_ms=p50(lambda: chat.render(rig.tok, msgs)),
        render_tokens=len(chat.render(rig.tok, msgs).tokens),
    )
    conn.close()
    return res


# ---- the run ------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--arms", default="inproc,openai,stream,raw")
    ap.add_argument("--root", default=".checkpoints", help="where the tiny default lives")
    ap.add_argument("--out", default="benchmarks/results_http.json")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed repeats, one more workload per HTTP arm at the largest C under "
        "cProfile (event loop and client threads): self time by package",
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval(S) for the whole run (default: Python's, 0.005)",
    )
    ap.add_argument(
        "--compile-cache",
        help="keep compiled programs in DIR (default: serve.compile_cache's; off: none)",
    )
    return ap


def timed_repeats(rig: Rig, arms, cs, repeats: int) -> tuple[dict, float]:
    """Every workload once untimed, then `repeats` times in alternating order: (runs[(c, arm)],
    a run per repeat; the timed repeats' seconds)."""
    t0 = time.perf_counter()
    for c in cs:
        for arm in arms:
            rig.run(arm, c, f"warm-c{c}-{arm}")
    print(f"untimed pass: {time.perf_counter() - t0:.1f} s", flush=True)
    runs: dict = {(c, a): [] for c in cs for a in arms}
    t0 = time.perf_counter()
    for rep in range(repeats):
        for c in cs:
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                runs[(c, arm)].append(rig.run(arm, c, f"r{rep}-c{c}-{arm}"))
        print(f"repeat {rep + 1}/{repeats} done", flush=True)
    return runs, time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    import openai

    cs = [int(x) for x in args.concurrency.split(",")]
    arms = [a.strip() for a in args.arms.split(",")]
    if "inproc" not in arms:
        arms.insert(0, "inproc")
    bad = [a for a in arms if a not in ("inproc", *HTTP_ARMS)]
    if bad or max(cs) > ENGINE["max_seqs"]:
        ap.error(f"unknown arms {bad} or concurrency above {ENGINE['max_seqs']}")
    t_all = time.perf_counter()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    compile_cache.enable(args.compile_cache)
    model = ll.load_model(ensure_default_checkpoints(args.root)["deepseek_v3"])
    base_tok = chat.ChatTokenizer()
    inproc, served = Engine(model, **ENGINE), Engine(model, **ENGINE)
    t0 = time.perf_counter()
    inproc.warmup()
    served.warmup()
    t_warm = time.perf_counter() - t0
    print(f"warmup (both engines): {t_warm:.1f} s", flush=True)
    backend = Backend.for_engine(served, base_tok, MODEL, max_queue=64)
    server_log, ctx = hook_server_log(backend)
    server = ServerThread(backend).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    tok = ModVocabTokenizer(base_tok, model.config.vocab_size)
    rig = Rig(inproc, tok, server, client, server_log, ctx, args.turns, args.max_tokens)
    try:
        runs, t_timed = timed_repeats(rig, arms, cs, args.repeats)
        fl = floors(rig)
        profiles = profile_pass(rig, arms, max(cs)) if args.profile else None
    finally:
        server.stop()
    result = report(args, cs, arms, runs, tok, fl, profiles, (t_all, t_warm, t_timed))
    harness.save_json(args.out, result, indent=1)
    return result


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


if __name__ == "__main__":
    main()
