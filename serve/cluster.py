"""Replicas behind an existing router: vLLM's router (`vllm-router`, installed from its package)
with its `consistent_hash` policy: a request is routed by its `X-Session-Id` header on a hash
ring, so every turn of a session lands on the replica that holds its KV. A request without one
is keyed by its `X-Request-Id` (what most gateways add): sessionless traffic is spread over the
replicas; a request with neither key goes to one fixed replica (the router's empty key). The
`sticky_least_loaded` policy also sticks sessions, but sends sessionless requests to the
replica with the fewest sessions (measured: all to one of two); SGLang's router was not taken.

    python -m serve.cluster [--replicas 2] [--port 8000] [--root .cluster] [-- SERVER ARGS]
        N `python -m serve.http` replicas on the ports from --port + 2, each with its own
        --snapshot-dir under --root, and the router on --port (its metrics on --port + 1).
        SIGTERM or SIGINT (Ctrl-C) stops them all: each gets SIGTERM, STOP_TIMEOUT_S to exit
        (a replica saves its sessions), then SIGKILL. On Linux each also gets SIGTERM from the
        kernel when this process dies some other way (SIGKILL: PR_SET_PDEATHSIG).
    python -m serve.cluster drain --router URL --replica URL --to URL [--admin-key KEY]
        the replica out of the router (no new turn goes there), its sessions saved
        (`POST /v1/snapshot`) and taken by --to (`POST /v1/sessions/import`): they continue
        there with their KV. With two replicas every moved session's next turn reaches --to;
        with more, the ring sends each moved session to its next replica, which re-prefills
        it if that is not --to (correct, slower: docs/deployment.md).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

POLICY = "consistent_hash"  # vllm-router 0.1.17
# a replica told to stop finishes its requests (up to 10 s: serve.http) and saves its sessions
STOP_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def router_command(
    port: int, workers: list[str], host: str = "127.0.0.1", metrics_port: int | None = None
) -> list[str]:
    """The router's command line; its Prometheus exporter on `metrics_port` (default: the
    port after `port`)."""
    exe = Path(sys.executable).parent / "vllm-router"  # this environment's, else PATH's
    exe = str(exe) if exe.exists() else (shutil.which("vllm-router") or "vllm-router")
    metrics = str(port + 1 if metrics_port is None else metrics_port)
    # a turn is not idempotent: no retries (by default a 5xx is sent again, 5 times), and no
    # circuit breaker (by default it moves a failing replica's sessions elsewhere for a while)
    return [exe, "--host", host, "--port", str(port), "--policy", POLICY,
            "--disable-retries", "--disable-circuit-breaker",
            "--prometheus-host", host, "--prometheus-port", metrics,
            "--worker-urls", *workers]  # fmt: skip


def _post(url: str, body: dict | None = None, key: str | None = None) -> dict:
    req = urllib.request.Request(url, json.dumps(body or {}).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=600) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except ValueError:
        return {"text": raw.decode(errors="replace")}


def wait_healthy(url: str, timeout: float = 600.0, proc: subprocess.Popen | None = None) -> None:
    """Returns once `url`'s /health answers 200; raises if it has not within `timeout` seconds
    or if `proc` (the server, where given) has exited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}'s server exited ({proc.returncode}) before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not healthy within {timeout:.0f} s")


def drain(router: str, replica: str, to: str, admin_key: str | None = None) -> dict:
    """Move `replica`'s sessions to `to` behind `router` (see the module docstring)."""
    quoted = urllib.parse.quote(replica, safe="")
    _post(f"{router}/remove_worker?url={quoted}")
    snap = _post(replica + "/v1/snapshot", key=admin_key)
    taken = _post(to + "/v1/sessions/import", {"snapshot_dir": str(Path(snap["path"]).parent)},
                  key=admin_key)  # fmt: skip
    return {"saved": snap["sessions"], "moved": taken["sessions"]}


def _die_with_parent(parent: int, prctl) -> None:
    """In a child between fork and exec: the kernel sends it SIGTERM when `parent` dies; if
    `parent` died already (before this ran), the child exits at once."""
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def start(cmd: list[str]) -> subprocess.Popen:
    """`cmd` as a child of this process that gets SIGTERM when this process dies (on Linux)."""
    dies = None
    if sys.platform.startswith("linux"):
        dies = functools.partial(_die_with_parent, os.getpid(), ctypes.CDLL(None).prctl)
    return subprocess.Popen(cmd, preexec_fn=dies)


def stop(procs: list[subprocess.Popen], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to each of `procs`, `timeout` seconds for all of them to exit, then SIGKILL to
    those left; returns once every one has exited."""
    for p in procs:
        p.terminate()  # nothing if it has exited
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["drain"]:
        ap = argparse.ArgumentParser(prog="python -m serve.cluster drain")
        for name in ("--router", "--replica", "--to"):
            ap.add_argument(name, required=True)
        ap.add_argument("--admin-key")
        a = ap.parse_args(argv[1:])
        print(json.dumps(drain(a.router, a.replica, a.to, a.admin_key)))
        return
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="python -m serve.cluster")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--root", default=".cluster")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    urls = [f"http://127.0.0.1:{a.port + 2 + i}" for i in range(a.replicas)]  # +1: metrics
    procs: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as SIGINT: KeyboardInterrupt
    try:
        for i in range(len(urls)):
            cmd = [sys.executable, "-m", "serve.http", "--port", str(a.port + 2 + i),
                   "--snapshot-dir", str(Path(a.root) / f"replica{i}"), *rest]  # fmt: skip
            procs.append(start(cmd))
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc=proc)
        procs.append(start(router_command(a.port, urls)))
        print(f"router http://127.0.0.1:{a.port} over {' '.join(urls)}", flush=True)
        procs[-1].wait()
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal does not cut this short
            signal.signal(sig, signal.SIG_IGN)
        stop(procs)


if __name__ == "__main__":
    main()
