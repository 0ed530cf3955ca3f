"""What multi-controller serving adds to a step (`serve.multihost`): the leader's record
broadcast, timed in a group of 2 processes x 4 CPU devices (JAX's distributed runtime, gloo)
on this machine, beside the step it precedes.

- The broadcast alone (`multihost._broadcast`: the length, then the bytes padded to a power of
  two, each `broadcast_one_to_all`) for payloads of 200 B (a decode step's record: no calls),
  4 KiB (a turn's submission of ~500 token ids) and 64 KiB (a 16k-token prompt), medians of
  `--repeats`.
- A decode step of the tiny DeepSeek-V3 model, 4 sessions over the 2x4 mesh, through
  `Lockstep.step` (broadcast, then the step on every process), median of `--repeats`; beside
  it the same step in one process over the same mesh of 8 devices (no broadcast).

Both processes are this script (`--process-id` given: one of the group; none: it starts the
group and prints process 0's results).

    python -m benchmarks.broadcast [--repeats 100] [--out FILE.json]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = (200, 4096, 65536)


def _group(repeats: int, processes: int) -> dict:
    """Start the processes; process 0's results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parent.parent))  # fmt: skip
    ckpt = tempfile.mkdtemp(prefix="leyline-broadcast-")
    member = [sys.executable, "-m", "benchmarks.broadcast", "--coordinator", f"127.0.0.1:{port}",
              "--repeats", str(repeats), "--ckpt", ckpt, "--processes", str(processes)]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*member, "--process-id", str(i)], env=env, stdout=subprocess.PIPE, text=True
        )  # fmt: skip
        for i in range(processes)
    ]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"the group failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def _member(pid: int, coordinator: str, repeats: int, ckpt: str, processes: int) -> None:
    from benchmarks import harness
    from serve import multihost

    if processes > 1:
        multihost.initialize(coordinator, processes, pid)
    import jax.numpy as jnp

    import leyline_jax as ll
    from checkpoints.tiny import ensure_default_checkpoints
    from serve.engine import Engine
    from serve.sampling import SamplingParams

    leader = pid == 0
    out: dict = {"broadcast_s": {}}
    for size in SIZES if processes > 1 else ():
        payload = os.urandom(size) if leader else None
        out["broadcast_s"][size] = harness.median_time(
            lambda p=payload: multihost._broadcast(p), repeats=repeats, warmup=5
        )
    if leader:
        ensure_default_checkpoints(ckpt)
    if processes > 1:
        multihost._broadcast(b"written" if leader else None)  # the checkpoint is on disk
    path = Path(ckpt) / "deepseek_v3"
    grid = ll.MeshConfig.create(data=2, model=4)
    engine = Engine(ll.load_model(str(path), mesh=grid), num_pages=64, page_size=8, max_seqs=4,
                    max_seq_len=256, kv_dtype=jnp.float32, mesh=grid)  # fmt: skip
    if not leader:
        multihost.follow(engine)
        return
    eng = multihost.Lockstep(engine) if processes > 1 else engine
    for i in range(4):
        eng.submit(eng.open_session(), [3 + i] * 20, sampling=SamplingParams(repeats + 40))
    step = harness.median_time(eng.step, repeats=repeats, warmup=10)  # warm: prefill, decode
    if processes > 1:
        eng.stop()
    out["decode_step_s"] = step
    print(json.dumps(out))


def main() -> None:
    from benchmarks import harness

    ap = harness.parser(__doc__, repeats=100)
    ap.add_argument("--process-id", type=int, default=None, help=argparse_hidden())
    ap.add_argument("--coordinator", default="", help=argparse_hidden())
    ap.add_argument("--ckpt", default="", help=argparse_hidden())
    ap.add_argument("--processes", type=int, default=2, help=argparse_hidden())
    args = ap.parse_args()
    if args.process_id is not None:
        _member(args.process_id, args.coordinator, args.repeats, args.ckpt, args.processes)
        return
    r = _group(args.repeats, 2)
    r["one_process_decode_step_s"] = _group(args.repeats, 1)["decode_step_s"]
    step, one = r["decode_step_s"], r["one_process_decode_step_s"]
    print(f"decode step (4 sessions, 2x4 mesh): {step * 1e3:.2f} ms in 2 processes (Lockstep), "
          f"{one * 1e3:.2f} ms in one")  # fmt: skip
    for size, s in r["broadcast_s"].items():
        print(f"broadcast of {int(size):>6} B: {s * 1e3:.3f} ms ({s / step:.1%} of the step)")
    harness.save_json(args.out, r)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
