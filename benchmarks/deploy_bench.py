"""A deployed server under a hostile client and an operator: `python -m serve.http --model tiny
--snapshot-dir DIR` in a process of its own, with `--sessions` named sessions open.

- `health_ms`: `GET /health` latencies (p50, max) while idle, while a client sends a 50 MB body
  (and the seconds to its 413), and while five `POST /v1/snapshot` run at once (and the seconds
  until all five answered).
- `turn_ms`: a chat turn's latency while idle and while the five snapshots run.
- `shutdown_s`: SIGTERM to the process's exit (the shutdown snapshot included).

    python -m benchmarks.deploy_bench [--sessions 200] [--out results.json]
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

from benchmarks.harness import parser, percentile, save_json, section
from serve.http import free_port


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


def run(sessions: int) -> dict:
    port, snaps = free_port(), tempfile.mkdtemp(prefix="leyline-deploy-")
    cmd = [sys.executable, "-m", "serve.http", "--model", "tiny", "--port", str(port),
           "--snapshot-dir", snaps, "--max-seqs", "16"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            _get(url, "/health", timeout=5)
            break
        except OSError:
            time.sleep(0.2)

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
    args = ap.parse_args(argv)
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
