"""The HTTP server's own overhead: the same turns over `serve.http` and through the engine alone.

Two identically sized engines over the tiny default model (`deepseek_v3`, fp32 KV, 512 pages
of 16, 16 sequences), both warmed (`Engine.warmup()`, then an untimed pass of the whole
workload). One serves HTTP (`serve.http.server.ServerThread`, uvicorn in a thread, the engine on
its worker thread, DeepSeek's tokenizer with ids modulo the vocabulary, as tests/test_http.py);
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

import sys
import time

import leyline_jax as ll
from benchmarks import harness
from benchmarks.http_report import profile_pass, report
from benchmarks.http_workload import ENGINE, HTTP_ARMS, floors, start, timed_repeats
from checkpoints.tiny import ensure_default_checkpoints
from serve import compile_cache


def parser():
    ap = harness.parser(__doc__, out="benchmarks/results_http.json", repeats=10, cache=True)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--arms", default="inproc,openai,stream,raw")
    ap.add_argument("--root", default=".checkpoints", help="where the tiny default lives")
    profile = "one more workload per HTTP arm at the largest C, profiled: self time by package"
    ap.add_argument("--profile", action="store_true", help=profile)
    switch = "sys.setswitchinterval(S) for the whole run (default: Python's, 0.005)"
    ap.add_argument("--switch-interval", type=float, help=switch)
    return ap


def main(argv=None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
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
    rig, t_warm = start(model, args.turns, args.max_tokens)
    try:
        runs, t_timed = timed_repeats(rig, arms, cs, args.repeats)
        fl = floors(rig)
        profiles = profile_pass(rig, arms, max(cs)) if args.profile else None
    finally:
        rig.server.stop()
    result = report(args, cs, arms, runs, rig.tok, fl, profiles, (t_all, t_warm, t_timed))
    harness.save_json(args.out, result, indent=1)
    return result


if __name__ == "__main__":
    main()
