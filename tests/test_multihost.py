"""Multi-controller serving (`serve.multihost`) on this machine: two processes of 4 simulated
CPU devices each (JAX's distributed runtime, gloo collectives) run `tests/multihost_scenario.py`
over one 2x4 mesh, and equal one process of 8 devices: every turn's tokens (greedy, sampled,
after an AMORTIZE and a FORGET edit), the sessions' tokens, the engine's counters, the KV pools
and a full forward's logits to 1e-5 of their scale (the collectives sum in another order); a
session snapshotted by the group (its pages gathered from both) and restored by both continues
as one process's does. The
server as a group: it answers over HTTP, restarts with its sessions (their KV reused), and a
follower that dies ends it with an error, within seconds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from checkpoints.sessions import read_snapshot

HERE = Path(__file__).parent
SCENARIO = str(HERE / "multihost_scenario.py")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from checkpoints.tiny import ensure_default_checkpoints

    return ensure_default_checkpoints(tmp_path_factory.mktemp("ckpt"))["deepseek_v3"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    """This process's environment: the suite's compile settings (tests/conftest.py) included;
    each process adds its device count to XLA_FLAGS."""
    return os.environ | {"PYTHONPATH": str(HERE.parent), "JAX_PLATFORMS": "cpu"}


def _group(ckpt, out, snapshots, timeout=300):
    coord = f"127.0.0.1:{_port()}"
    procs = []
    for pid in (0, 1):
        cmd = [sys.executable, SCENARIO, "--processes", "2", "--process-id", str(pid),
               "--coordinator", coord, "--ckpt", ckpt, "--out", out,
               "--snapshots", snapshots]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [p.returncode for p in procs], outs


def test_two_processes_equal_one(ckpt, tmp_path):
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    run = subprocess.run(
        [sys.executable, SCENARIO, "--ckpt", ckpt, "--out", str(one),
         "--snapshots", str(tmp_path / "snap1")],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    codes, outs = _group(ckpt, str(two), str(tmp_path / "snap2"))
    assert codes == [0, 0], [e[-3000:] for _, e in outs]
    assert json.loads(outs[1][0].strip().splitlines()[-1])["follower_steps"] > 10
    a, b = np.load(one), np.load(two)
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        if k.startswith("pool") or k == "logits":  # collectives sum in another order
            assert close(b[k], a[k]), k  # 1e-5 of the array's scale
        else:
            assert np.array_equal(a[k], b[k]), k
    # the snapshot's pages were gathered from both processes and restored into both: the
    # restored session's next turn reused its KV (the whole 41-token history) and equals one's
    assert int(b["restored_reused"]) >= 40 and len(b["restored_turn"]) == 5
    (p1, m1), (p2, m2) = (read_snapshot(tmp_path / d) for d in ("snap1", "snap2"))
    assert m1["sessions"] == m2["sessions"] and len(m2["sessions"]) == 1
    assert all(close(p2[k], p1[k]) for k in ("moved", "rotated"))
    counters = json.loads(a["counters"].tobytes())
    assert counters["spliced"] > 0 and counters["cancelled_turns"] == 2
    assert int(b["compiled_again"]) == 0  # the second round: no program compiled
    assert not close(np.roll(b["pool0"], 1, axis=0), a["pool0"])  # a page out of place: seen


def close(x, y) -> bool:
    return float(np.max(np.abs(x - y))) <= 1e-5 * float(np.max(np.abs(y)))


def test_a_group_serves_http_restarts_and_ends_when_a_follower_dies(ckpt, tmp_path):
    """`python -m serve.http --num-processes 2 --snapshot-dir`: the leader answers a session's
    turns through the official client (the second reusing the first's KV); stopped (SIGTERM),
    the group saves its sessions and both processes exit; started again, the session's next
    turn reuses its KV; the follower killed, the leader ends within seconds, naming it."""
    openai = pytest.importorskip("openai")
    import signal
    import urllib.request

    port = _port()
    devices = "--xla_force_host_platform_device_count=4"
    env = _env() | {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {devices}"}
    logs = [open(tmp_path / f"p{i}.log", "w+") for i in (0, 1)]

    def group():  # on the suite's ladder (tests/conftest.py)
        cmd = [sys.executable, "-m", "serve.http", "--model", str(Path(ckpt)), "--mesh", "2x4",
               "--num-processes", "2", "--coordinator", f"127.0.0.1:{_port()}",
               "--port", str(port), "--snapshot-dir", str(tmp_path / "snap"),
               "--bucket-growth", "4"]  # fmt: skip
        procs = [subprocess.Popen([*cmd, "--process-id", str(i)], env=env, stdout=logs[i],
                                  stderr=logs[i]) for i in (0, 1)]  # fmt: skip
        for _ in range(240):
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    return procs
            except OSError:
                time.sleep(0.5)
        return procs

    def log0() -> str:
        logs[0].seek(0)
        return logs[0].read()

    url = f"http://127.0.0.1:{port}"
    procs = group()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        kw = dict(model=model, max_tokens=6, temperature=0, extra_headers={"X-Session-Id": "g"})
        history = [{"role": "user", "content": "Hello there, group."}]

        def turn(text: str):
            r = client.chat.completions.create(messages=history, **kw)
            history.extend([{"role": "assistant", "content": r.choices[0].message.content},
                            {"role": "user", "content": text}])  # fmt: skip
            return r

        r1 = turn("And again.")
        r2 = turn("Once more.")
        assert r2.usage.model_extra["reused_tokens"] >= r1.usage.prompt_tokens
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(timeout=60) for p in procs] == [0, 0], log0()[-2000:]
        procs = group()  # restored from the snapshot the group saved as it stopped
        r3 = turn("And the last.")
        assert r3.usage.model_extra["reused_tokens"] >= r2.usage.prompt_tokens, log0()[-2000:]
        procs[1].kill()
        t0 = time.monotonic()
        code = procs[0].wait(timeout=60)
        took = time.monotonic() - t0
        text = log0()
        assert code != 0 and "stopped sending heartbeats" in text, text[-2000:]
        assert took < 30, took  # the 10 s heartbeat, then the abort
    finally:
        for p in procs:
            p.kill()
