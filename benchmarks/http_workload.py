"""The HTTP benchmark's workload (`benchmarks.http_bench` describes it): the rig it runs on, the
in-process arm, the HTTP arms' clients, the server's timestamps of each turn, and the floors."""

from __future__ import annotations

import cProfile
import dataclasses
import http.client
import json
import threading
import time
import types
import urllib.request

import jax.numpy as jnp

from benchmarks import harness
from serve import chat
from serve.engine import Engine
from serve.http.backend import Backend
from serve.http.history import ReplyMemory
from serve.http.server import ServerThread
from serve.http.text import ModVocabTokenizer, OutputText
from serve.sampling import SamplingParams

ENGINE = dict(num_pages=512, page_size=16, max_seqs=16, kv_dtype=jnp.float32)
MODEL = "tiny"
SYSTEM = "You are a terse assistant. Tool results arrive in tool messages."
HTTP_ARMS = ("openai", "stream", "raw")
EXTRA = {"leyline": {"return_token_ids": True}}  # every HTTP request's extra body


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


def start(model, turns: int, max_tokens: int) -> tuple[Rig, float]:
    """Both engines warmed, the server started on one (its turns logged) and the openai client
    made: (the rig, the warm-up's seconds)."""
    import openai

    base_tok = chat.ChatTokenizer()
    inproc, served = Engine(model, **ENGINE), Engine(model, **ENGINE)
    t_warm = harness.timed(lambda: (inproc.warmup(), served.warmup()))
    print(f"warmup (both engines): {t_warm:.1f} s", flush=True)
    backend = Backend.for_engine(served, base_tok, MODEL, max_queue=64)
    server_log, ctx = hook_server_log(backend)
    server = ServerThread(backend).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    tok = ModVocabTokenizer(base_tok, model.config.vocab_size)
    return Rig(inproc, tok, server, client, server_log, ctx, turns, max_tokens), t_warm


def conversation(i: int, turn: int) -> list[dict]:
    """The messages session i adds at `turn` (tests/test_http.py's conversation)."""
    tool = json.dumps({"session": i, "turn": turn, "result": "ok" * (3 + i + turn)})
    return [{"role": "tool", "content": tool}, {"role": "user", "content": f"Turn {turn}: and?"}]


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds a running thread has used (its own clock: XLA's threads not included)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


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
    barrier = threading.Barrier(c + 1)
    shared = types.SimpleNamespace(barrier=barrier, errors=[], cpu=[], profiles=profiles)
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


def http_arms(arms) -> list[str]:
    return [a for a in arms if a != "inproc"]


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


def timed_repeats(rig: Rig, arms, cs, repeats: int) -> tuple[dict, float]:
    """Every workload once untimed, then `repeats` times in alternating order: (runs[(c, arm)],
    a run per repeat; the timed repeats' seconds)."""
    warm = harness.timed(lambda: [rig.run(a, c, f"warm-c{c}-{a}") for c in cs for a in arms])
    print(f"untimed pass: {warm:.1f} s", flush=True)
    runs: dict = {(c, a): [] for c in cs for a in arms}
    t0 = time.perf_counter()
    for rep in range(repeats):
        for c in cs:
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                runs[(c, arm)].append(rig.run(arm, c, f"r{rep}-c{c}-{arm}"))
        print(f"repeat {rep + 1}/{repeats} done", flush=True)
    return runs, time.perf_counter() - t0
