"""The benchmarks' one harness: timing, the machine's floors measured in the same run, and
markdown tables.

Timing: `times` samples the wall seconds of a callable whose result is blocked on
(`jax.block_until_ready`: dispatch is asynchronous), after `warmup` calls (compiles excluded);
`median_time` is their median, `interleaved` the medians of several callables run in turns (a
shared machine's changing load falls on all of them alike), `timed` the seconds of one call
(`clocked`: and its result). `decode_step_times`: an engine's steps while its turns decode.

Floors: the rates a benchmark holds its work to, measured in its own run, each a median of 5
samples: `copy_bandwidth` (an fp32 `x + 1` pass in place on a donated buffer and, with
`fresh`, into a new one; read + write counted), `read_bandwidth` (a reduction),
`memcpy_bandwidth` (numpy's copy between two host buffers) and `matmul_rate` (an n x n x n
matmul of random values). `beside`: a row's rates against its floor and Hugging Face's.

`table`: the lines of one markdown table, `section` one under its caption; `save_json`: a
result file; `percentile`. `parser`: a benchmark's command line (`--out`, `--repeats`,
`--compile-cache`); `platform`: jax's version and backend. `BENCH_HF_CONFIG`: the CPU
benchmarks' model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.tiny import TINY_HF_CONFIGS

# DeepSeek-V2-Lite attention shapes with few layers, over the tiny deepseek_v2 config. Dense
# MLPs (intermediate 4096, both layers dense) and a 32k vocabulary keep CPU runs short; attention
# and the cache are what these benchmarks measure. YaRN as V2-Lite's (the tiny config's betas).
_TINY_V2 = TINY_HF_CONFIGS["deepseek_v2"]
_YARN = dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707)
BENCH_HF_CONFIG = (
    _TINY_V2
    | dict(vocab_size=32000, hidden_size=2048, intermediate_size=4096, initializer_range=0.02)
    | dict(num_hidden_layers=2, first_k_dense_replace=2)
    | dict(num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512)
    | dict(qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    | dict(max_position_embeddings=163840)  # = factor x original, as V2-Lite
    | dict(rope_scaling=_TINY_V2["rope_scaling"] | _YARN)
)


# ---- timing -------------------------------------------------------------------------------------
def times(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1, iters: int = 1) -> list:
    """Seconds per call of `fn()`, `repeats` samples after `warmup` calls. A sample issues
    `iters` calls back to back and blocks once at the end: dispatch is asynchronous, so the
    device stays busy and a sub-millisecond pass is not charged the host's launch latency."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            result = fn()
        jax.block_until_ready(result)
        out.append((time.perf_counter() - t0) / iters)
    return out


def median_time(
    fn: Callable[[], object], repeats: int = 5, warmup: int = 1, iters: int = 1
) -> float:
    """Median seconds per call of `fn()` (`times`)."""
    return statistics.median(times(fn, repeats=repeats, warmup=warmup, iters=iters))


def clocked(fn: Callable[[], object]) -> tuple:
    """(the result of one call of `fn()`, blocked on; the wall seconds it took)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of `fn()`, its result blocked on."""
    return clocked(fn)[1]


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each of `fns` (each called once first: compiled and warm), run in
    turns, one call of each per round, `repeats` rounds."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timed(fn))
    return {name: statistics.median(s) for name, s in samples.items()}


def decode_step_times(engine, prompts, sampling, steps: int) -> tuple[list[float], list]:
    """(the wall seconds of each of `steps` engine steps once every turn decodes, the turns):
    one session a prompt of `prompts`, each turn with `sampling` (a budget past 2 + `steps`);
    the turns are cancelled and their sessions closed afterwards."""
    sids = [engine.open_session() for _ in prompts]
    reqs = [engine.submit(s, p, sampling=sampling) for s, p in zip(sids, prompts, strict=True)]
    while any(len(r.output) < 2 for r in reqs):
        engine.step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        ts.append(time.perf_counter() - t)
    for r, s in zip(reqs, sids, strict=True):
        engine.cancel(r)
        engine.close_session(s)
    return ts, reqs


# ---- floors -------------------------------------------------------------------------------------
def _pass_rate(nbytes: int, iters: int, donate: bool) -> float:
    """Bytes/s (read + write) of `x + 1` over an fp32 buffer of `nbytes`: in place on a donated
    buffer (no fresh output pages faulted in inside the timed region), or into a new one."""
    n = nbytes // 4
    step = jax.jit(lambda a: a + 1.0, donate_argnums=0 if donate else ())
    box = {"x": jnp.zeros((n,), jnp.float32)}

    def run():
        out = step(box["x"])
        if donate:
            box["x"] = out
        return out

    return 2 * n * 4 / median_time(run, iters=iters)


def copy_bandwidth(nbytes: int = 256 << 20, *, iters: int = 1, fresh: bool = False) -> dict:
    """{"bytes": read + written per pass, "inplace_bytes_s", with `fresh` also "fresh_bytes_s",
    "bytes_s": the better rate: the reference a copy of KV is a fraction of}."""
    rates = {"inplace_bytes_s": _pass_rate(nbytes, iters, donate=True)}
    if fresh:
        rates["fresh_bytes_s"] = _pass_rate(nbytes, iters, donate=False)
    return {"bytes": 2 * (nbytes // 4) * 4, **rates, "bytes_s": max(rates.values())}


def read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of a reduction over an fp32 buffer (read only)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return nbytes / median_time(lambda: total(x))


def memcpy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s (read + write) of one memcpy between two large, already touched host buffers
    (numpy's copy: libc memcpy): the floor a copy of scattered rows is held to."""
    a, b = np.ones(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
    return 2 * nbytes / median_time(lambda: np.copyto(b, a))


def matmul_rate(n: int = 2048, dtype=jnp.float32, *, iters: int = 1) -> float:
    """flop/s of an n x n x n matmul in `dtype` of random values (a GPU multiplies zeros
    faster), drawn on the device by XLA's own generator ("rbg")."""
    a = jax.random.uniform(jax.random.key(0, impl="rbg"), (n, n), dtype, -1.0, 1.0)
    mm = jax.jit(lambda x: x @ x)
    return 2 * n**3 / median_time(lambda: mm(a), iters=iters)


def beside(size: int, ours: float, floor: float, theirs: float | None) -> dict:
    """Tokens/s of `size` tokens done in `ours` seconds, beside the floor's and Hugging Face's
    (`theirs` seconds; None where it did not run), and the ratios."""
    return dict(
        ours_tok_s=size / ours,
        hf_tok_s=size / theirs if theirs else None,
        floor_tok_s=size / floor,
        speedup_vs_hf=theirs / ours if theirs else None,
        ours_over_floor=ours / floor,
    )


# ---- command lines and files --------------------------------------------------------------------
def parser(doc: str, *, out=None, repeats: int | None = None, cache: bool = False, what=None):
    """A benchmark's command line: `doc`'s first paragraph as its description, `--out` (default
    `out`; `what` says what it names), `--repeats` when given a default, `--compile-cache`
    with `cache`."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=out, help=what or "write the results as JSON here")
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats)
    if cache:
        add_compile_cache(ap)
    return ap


def add_compile_cache(ap: argparse.ArgumentParser) -> None:
    text = "keep compiled programs in DIR (default: serve.compile_cache's; off: none)"
    ap.add_argument("--compile-cache", default=None, help=text)


def platform() -> str:
    return f"jax {jax.__version__} on {jax.devices()[0].platform}"


def percentile(xs, q: float, empty: float = float("nan")) -> float:
    """The q-th percentile of `xs` (`empty` when there are none)."""
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else empty


def save_json(path: str | None, data, indent: int = 2) -> None:
    """`data` as JSON in `path` (nothing when `path` is empty: no `--out`)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent)


# ---- markdown -----------------------------------------------------------------------------------
def table(header: list[str], rows, align: str | None = None) -> list[str]:
    """The lines of a markdown table: `header`, then a line per row (cells already formatted as
    strings). `align`: a letter per column, "l" or "r" (default: the first left, the rest
    right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in rows)]


def section(caption: str, header: list[str], rows, align: str | None = None) -> list[str]:
    """One part of a markdown report: a blank line, `caption`, a blank line, the table."""
    return ["", caption, "", *table(header, rows, align)]
