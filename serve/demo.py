"""The main job `make run` runs: tiny default checkpoints, load, prefill, greedy decode, timings.

    python -m serve.demo [--root .checkpoints] [--prompt-len 48] [--new 8]

The paged KV cache does not exist yet, so each decode step re-runs the full-sequence forward
over a fixed, padded length (one compilation; causal attention makes the padding after the last
real token irrelevant to its logits).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import leyline_jax as ll
from checkpoints.tiny import ensure_default_checkpoints


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def greedy(model: ll.MLAModel, prompt: list[int], new: int) -> tuple[list[int], dict[str, float]]:
    """Greedy-decode `new` tokens after `prompt`. Returns the tokens and timings (seconds)."""
    n = len(prompt)
    padded = np.zeros(_bucket(n + new), np.int32)
    padded[:n] = prompt
    t0 = time.perf_counter()
    logits = np.asarray(model(padded))  # compile + prefill
    first = time.perf_counter() - t0
    out, steps = [], []
    for i in range(new):
        tok = int(logits[n + i - 1].argmax())
        out.append(tok)
        padded[n + i] = tok
        if i + 1 < new:
            t0 = time.perf_counter()
            logits = np.asarray(model(padded))
            steps.append(time.perf_counter() - t0)
    timings = {"first_call_s": first, "step_median_s": statistics.median(steps) if steps else 0.0}
    return out, timings


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Leyline-JAX demo on the embedded tiny checkpoints")
    ap.add_argument("--root", default=".checkpoints", help="where the tiny checkpoints live")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new", type=int, default=8, help="tokens to generate")
    args = ap.parse_args(argv)

    paths = ensure_default_checkpoints(args.root)
    for family, path in paths.items():
        t0 = time.perf_counter()
        model = ll.load_model(path)
        load_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, model.config.vocab_size, args.prompt_len).tolist()
        tokens, t = greedy(model, prompt, args.new)
        print(
            f"{family:14s} load {load_s * 1e3:7.1f} ms | compile+prefill {args.prompt_len} "
            f"tokens {t['first_call_s'] * 1e3:7.1f} ms | decode step (full recompute, median) "
            f"{t['step_median_s'] * 1e3:6.2f} ms | greedy tokens {tokens}"
        )


if __name__ == "__main__":
    main()
