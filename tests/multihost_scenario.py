"""One process of `tests/test_multihost.py`: the tiny DeepSeek-V3 model served over a 2x4 mesh
of 8 CPU devices, in one process (`--processes 1`) or as this process's part of a group
(`--processes 2 --process-id K --coordinator HOST:PORT`, 4 devices each, `serve.multihost`).
The leader (or the lone process) runs a fixed scenario through the engine: greedy and sampled
turns of two sessions, an AMORTIZE and a FORGET edit, a cancelled turn; a follower mirrors it.
A session kept to the end is snapshotted into `--snapshots` (its pages gathered from every
process), restored by every process into a fresh engine and continued. Process 0 writes the
turns' tokens, the engine's counters, the sessions' tokens, the restored session's next turn
and the KV pools and a full forward's logits (gathered from every process) to `--out` (.npz)."""

from __future__ import annotations

import argparse
import json
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--processes", type=int, default=1)
ap.add_argument("--process-id", type=int, default=0)
ap.add_argument("--coordinator", default="")
ap.add_argument("--ckpt", required=True)
ap.add_argument("--out", default="")
ap.add_argument("--snapshots", required=True, help="a directory every process reads")
args = ap.parse_args()
devices = f"--xla_force_host_platform_device_count={8 // args.processes}"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {devices}".strip()  # the suite's

import jax  # noqa: E402

from serve import multihost  # noqa: E402

if args.processes > 1:
    multihost.initialize(args.coordinator, args.processes, args.process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import leyline_jax as ll  # noqa: E402
from leyline_jax.directives import Mode  # noqa: E402
from serve import snapshot  # noqa: E402
from serve.engine import Engine, SamplingParams  # noqa: E402

grid = ll.MeshConfig.create(data=2, model=4)
model = ll.load_model(args.ckpt, mesh=grid)


def new_engine() -> Engine:  # on the suite's ladder (tests/conftest.py)
    return Engine(model, num_pages=64, page_size=8, max_seqs=4, max_seq_len=256,
                  kv_dtype=jnp.float32, mesh=grid, bucket_growth=4)  # fmt: skip


engine = new_engine()


def pools() -> dict:
    """The KV pools and the full forward's logits of a fixed prompt, gathered from every
    process (each takes part: collectives)."""
    leaves = jax.tree_util.tree_leaves(engine.state.pools)
    leaves.append(engine.model(np.arange(1, 41) * 7 % 250))  # eager: each op on every process
    if args.processes > 1:
        leaves = [multihost_utils.process_allgather(x, tiled=True) for x in leaves]
    out = {f"pool{i}": np.asarray(x) for i, x in enumerate(leaves[:-1])}
    return out | {"logits": np.asarray(leaves[-1])}


def restored() -> dict:
    """Every process: a fresh engine restores the leader's snapshot (once it is written) and
    runs the next turn of its session, the same calls on each (no leader needed)."""
    if args.processes > 1:
        multihost_utils.sync_global_devices("snapshot written")
    fresh = new_engine()
    snapshot.restore(fresh, args.snapshots)
    (sid,) = fresh.sessions
    turn = fresh.submit(sid, [11, 12, 13], sampling=SamplingParams(5))
    while not fresh.idle():
        fresh.step()
    reused = fresh.counters["reused"]
    return {"restored_turn": np.array(turn.output, np.int64), "restored_reused": np.array(reused)}


if args.processes > 1 and args.process_id != 0:
    steps = multihost.follow(engine)
    restored()
    pools()  # the leader gathers the pools: every process takes part
    print(json.dumps({"follower_steps": steps}))
    sys.exit(0)

eng = multihost.Lockstep(engine) if args.processes > 1 else engine
compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _s, **_: compiles.__setitem__(0, compiles[0] + ("backend_compile" in event))
)


def turns(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    a, b = eng.open_session(), eng.open_session()
    p1 = rng.integers(1, 250, 40).tolist()
    p2 = rng.integers(1, 250, 33).tolist()
    t1 = eng.submit_prompt(a, p1, sampling=SamplingParams(6))
    t2 = eng.submit_prompt(b, p2, sampling=SamplingParams(6, temperature=0.8, seed=7))
    while not eng.idle():
        eng.step()
    # AMORTIZE: a span of a's history replaced; FORGET: b's beginning dropped
    h1 = p1[:10] + [5, 6, 7] + p1[20:] + list(t1.output) + [9, 9]
    t3 = eng.submit_prompt(a, h1, sampling=SamplingParams(5), mode=Mode.AMORTIZE)
    h2 = p2[8:] + list(t2.output) + [4]
    t4 = eng.submit_prompt(b, h2, sampling=SamplingParams(5), mode=Mode.FORGET)
    c = eng.open_session()
    t5 = eng.submit_prompt(c, p1[:30], sampling=SamplingParams(50))  # cancelled mid-way
    for _ in range(3):
        eng.step()
    eng.cancel(t5)
    while not eng.idle():
        eng.step()
    out = {f"turn{seed}_{i}": np.array(t.output, np.int64) for i, t in enumerate((t1, t2, t3, t4))}
    out |= {f"session{seed}_{s}": np.array(engine.sessions[s].tokens, np.int64) for s in (a, b)}
    for s in (a, b, c):
        eng.close_session(s)
    return out


out = turns(0)
before = compiles[0]
out |= turns(1)  # the same shapes again: nothing compiles
out["compiled_again"] = np.array(compiles[0] - before)
d = eng.open_session()  # a session kept: snapshotted (pages gathered from every process)
eng.submit_prompt(d, list(range(3, 40)), sampling=SamplingParams(4))
while not eng.idle():
    eng.step()
snapshot.save(eng, args.snapshots)
if args.processes > 1:
    eng.stop()
out |= restored()
counters = json.dumps(dict(engine.counters), sort_keys=True)
out["counters"] = np.frombuffer(counters.encode(), np.uint8)
out |= pools()
if args.out:
    np.savez(args.out, **out)
print(json.dumps({k: v.tolist() for k, v in out.items() if k.startswith("turn")}))
