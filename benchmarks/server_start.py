"""The server as a new user starts it: `python -m serve.http --model smollm2` on this machine,
in fresh processes, each timed from launch.

- `cold`: `--warmup` with an empty compilation cache: seconds until `/health` answers 200 (every
  shape compiled), the warmup's own seconds (its log), and the process's peak resident memory
  then (`VmHWM`).
- `warm`: the same command again on the cache the cold start filled.
- `first_token`: without `--warmup`, on an empty cache: seconds until `/health` answers, then
  from sending a chat completion (streamed) to its first token, and to its end.

    python -m benchmarks.server_start [--root CHECKOUT] [--out results.json]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

PORT = 8137


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _peak_rss_gb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))
    return kb / 1e6


def start(root: str, cache: str, *flags: str, log: str) -> dict:
    """Launch the server, wait for /health 200; its process, seconds to ready, peak memory."""
    cmd = [sys.executable, "-m", "serve.http", "--model", "smollm2", "--port", str(PORT)]
    cmd += ["--compile-cache", cache, *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    while _health(PORT) != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}: see {log}")
        time.sleep(0.5)
    ready = time.perf_counter() - t0
    return {
        "proc": proc,
        "ready_s": round(ready, 1),
        "peak_rss_gb": round(_peak_rss_gb(proc.pid), 2),
    }


def stop(proc) -> None:
    proc.terminate()
    proc.wait(60)


def first_token(port: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    t0 = time.perf_counter()
    first = None
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name three colours of the rainbow."}],
        max_tokens=16,
        stream=True,
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return {"first_token_s": round(first, 2), "turn_s": round(time.perf_counter() - t0, 2)}


def main(argv=None) -> None:
    from benchmarks import harness

    ap = harness.parser(__doc__)
    ap.add_argument("--root", default=".", help="the checkout to start (default: this one)")
    args = ap.parse_args(argv)
    out: dict = {}
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as empty:
        log = os.path.join(cache, "server.log")
        for name, where in (("cold", cache), ("warm", cache)):
            run = start(args.root, where, "--warmup", log=log)
            stop(run.pop("proc"))
            text = open(log).read()
            shapes = re.findall(r"warmup (\d+)/(\d+): .*\((\d+\.\d) s in all\)", text)
            run["shapes"], run["warmup_s"] = int(shapes[-1][1]), float(shapes[-1][2])
            out[name] = run
            print(name, run, flush=True)
        run = start(args.root, empty, log=log)
        run |= first_token(PORT)
        stop(run.pop("proc"))
        out["first_token"] = run
        print("first_token", run, flush=True)
    harness.save_json(args.out, out)


if __name__ == "__main__":
    main()
