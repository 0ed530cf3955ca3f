"""Nothing blocks the event loop: while a 10 MB chat request (under the 16 MiB body limit) is
parsed, validated, rendered and tokenized, `GET /health` answers within 100 ms at the 99th
percentile, on the tiny default model (DeepSeek's tokenizer, ids taken modulo its vocabulary)
and on SmolLM2 (its GGUF's tokenizer); the request itself gets its answer, a 400 naming
`messages` (millions of tokens: far past the context). And the measurement fails where the
loop is blocked: a toy app whose handler sleeps on it, and the tiny model's server with the
tokenizer call that holds the GIL put back (why the server's is as it is: `serve.http.body`,
`serve.chat.ChatTokenizer.encode`).

The poller is a process of its own, so its timing shares no GIL with the server's, and polls on
a fixed schedule (every 10 ms); a poll's latency counts from when it was due, so a loop stalled
for a second delays every poll due meanwhile (a hundred samples), not the one in flight alone.

Run as a script, it measures `python -m serve.http` in a process of its own:

    .venv/bin/python tests/test_event_loop.py [--model tiny|smollm2] [--megabytes 10]
        [--shape text|messages|parts] [--reps 3] [--repo DIR (the checkout to serve from)]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

LIMIT = 0.100  # seconds: /health's 99th percentile while the big request is in flight
EVERY = 0.010  # seconds between polls
MB = 1_000_000
WORDS = (
    "The quick brown fox jumps over the lazy dog while a tool reports 42 results; "
    "agents re-send their whole history, edits and all, on every turn of a long session. "
)

# the poller: GET /health every `EVERY` s until a line arrives on stdin, then the latencies
POLLER = """
import http.client, json, select, sys, time
port, every = int(sys.argv[1]), float(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
def health():
    conn.request("GET", "/health")
    conn.getresponse().read()
health()
print("ready", flush=True)
lat, start, k = [], time.perf_counter(), 0
while True:
    due = start + k * every
    wait = due - time.perf_counter()
    if wait > 0 and select.select([sys.stdin], [], [], wait)[0]:
        break  # told to stop, with no poll overdue
    health()
    lat.append(time.perf_counter() - due)  # from when it was due
    k += 1
print(json.dumps(lat), flush=True)
"""


@dataclasses.dataclass
class Measured:
    """A request's answer and how long it took; the /health latencies (seconds) meanwhile."""

    status: int
    answer: bytes
    took: float
    latencies: list[float]

    def quantile(self, q: float) -> float:
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, int(q * len(lat)))]

    @property
    def p50(self) -> float:
        return self.quantile(0.50)

    @property
    def p99(self) -> float:
        return self.quantile(0.99)

    def __str__(self) -> str:
        return (
            f"HTTP {self.status} in {self.took:.2f} s; /health over {len(self.latencies)} polls:"
            f" p50 {self.p50 * 1e3:.1f} ms, p99 {self.p99 * 1e3:.1f} ms,"
            f" max {max(self.latencies) * 1e3:.0f} ms"
        )


@contextlib.contextmanager
def polling(port: int):
    """Poll the server's /health from a process of its own while the block runs; the list it
    yields holds the latencies once the block ends."""
    poller = [sys.executable, "-c", POLLER, str(port), str(EVERY)]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with subprocess.Popen(poller, **pipes) as proc:
        try:
            assert proc.stdout.readline().strip() == "ready"
            latencies: list[float] = []
            yield latencies
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            latencies += json.loads(proc.stdout.readline())
        finally:
            proc.kill()


def chat_body(model: str, size: int = 10 * MB, shape: str = "text") -> bytes:
    """A chat request of about `size` bytes: one user message of prose ("text"), many short
    messages ("messages"), or one message of many short content parts ("parts")."""
    if shape == "text":
        messages = [{"role": "user", "content": (WORDS * (size // len(WORDS)))[: size - 100]}]
    elif shape == "messages":
        one = {"role": "user", "content": WORDS}
        messages = [one] * (size // len(json.dumps(one)))
    else:
        part = {"type": "text", "text": "a few words"}
        messages = [{"role": "user", "content": [part] * (size // len(json.dumps(part)))}]
    return json.dumps({"model": model, "messages": messages, "max_tokens": 1}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, data: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def measure(port: int, data: bytes, path: str = "/v1/chat/completions") -> Measured:
    """POST `data` to `path` while polling /health."""
    with polling(port) as latencies:
        time.sleep(0.2)
        t0 = time.perf_counter()
        status, answer = post(port, path, data)
        took = time.perf_counter() - t0
        time.sleep(0.2)
    return Measured(status, answer, took, latencies)


def assert_free(port: int, model: str, record_property, shape: str = "text") -> None:
    """/health's p99 under `LIMIT` beside a 10 MB chat request, which gets its 400."""
    m = measure(port, chat_body(model, shape=shape))
    record_property("measured", str(m))
    err = json.loads(m.answer)["error"]
    assert m.status == 400 and err["code"] == "context_length_exceeded", (m.status, err)
    assert err["param"] == "messages", err
    assert m.p99 < LIMIT, str(m)


# ---- the servers ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from serve.engine import EngineConfig
    from serve.http.backend import load_backend
    from serve.http.server import ServerThread

    root = tmp_path_factory.mktemp("ckpt")
    config = EngineConfig(num_pages=64, page_size=16, max_seqs=2, max_seq_len=1024)
    with ServerThread(load_backend("tiny", config, root=str(root))) as srv:
        yield srv


@pytest.mark.parametrize("shape", ["text", "parts"])
def test_health_stays_fast_beside_a_10mb_chat_request_tiny(tiny_server, shape, record_property):
    assert_free(tiny_server.port, "tiny", record_property, shape)


def test_health_stays_fast_beside_a_10mb_chat_request_smollm2(record_property):
    from serve.engine import EngineConfig
    from serve.http.backend import load_backend
    from serve.http.server import ServerThread

    config = EngineConfig(num_pages=64, page_size=16, max_seqs=2, max_seq_len=1024)
    with ServerThread(load_backend("smollm2", config)) as srv:
        assert_free(srv.port, "smollm2", record_property)


# ---- the check fails where the loop is blocked ----------------------------------------------
def toy_app(block_s: float):
    """A toy app: /health, and a chat route that blocks the loop for `block_s` seconds."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def chat(request):
        await request.body()
        time.sleep(block_s)  # on the event loop: nothing else runs meanwhile
        return JSONResponse({"blocked": block_s})

    routes = [Route("/health", health), Route("/v1/chat/completions", chat, methods=["POST"])]
    return Starlette(routes=routes)


@contextlib.contextmanager
def serving(app):
    """Serve `app` with uvicorn in a thread of this process; yields its port."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_check_fails_on_a_blocked_loop(record_property):
    with serving(toy_app(0.5)) as port:
        m = measure(port, chat_body("toy", MB))
    record_property("measured", str(m))
    assert m.status == 200
    assert m.p99 >= LIMIT, str(m)  # 50 polls were due while it slept
    assert max(m.latencies) >= 0.4, str(m)


def test_the_check_fails_with_the_gil_held_while_tokenizing(
    tiny_server, monkeypatch, record_property
):
    """The server as it was: the tokenizer's call that holds the GIL (2 MB: some 1.4 s of it)."""
    from serve import chat

    monkeypatch.setattr(chat, "GIL_FREE", 1 << 62)
    m = measure(tiny_server.port, chat_body("tiny", 2 * MB))
    record_property("measured", str(m))
    assert m.status == 400
    assert m.p99 >= LIMIT, str(m)


def test_the_check_fails_with_content_parts_parsed_here(tiny_server, monkeypatch, record_property):
    """The server as it was: a body of 256,410 content parts parsed and validated in the
    route's thread (`json.loads` and the collector's passes over the parts hold the GIL), not
    in the parsing process with its parts joined (`serve.http.body.APART`)."""
    from serve.http import body

    monkeypatch.setattr(body, "APART", 1 << 62)
    m = measure(tiny_server.port, chat_body("tiny", shape="parts"))
    record_property("measured", str(m))
    assert m.status == 400
    assert m.p99 >= LIMIT, str(m)


# ---- as a script: `python -m serve.http` in a process of its own ------------------------------
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny or smollm2")
    ap.add_argument("--megabytes", type=float, default=10.0, help="the chat request's size")
    ap.add_argument("--shape", default="text", choices=["text", "messages", "parts"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    args = ap.parse_args(argv)
    port = free_port()
    cmd = [sys.executable, "-m", "serve.http", "--model", args.model, "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=args.repo)
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, cwd=args.repo, env=env, **quiet)
    try:
        while True:
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            if proc.poll() is not None:
                sys.exit("the server did not start")
            time.sleep(0.5)
        data = chat_body(args.model, int(args.megabytes * MB), args.shape)
        print(f"{args.model}, {args.shape}, {len(data) / MB:.1f} MB, served from {args.repo}:")
        for _ in range(args.reps):
            print(" ", measure(port, data), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
