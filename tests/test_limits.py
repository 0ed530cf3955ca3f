"""Bounded requests (`serve.http.limits`) on a live server: a body over the limit is a 413 at
once (by its Content-Length) or as soon as the limit is passed (chunked), a body that stops
arriving is a 408 within its timeout, and `/health` answers meanwhile; a body just under the
limit is served (the case that tells a limit from a refusal)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import jax.numpy as jnp
import pytest

pytest.importorskip("fastapi")

import leyline_jax as ll  # noqa: E402
from checkpoints.tiny import ensure_default_checkpoints  # noqa: E402
from serve import chat  # noqa: E402
from serve.engine import Engine  # noqa: E402
from serve.http import Backend, ServerThread  # noqa: E402

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = ll.load_model(ensure_default_checkpoints(root)["deepseek_v3"])
    engine = Engine(model, num_pages=64, page_size=16, max_seqs=2, kv_dtype=jnp.float32)
    backend = Backend.for_engine(engine, chat.ChatTokenizer(), "tiny")
    backend.max_body_bytes, backend.body_timeout_s = LIMIT, 1.0
    with ServerThread(backend) as srv:
        yield srv


def raw(srv, head: bytes, body: bytes = b"", wait: float = 10.0) -> tuple[int, float]:
    """(status, seconds to the answer) of a request written by hand on a socket."""
    with socket.create_connection((srv.host, srv.port), timeout=wait) as s:
        t0 = time.perf_counter()
        s.sendall(head + body)
        answer = s.recv(65536)
        return int(answer.split()[1]), time.perf_counter() - t0


def head(length: int | None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    lines = ["POST /v1/completions HTTP/1.1", "Host: x", "Content-Type: application/json", size]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def health_ms(srv) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
        assert r.status == 200
    return 1000 * (time.perf_counter() - t0)


def test_a_large_body_is_413_at_once(server):
    status, took = raw(server, head(50 << 20))  # 50 MB announced, none sent
    assert status == 413 and took < 5
    chunk = b"x" * (256 << 10)
    chunked = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 8  # 2 MiB, no length announced
    assert raw(server, head(None), chunked)[0] == 413


def test_a_body_under_the_limit_is_served(server):
    body = json.dumps(
        {"model": "tiny", "prompt": "hi", "max_tokens": 1, "user": "u" * (LIMIT // 2)}
    )
    status, _ = raw(server, head(len(body)), body.encode(), wait=120)
    assert status == 200


def test_a_half_sent_body_is_408_within_its_timeout_and_health_answers(server):
    got = {}

    def stall():
        got["answer"] = raw(server, head(1000), b'{"model": "tiny", ')

    t = threading.Thread(target=stall)
    t.start()
    time.sleep(0.2)
    got["health_ms"] = max(health_ms(server) for _ in range(3))
    t.join(30)
    status, took = got["answer"]
    assert status == 408 and took < 5  # the timeout is 1 s
    assert got["health_ms"] < 1000


def test_a_snapshot_is_written_off_the_engine_thread(tmp_path, monkeypatch):
    """While a snapshot's files are being written (made slow here), turns keep running and
    `/health` answers; the snapshot then completes. Written on the engine's thread (the
    failing case, `EngineWorker.snapshot` without its answer), the turn would wait for it."""
    import checkpoints.sessions as files

    slow = files._write_meta

    def write_meta(path, text):
        time.sleep(3)
        slow(path, text)

    monkeypatch.setattr(files, "_write_meta", write_meta)
    root = tmp_path / "ckpt"
    model = ll.load_model(ensure_default_checkpoints(root)["deepseek_v3"])
    engine = Engine(model, num_pages=64, page_size=16, max_seqs=2, kv_dtype=jnp.float32)
    backend = Backend.for_engine(engine, chat.ChatTokenizer(), "tiny")
    backend.snapshot_dir = str(tmp_path / "snaps")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    with ServerThread(backend) as srv:
        data = json.dumps(body).encode()
        assert raw(srv, head(len(data)), data, wait=120)[0] == 200  # compiled, warm
        got = {}

        def snap():
            got["snapshot"] = raw(srv, b"POST /v1/snapshot HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Length: 0\r\n\r\n", wait=60)  # fmt: skip

        t = threading.Thread(target=snap)
        t.start()
        time.sleep(0.5)
        status, took = raw(srv, head(len(data)), data, wait=60)
        assert status == 200 and took < 2.5, took  # the write takes 3 s
        assert health_ms(srv) < 1000
        t.join(60)
        assert got["snapshot"][0] == 200 and got["snapshot"][1] >= 3
