"""A deployed server under a hostile client and an operator: `python -m serve.http --model tiny
--snapshot-dir DIR` in a process of its own, with `--sessions` named sessions open.

- `health_ms`: `GET /health` latencies (p50, max) while idle, while a client sends a 50 MB body
  (and the seconds to its 413), and while five `POST /v1/snapshot` run at once (and the seconds
  until all five answered).
- `turn_ms`: a chat turn's latency while idle and while the five snapshots run.
- `shutdown_s`: SIGTERM to the process's exit (the shutdown snapshot included).

With `--idle N` it measures idle sessions instead (no snapshot dir, no session cap): N named
sessions opened one turn each by 8 clients, each a `--tokens`-id prompt (a prefix all share,
held once by the radix cache, then 16 ids of its own) and a one-token reply; the server's
resident memory (VmRSS) every N/10 sessions, the bytes each session added, turn and `/health`
latencies at the end, and a turn continuing the first (long offloaded) session.

    python -m benchmarks.deploy_bench [--sessions 200] [--idle N [--tokens 512]] [--out F]
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from benchmarks.harness import parser, percentile, save_json, section
from serve.http.server import free_port


def _get(url: str, path: str, body=None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, method="POST" if body is not None else "GET"
    )
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def _health_during(url: str, work) -> tuple[list[float], float]:
    """/health latencies (ms) sampled while `work()` runs on a thread; `work`'s seconds."""
    took, samples = {}, []

    def run():
        t0 = time.perf_counter()
        work()
        took["s"] = time.perf_counter() - t0

    t = threading.Thread(target=run)
    t.start()
    while t.is_alive():
        t0 = time.perf_counter()
        _get(url, "/health")
        samples.append(1000 * (time.perf_counter() - t0))
        time.sleep(0.02)
    t.join()
    return samples, took["s"]


def _big_body(port: int, size: int = 50 << 20) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        try:
            chunk = b"x" * (1 << 20)
            for _ in range(size // len(chunk)):
                s.sendall(chunk)
        except OSError:  # the server answered 413 and closed: as it should
            pass
        assert s.recv(64).split()[1] == b"413"


def _server(*args: str) -> tuple[subprocess.Popen, int, str]:
    """`python -m serve.http --model tiny --max-seqs 16 ARGS` in a process of its own, once it
    answers /health: (the process, its port, its URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve.http", "--model", "tiny", "--port", str(port),
           "--max-seqs", "16", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            _get(url, "/health", timeout=5)
            return proc, port, url
        except OSError:
            time.sleep(0.2)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS"))


def run_idle(n: int, tokens: int, clients: int = 8) -> dict:
    proc, _, url = _server("--max-sessions", "0", "--session-ttl", "0", "--warmup")
    vocab = 256  # the tiny model's

    def turn(i: int) -> float:
        ids = [j * 7 % vocab for j in range(tokens - 16)] + [(i + j) % vocab for j in range(16)]
        body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "session_id": f"s{i}"}
        t0 = time.perf_counter()
        _get(url, "/v1/completions", body)
        return 1000 * (time.perf_counter() - t0)

    first = max(n // 10, 1)
    rows, done, t0 = [], 0, time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        for end in range(first, n + 1, first):
            ms = list(ex.map(turn, range(done, end)))
            done, rss = end, _rss_mb(proc.pid)
            elapsed = time.perf_counter() - t0
            rows.append(
                {"sessions": done, "rss_mb": rss, "s": elapsed, "turn_ms_p50": percentile(ms, 50)}
            )
    old = [turn(0) for _ in range(5)]  # the first session, offloaded long ago, continued
    health, _ = _health_during(url, lambda: time.sleep(2))
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    grown = rows[-1]["rss_mb"] - rows[0]["rss_mb"]
    per = grown * 2**20 / max(rows[-1]["sessions"] - rows[0]["sessions"], 1)
    return {"sessions": done, "tokens": tokens, "checkpoints": rows, "bytes_per_session": per,
            "old_session_turn_ms": old, "health_ms": health}  # fmt: skip


def run(sessions: int) -> dict:
    snaps = tempfile.mkdtemp(prefix="leyline-deploy-")
    proc, port, url = _server("--snapshot-dir", snaps)

    def turn(name: str) -> float:
        body = {"model": "tiny", "prompt": [7 + hash(name) % 200] * 64, "max_tokens": 1}
        t0 = time.perf_counter()
        _get(url, "/v1/completions", body | {"session_id": name})
        return 1000 * (time.perf_counter() - t0)

    for i in range(sessions):
        turn(f"s{i}")
    idle = [turn(f"s{i % sessions}") for i in range(20)]
    health_idle, _ = _health_during(url, lambda: time.sleep(2))
    health_body, body_s = _health_during(url, lambda: _big_body(port))
    busy: list[float] = []

    def snapshots():
        threads = [threading.Thread(target=_get, args=(url, "/v1/snapshot", {})) for _ in range(5)]
        for t in threads:
            t.start()
        t0 = time.time()
        while any(t.is_alive() for t in threads) and time.time() - t0 < 120:
            busy.append(turn(f"s{len(busy) % sessions}"))
        for t in threads:
            t.join()

    health_snap, snap_s = _health_during(url, snapshots)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    shutdown_s = time.perf_counter() - t0

    def p(xs):
        return {"p50": percentile(xs, 50), "max": max(xs), "n": len(xs)}

    return {
        "sessions": sessions,
        "health_ms": {
            "idle": p(health_idle),
            "50MB_body": p(health_body),
            "5_snapshots": p(health_snap),
        },  # fmt: skip
        "turn_ms": {"idle": p(idle), "5_snapshots": p(busy)},
        "body_413_s": body_s,
        "snapshots_s": snap_s,
        "shutdown_s": shutdown_s,
    }


def main(argv=None) -> None:
    ap = parser(__doc__, out=None)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--idle", type=int, default=0, help="measure N idle sessions instead")
    ap.add_argument("--tokens", type=int, default=512, help="each idle session's prompt")
    args = ap.parse_args(argv)
    if args.idle:
        r = run_idle(args.idle, args.tokens)
        save_json(args.out, r)
        rows = [[str(c["sessions"]), f"{c['rss_mb']:.0f}", f"{c['s']:.0f}",
                 f"{c['turn_ms_p50']:.1f}"] for c in r["checkpoints"]]  # fmt: skip
        head = ["sessions", "RSS MB", "elapsed s", "turn ms p50"]
        print("\n".join(section(f"{args.idle} idle sessions of {args.tokens} tokens", head, rows)))
        h, old = r["health_ms"], r["old_session_turn_ms"]
        print(f"{r['bytes_per_session']:.0f} bytes a session; /health p50 "
              f"{percentile(h, 50):.1f} max {max(h):.1f} ms; the first session continued: "
              f"{', '.join(f'{x:.0f}' for x in old)} ms")  # fmt: skip
        return
    r = run(args.sessions)
    save_json(args.out, r)
    rows = [[what, f"{v['p50']:.1f}", f"{v['max']:.1f}", str(v["n"])] for what, v in
            [(f"/health, {k}", x) for k, x in r["health_ms"].items()]
            + [(f"turn, {k}", x) for k, x in r["turn_ms"].items()]]  # fmt: skip
    print("\n".join(section(f"{r['sessions']} sessions", ["ms", "p50", "max", "samples"], rows)))
    print(f"50 MB body -> 413 in {r['body_413_s']:.2f} s; five snapshots {r['snapshots_s']:.2f} s;"
          f" SIGTERM -> exit {r['shutdown_s']:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
