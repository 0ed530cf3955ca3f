"""The main job `make run` runs: tiny default checkpoints, load, prefill, greedy decode, timings.

    python -m serve.demo [--root .checkpoints] [--prompt-len 48] [--new 8]

Prefill and decode go through the paged KV cache (`leyline_jax.prefill` / `decode`, fp32 storage
so the tokens equal a full-sequence greedy run exactly); the serving loop replaces this later.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from checkpoints.tiny import ensure_default_checkpoints


def greedy(model: ll.MLAModel, prompt: list[int], new: int) -> tuple[list[int], dict[str, float]]:
    """Greedy-decode `new` tokens after `prompt` through the paged cache. Returns the tokens and
    timings in seconds (the first prefill includes compilation)."""
    pages = (len(prompt) + new) // 16 + 2
    state = ll.init_state(
        model.config, num_pages=pages, page_size=16, max_seqs=1, kv_dtype=jnp.float32
    )
    t0 = time.perf_counter()
    state, logits = ll.prefill(model, state, 0, prompt)
    tok = int(np.asarray(logits).argmax())
    first = time.perf_counter() - t0
    out, steps = [tok], []
    for _ in range(new - 1):
        t0 = time.perf_counter()
        state, logits = ll.decode(model, state, [0], [tok])
        tok = int(np.asarray(logits)[0].argmax())
        steps.append(time.perf_counter() - t0)
        out.append(tok)
    # the first decode step compiles: report the median of the rest
    timings = {
        "first_call_s": first,
        "step_median_s": statistics.median(steps[1:] or steps or [0.0]),
    }
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
            f"tokens {t['first_call_s'] * 1e3:7.1f} ms | paged decode step (median) "
            f"{t['step_median_s'] * 1e3:6.2f} ms | greedy tokens {tokens}"
        )


if __name__ == "__main__":
    main()
