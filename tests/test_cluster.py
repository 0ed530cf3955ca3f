"""Two replicas of the tiny model behind vLLM's router (`serve.cluster`: vllm-router, its
`consistent_hash` policy), through the official `openai` client: every turn of a session
lands on one replica (its second turn reuses the first's KV, which only that replica holds); a
stream of sessionless requests (each with its `X-Request-Id`) is spread over both; draining a
replica moves its sessions to the other, whose next turns reuse their KV (counted)."""

from __future__ import annotations

import concurrent.futures as cf
import socket
import subprocess

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serve import cluster  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(tiny_replicas):
    replicas = tiny_replicas
    port = _port()
    cmd = cluster.router_command(port, [r.url for r in replicas], metrics_port=_port())
    router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    cluster.wait_healthy(url, timeout=60)
    yield url, replicas
    router.terminate()
    router.wait()


def counters(replica):
    return replica.backend.worker.engine.counters


def turn(client, history, session=None, n=4):
    import uuid

    headers = {"X-Request-Id": uuid.uuid4().hex}
    if session is not None:
        headers["X-Session-Id"] = session
    r = client.chat.completions.create(
        model="tiny", messages=history, max_tokens=n, temperature=0, extra_headers=headers
    )
    history.append({"role": "assistant", "content": r.choices[0].message.content})
    return r


def test_sessions_stick_sessionless_spread_and_a_drain_moves_them(fleet):
    url, (a, b) = fleet
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    # the router hashes a session id onto a ring of the replicas' addresses (random ports): on an
    # even ring all of 6 sessions land on one replica once in 32 runs (seen in CI), of 12 once in
    # 2048; a replica holds all 12 (`tiny_replicas`: 16 slots), however unevenly they land
    chats = {f"s{i}": [{"role": "user", "content": f"Session {i}: my week."}] for i in range(12)}
    for name, h in chats.items():
        turn(client, h, name)
    for name, h in chats.items():
        h.append({"role": "user", "content": "Go on."})
        r = turn(client, h, name)
        assert r.usage.model_extra["reused_tokens"] >= 10, name  # where its KV is
    where = {n: [r for r in (a, b) if n in r.backend.sessions.export()["http_sessions"]]
             for n in chats}  # fmt: skip
    assert all(len(v) == 1 for v in where.values()), where  # each session on one replica
    assert {id(v[0]) for v in where.values()} == {id(a), id(b)}  # both serve sessions

    before = [counters(r)["prefilled"] for r in (a, b)]
    prompts = [[{"role": "user", "content": f"Sessionless question {i}, in detail."}]
               for i in range(16)]  # fmt: skip
    with cf.ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda h: turn(client, h, None, 24), prompts))
    grew = [counters(r)["prefilled"] - x for r, x in zip((a, b), before, strict=True)]
    assert all(g > 0 for g in grew), grew  # spread over both

    moved = cluster.drain(url, a.url, b.url)
    on_a = [n for n, v in where.items() if v[0] is a]
    assert moved == {"saved": len(on_a), "moved": len(on_a)}, moved
    direct = openai.OpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0)
    for name in on_a:
        h = [*chats[name], {"role": "user", "content": "And then?"}]
        reused = counters(b)["reused"]
        r = turn(client, [*h], name)
        had = turn(direct, [*h], name)  # the drained replica, asked directly: had it served on
        # its KV came along: B reuses what A would have (up to where a re-sent reply's text
        # encodes to other tokens than those sampled), at least its first whole page, which B
        # never computed (each session's first page differs from B's own sessions')
        used = r.usage.model_extra["reused_tokens"]
        assert used == had.usage.model_extra["reused_tokens"] >= 16, name
        assert counters(b)["reused"] - reused == used
