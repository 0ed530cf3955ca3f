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
  steps them; latency = the request's submission to its last token (`TurnStats.latency_s`),
  TTFT = submission to first token;
- `openai`: C client threads (one shared official `openai` client), each running its session
  with `X-Session-Id`, non-streaming; latency = the client call, from call to parsed reply;
- `stream`: the same with `stream=True`; TTFT = the first chunk with content (the role chunk
  the server sends before any token does not count), latency = through `[DONE]`;
- `raw`: the same requests as `openai`, non-streaming, over `http.client` with `json` (one
  keep-alive connection per thread): the server's cost without the openai client's.

Every arm's prompts and outputs are compared with `inproc`'s (same session, turn, repeat);
the report says whether they all agree. Overhead = HTTP - in-process at the same percentile,
in ms and as a ratio (pooled over repeats; `paired` = the median of per-turn differences,
same session and turn in the same repeat). Where the time goes, for `openai` and `raw`: the
server's own timestamps of each turn (the handler's `Job.arrived`, the engine's
`submitted_s`, `finished_s`, read through the metrics hook the worker calls when a turn ends)
split the client's latency into pre (client call to the handler's job: the client building
and sending, uvicorn, pydantic validation, rendering), hand-off (the job to the engine on the
worker thread), engine (submission to the last token, as `inproc`'s latency) and post (last
token to the parsed reply: the event back to the loop, the response JSON, the client's
parse). Floors measured in the same run: a `GET /v1/models` round trip (openai client and
raw), and rendering one prompt.

Everything runs in one process (the clients too, as in tests/test_http.py), so at C = 16 the
16 client threads share the GIL and the machine's cores with uvicorn and the engine thread.

    python -m benchmarks.http_bench [--repeats 5] [--turns 4] [--max-tokens 16]
        [--concurrency 1,16] [--arms inproc,openai,stream,raw]
        [--out benchmarks/results_http.json] [--compile-cache DIR|off]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from checkpoints.tiny import ensure_default_checkpoints
from serve import chat, compile_cache
from serve.engine import Engine, SamplingParams
from serve.http import Backend, ModVocabTokenizer, OutputText, ReplyMemory, ServerThread

ENGINE = dict(num_pages=512, page_size=16, max_seqs=16, kv_dtype=jnp.float32)
MODEL = "tiny"
SYSTEM = "You are a terse assistant. Tool results arrive in tool messages."
HTTP_ARMS = ("openai", "stream", "raw")


def conversation(i: int, turn: int) -> list[dict]:
    """The messages session i adds at `turn` (tests/test_http.py's conversation)."""
    tool = json.dumps({"session": i, "turn": turn, "result": "ok" * (3 + i + turn)})
    return [{"role": "tool", "content": tool}, {"role": "user", "content": f"Turn {turn}: and?"}]


def pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if xs else float("nan")


# ---- the in-process arm -----------------------------------------------------------------------
def run_inproc(engine: Engine, tok, c: int, turns: int, max_tokens: int, tag: str) -> dict:
    """C sessions in lockstep: per turn, render all, submit all, step until all are done."""
    replies = ReplyMemory()
    sp = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, stop_tokens=tok.stop_tokens)
    keys = [f"{tag}-{i}" for i in range(c)]
    sids = [engine.open_session() for _ in range(c)]
    msgs = [[{"role": "system", "content": SYSTEM}] for _ in range(c)]
    recs = {k: [] for k in keys}
    t_start = time.perf_counter()
    for t in range(turns):
        prompts = []
        for i in range(c):
            msgs[i] += conversation(i, t)
            prompts.append(replies.substitute(keys[i], msgs[i], chat.render(tok, msgs[i])))
        reqs = [
            engine.submit_prompt(sids[i], prompts[i], sampling=sp) for i in range(c)
        ]  # submitted together
        while not all(r.finished for r in reqs):
            engine.step()
        for i, r in enumerate(reqs):
            if r.error is not None:
                raise r.error
            out = list(r.output)
            text = OutputText(tok, tok.stop_tokens, [], ())
            text.update(out, final=True)
            ids = out[:-1] if out and out[-1] in tok.stop_tokens else out
            replies.remember(keys[i], text.text, ids)  # what the server's remember_reply does
            msgs[i].append({"role": "assistant", "content": text.text})
            recs[keys[i]].append(
                dict(
                    latency=r.stats.latency_s,
                    ttft=r.stats.ttft_s,
                    prompt=prompts[i],
                    output=out,
                )
            )
    wall = time.perf_counter() - t_start
    for s in sids:
        engine.close_session(s)
    return dict(records=[recs[k] for k in keys], wall=wall)


# ---- the HTTP arms ------------------------------------------------------------------------------
def http_session(arm, client, url, key, i, turns, max_tokens, barrier, out, errors) -> None:
    """Session i over HTTP, one turn after another (the client re-sends the whole history)."""
    try:
        msgs = [{"role": "system", "content": SYSTEM}]
        conn = None
        if arm == "raw":
            host, port = url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
        barrier.wait()
        for t in range(turns):
            msgs += conversation(i, t)
            kw = dict(model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0)
            extra = {"leyline": {"return_token_ids": True}}
            rec = {}
            if arm == "raw":
                body = json.dumps({**kw, **extra}).encode()
                t0 = time.perf_counter()
                conn.request(
                    "POST",
                    "/v1/chat/completions",
                    body,
                    {"Content-Type": "application/json", "X-Session-Id": key},
                )
                resp = conn.getresponse()
                data = json.loads(resp.read())
                t1 = time.perf_counter()
                assert resp.status == 200, data
                content, ley = data["choices"][0]["message"]["content"], data["leyline"]
            elif arm == "openai":
                t0 = time.perf_counter()
                r = client.chat.completions.create(
                    **kw, extra_headers={"X-Session-Id": key}, extra_body=extra
                )
                t1 = time.perf_counter()
                content, ley = r.choices[0].message.content, r.model_extra["leyline"]
            else:  # stream
                parts, ttft, last = [], None, None
                t0 = time.perf_counter()
                for ch in client.chat.completions.create(
                    **kw, stream=True, extra_headers={"X-Session-Id": key}, extra_body=extra
                ):
                    if ch.choices and ch.choices[0].delta.content:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(ch.choices[0].delta.content)
                    last = ch
                t1 = time.perf_counter()
                content, ley = "".join(parts), last.model_extra["leyline"]
                rec["ttft"] = ttft
            rec.update(
                t0=t0,
                t1=t1,
                latency=t1 - t0,
                prompt=ley["prompt_token_ids"],
                output=ley["output_token_ids"],
            )
            out.append(rec)
            msgs.append({"role": "assistant", "content": content})
        if conn is not None:
            conn.close()
    except BaseException as e:  # reported by the main thread
        errors.append((key, repr(e)))
        barrier.abort()


def run_http(arm, client, server, c, turns, max_tokens, tag, server_log) -> dict:
    keys = [f"{tag}-{i}" for i in range(c)]
    recs = {k: [] for k in keys}
    errors: list = []
    barrier = threading.Barrier(c + 1)
    threads = [
        threading.Thread(
            target=http_session,
            args=(arm, client, server.url, keys[i], i, turns, max_tokens, barrier, recs[keys[i]],
                  errors),
        )  # fmt: skip
        for i in range(c)
    ]
    for th in threads:
        th.start()
    barrier.wait()
    t_start = time.perf_counter()
    for th in threads:
        th.join(600)
    wall = time.perf_counter() - t_start
    if errors:
        raise RuntimeError(f"{arm}: {errors[:3]}")
    for k in keys:  # the server's timestamps of each turn, matched in order
        for rec, srv in zip(recs[k], server_log.pop(k, []), strict=True):
            rec.update(srv)
        req = urllib.request.Request(f"{server.url}/v1/sessions/{k}", method="DELETE")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["deleted"]
    return dict(records=[recs[k] for k in keys], wall=wall)


def hook_server_log(backend) -> dict:
    """Record (arrived, submitted, first token, finished) of every finished turn, per session,
    through the worker's metrics call (an instance attribute: serve/http.py is untouched)."""
    log: dict[str, list[dict]] = {}
    metrics = backend.metrics
    original = metrics.turn_done

    def turn_done(job):
        original(job)
        st = job.request.stats
        log.setdefault(job.session_key, []).append(
            dict(
                arrived=job.arrived,
                submitted=st.submitted_s,
                first=st.first_token_s,
                finished=st.finished_s,
            )
        )

    metrics.turn_done = turn_done
    return log


# ---- the report ---------------------------------------------------------------------------------
def flat(run: dict, field: str) -> list[float]:
    return [r[field] for sess in run["records"] for r in sess if r.get(field) is not None]


def summarize(runs: dict, arms, cs) -> dict:
    """runs[(c, arm)] -> list over repeats of {records, wall}."""
    out = {}
    for c in cs:
        base = runs[(c, "inproc")]
        b_lat = [x for run in base for x in flat(run, "latency")]
        b_ttft = [x for run in base for x in flat(run, "ttft")]
        row = {
            "inproc": dict(
                p50_ms=pct(b_lat, 50) * 1e3,
                p95_ms=pct(b_lat, 95) * 1e3,
                ttft_p50_ms=pct(b_ttft, 50) * 1e3,
                ttft_p95_ms=pct(b_ttft, 95) * 1e3,
                wall_ms=statistics.median(r["wall"] for r in base) * 1e3,
                n=len(b_lat),
            )
        }
        for arm in arms:
            if arm == "inproc":
                continue
            rs = runs[(c, arm)]
            metrics = [("latency", "latency", "")]
            if arm == "stream":
                metrics.append(("ttft", "ttft", "ttft_"))
            d = {"wall_ms": statistics.median(r["wall"] for r in rs) * 1e3}
            for field, bfield, pre in metrics:
                xs = [x for run in rs for x in flat(run, field)]
                bs = b_lat if bfield == "latency" else b_ttft
                paired = []
                for run, brun in zip(rs, base, strict=True):
                    for sess, bsess in zip(run["records"], brun["records"], strict=True):
                        for r, b in zip(sess, bsess, strict=True):
                            if r.get(field) is not None and b.get(bfield) is not None:
                                paired.append(r[field] - b[bfield])
                for q in (50, 95):
                    h, b = pct(xs, q), pct(bs, q)
                    d[f"{pre}p{q}_ms"] = h * 1e3
                    d[f"{pre}overhead_p{q}_ms"] = (h - b) * 1e3
                    d[f"{pre}ratio_p{q}"] = h / b
                d[f"{pre}paired_median_overhead_ms"] = statistics.median(paired) * 1e3
                d[f"{pre}n"] = len(xs)
            if arm in ("openai", "raw"):  # the server's timestamps split the latency
                seg = {"pre": [], "handoff": [], "engine": [], "post": []}
                for run in rs:
                    for sess in run["records"]:
                        for r in sess:
                            seg["pre"].append(r["arrived"] - r["t0"])
                            seg["handoff"].append(r["submitted"] - r["arrived"])
                            seg["engine"].append(r["finished"] - r["submitted"])
                            seg["post"].append(r["t1"] - r["finished"])
                d["segments_p50_ms"] = {k: pct(v, 50) * 1e3 for k, v in seg.items()}
                d["segments_mean_ms"] = {k: float(np.mean(v)) * 1e3 for k, v in seg.items()}
            row[arm] = d
        out[str(c)] = row
    return out


def agreement(runs: dict, arms, cs) -> dict:
    """Turns whose prompt or output differs from inproc's (same repeat, session, turn)."""
    res = {}
    for c in cs:
        for arm in arms:
            if arm == "inproc":
                continue
            bad = total = 0
            for run, brun in zip(runs[(c, arm)], runs[(c, "inproc")], strict=True):
                for sess, bsess in zip(run["records"], brun["records"], strict=True):
                    for r, b in zip(sess, bsess, strict=True):
                        total += 1
                        bad += r["prompt"] != b["prompt"] or r["output"] != b["output"]
            res[f"{c}/{arm}"] = {"differ": bad, "turns": total}
    return res


def table(summary: dict, cs, arms) -> str:
    lines = [
        "| C | arm | p50 ms | p95 ms | in-proc p50 | in-proc p95 | overhead p50 ms (ratio) "
        "| overhead p95 ms (ratio) | paired Δ p50 ms | workload wall ms (in-proc) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cs:
        row = summary[str(c)]
        b = row["inproc"]
        for arm in arms:
            if arm == "inproc":
                continue
            d = row[arm]
            for pre, name, bp in (("", arm, ""), ("ttft_", f"{arm} TTFT", "ttft_")):
                if f"{pre}p50_ms" not in d:
                    continue
                lines.append(
                    f"| {c} | {name} | {d[f'{pre}p50_ms']:.1f} | {d[f'{pre}p95_ms']:.1f} "
                    f"| {b[f'{bp}p50_ms']:.1f} | {b[f'{bp}p95_ms']:.1f} "
                    f"| {d[f'{pre}overhead_p50_ms']:+.1f} ({d[f'{pre}ratio_p50']:.2f}x) "
                    f"| {d[f'{pre}overhead_p95_ms']:+.1f} ({d[f'{pre}ratio_p95']:.2f}x) "
                    f"| {d[f'{pre}paired_median_overhead_ms']:+.1f} "
                    f"| {d['wall_ms']:.0f} ({b['wall_ms']:.0f}) |"
                )
    seg_arms = [a for a in arms if a in ("openai", "raw")]
    if seg_arms:
        lines += [
            "",
            "Where an HTTP turn's time goes (p50 ms of each segment, server timestamps):",
            "",
            "| C | arm | pre (client → handler) | hand-off (→ engine) | engine | post (→ parsed "
            "reply) | in-proc latency p50 |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for c in cs:
            for arm in seg_arms:
                s = summary[str(c)][arm]["segments_p50_ms"]
                lines.append(
                    f"| {c} | {arm} | {s['pre']:.2f} | {s['handoff']:.2f} | {s['engine']:.2f} "
                    f"| {s['post']:.2f} | {summary[str(c)]['inproc']['p50_ms']:.2f} |"
                )
    return "\n".join(lines)


# ---- floors -------------------------------------------------------------------------------------
def floors(client, server, tok, n: int = 50) -> dict:
    """A no-engine round trip (GET /v1/models: openai client and raw http.client) and the
    server-side rendering of one turn's prompt, p50 of n."""

    def p50(fn):
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)

    def raw_models():
        conn.request("GET", "/v1/models")
        json.loads(conn.getresponse().read())

    msgs = [{"role": "system", "content": SYSTEM}]
    for t in range(4):
        msgs += conversation(0, t) + [{"role": "assistant", "content": "ok"}]
    res = dict(
        models_openai_ms=p50(lambda: client.models.list()),
        models_raw_ms=p50(raw_models),
        render_ms=p50(lambda: chat.render(tok, msgs)),
        render_tokens=len(chat.render(tok, msgs).tokens),
    )
    conn.close()
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--arms", default="inproc,openai,stream,raw")
    ap.add_argument("--root", default=".checkpoints", help="where the tiny default lives")
    ap.add_argument("--out", default="benchmarks/results_http.json")
    ap.add_argument(
        "--compile-cache",
        default=None,
        help="keep compiled programs in DIR (default: serve.compile_cache's; off: none)",
    )
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
    compile_cache.enable(args.compile_cache)
    model = ll.load_model(ensure_default_checkpoints(args.root)["deepseek_v3"])
    base_tok = chat.ChatTokenizer()
    tok = ModVocabTokenizer(base_tok, model.config.vocab_size)
    inproc = Engine(model, **ENGINE)
    served = Engine(model, **ENGINE)
    t0 = time.perf_counter()
    inproc.warmup()
    served.warmup()
    t_warm = time.perf_counter() - t0
    print(f"warmup (both engines): {t_warm:.1f} s", flush=True)
    backend = Backend.for_engine(served, base_tok, MODEL, max_queue=64)
    server_log = hook_server_log(backend)
    server = ServerThread(backend).start()
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120
    )
    runs: dict = {(c, a): [] for c in cs for a in arms}
    try:
        t0 = time.perf_counter()
        for c in cs:  # the untimed pass: every arm's workload once
            for arm in arms:
                tag = f"warm-c{c}-{arm}"
                if arm == "inproc":
                    run_inproc(inproc, tok, c, args.turns, args.max_tokens, tag)
                else:
                    run_http(arm, client, server, c, args.turns, args.max_tokens, tag, server_log)
        print(f"untimed pass: {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        for rep in range(args.repeats):
            for c in cs:
                order = arms if rep % 2 == 0 else arms[::-1]
                for arm in order:
                    tag = f"r{rep}-c{c}-{arm}"
                    if arm == "inproc":
                        run = run_inproc(inproc, tok, c, args.turns, args.max_tokens, tag)
                    else:
                        run = run_http(
                            arm, client, server, c, args.turns, args.max_tokens, tag, server_log
                        )
                    runs[(c, arm)].append(run)
            print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
        t_timed = time.perf_counter() - t0
        fl = floors(client, server, tok)
    finally:
        server.stop()
    summary = summarize(runs, arms, cs)
    agree = agreement(runs, arms, cs)
    outputs = [len(r["output"]) for run in runs[(cs[0], "inproc")] for s in run["records"]
               for r in s]  # fmt: skip
    print()
    print(table(summary, cs, arms))
    print()
    print(
        f"floors: GET /v1/models {fl['models_openai_ms']:.2f} ms (openai client), "
        f"{fl['models_raw_ms']:.2f} ms (http.client); rendering a {fl['render_tokens']}-token "
        f"prompt {fl['render_ms']:.2f} ms"
    )
    print(f"agreement with inproc (prompt and output ids): {agree}")
    print(f"completion tokens per turn: mean {np.mean(outputs):.1f} (max {args.max_tokens})")
    wall = time.perf_counter() - t_all
    print(f"wall: {wall:.0f} s (warmup {t_warm:.0f} s, timed repeats {t_timed:.0f} s)")
    result = dict(
        config=dict(
            repeats=args.repeats,
            turns=args.turns,
            max_tokens=args.max_tokens,
            concurrency=cs,
            arms=arms,
            engine={k: str(v) for k, v in ENGINE.items()},
            model="tiny deepseek_v3",
            python=sys.version.split()[0],
            jax=jax.__version__,
            backend=jax.default_backend(),
        ),
        summary=summary,
        floors=fl,
        agreement=agree,
        completion_tokens_mean=float(np.mean(outputs)),
        wall_s=wall,
        warmup_s=t_warm,
        timed_s=t_timed,
        runs={
            f"{c}/{a}": [
                dict(
                    wall=run["wall"],
                    latency=[[r["latency"] for r in s] for s in run["records"]],
                    ttft=[[r.get("ttft") for r in s] for s in run["records"]],
                )
                for run in runs[(c, a)]
            ]
            for c in cs
            for a in arms
        },
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
