"""`python -m serve.cluster` ends with its replicas and its router: SIGTERM to it stops them all
(each saves and exits well before the cluster's kill deadline), and SIGKILL to it leaves none
running (the kernel's death signal, PR_SET_PDEATHSIG). Processes are read from /proc, so Linux
only; the helper that finds survivors is also run on a child that outlives its killed parent
(no death signal), which it must report."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("vllm_router")
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc and the death signal")

from checkpoints.tiny import ensure_default_checkpoints  # noqa: E402
from serve import cluster  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent's pid, start time in clock ticks) of process `pid`; None if none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after the name, which may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def children(pid: int) -> dict[int, int]:
    """The processes whose parent is `pid`: their pid -> start time (a pid can be reused, the
    pair names one process)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) and st[1] == pid:
            out[int(entry.name)] = st[2]
    return out


def survivors(procs: dict[int, int], wait: float = 0.0) -> list[int]:
    """Those of `procs` (pid -> start time) still running after up to `wait` seconds: not gone
    and not a zombie (dead, not yet reaped by its new parent)."""
    deadline = time.monotonic() + wait
    while True:
        left = [p for p, t in procs.items() if (st := _stat(p)) and st[2] == t and st[0] != "Z"]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def _ports(n: int) -> int:
    """The first of `n` consecutive free ports (the cluster's router, metrics, replicas)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    ensure_default_checkpoints(root)
    return root


@pytest.fixture
def serving(ckpt_dir, tmp_path):
    """A serving `python -m serve.cluster` of two tiny replicas (its output in cluster.log),
    and its three children (pid -> start time); whatever survives the test is killed."""
    port = _ports(4)
    server = ["--model", "tiny", "--root", str(ckpt_dir), "--kv-dtype", "fp32",
              "--num-pages", "64", "--max-seqs", "4", "--compile-cache", "off"]  # fmt: skip
    cmd = [sys.executable, "-m", "serve.cluster", "--replicas", "2", "--port", str(port),
           "--root", str(tmp_path / "cluster"), "--", *server]  # fmt: skip
    log = tmp_path / "cluster.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    kids: dict[int, int] = {}
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
        while not _serves(url + "/v1/models"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        kids = children(proc.pid)
        assert sorted(_kind(pid) for pid in kids) == ["replica", "replica", "router"]
        yield proc, kids, log
    finally:
        _kill([proc.pid, *survivors(kids)])
        proc.wait()


def _kind(pid: int) -> str:
    """What process `pid` is: "replica", "router" (it names itself vllm::router), or else its
    command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    if argv[1:3] == ["-m", "serve.http"]:
        return "replica"
    return "router" if argv[0].startswith("vllm") else " ".join(argv)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _serves(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_sigterm_stops_the_replicas_and_the_router(serving):
    proc, kids, log = serving
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=cluster.STOP_TIMEOUT_S + 30)
    took = time.monotonic() - t0
    assert survivors(kids) == [], log.read_text()  # the cluster waited for every one
    assert proc.returncode == 0
    # the replicas exited on their SIGTERM (each saved its sessions), not at the kill deadline
    assert took < cluster.STOP_TIMEOUT_S, log.read_text()
    assert log.read_text().count("saved 0 sessions") == 2, log.read_text()


def test_sigkill_leaves_no_child_running(serving):
    proc, kids, log = serving
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    # the death signal is SIGTERM: a replica stops as it does on one from the cluster
    assert survivors(kids, wait=cluster.STOP_TIMEOUT_S) == [], log.read_text()


def test_survivors_reports_a_child_left_running():
    """Without a death signal a child outlives its killed parent: `survivors` reports it, and
    once it is killed (a zombie until its new parent reaps it), no longer."""
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    deadline = time.monotonic() + 10
    while not (kids := children(parent.pid)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    try:
        assert survivors(kids, wait=1.0) == list(kids)
    finally:
        _kill(list(kids))
    assert survivors(kids, wait=5.0) == []
