"""Paged prefill and decode throughput: ours (JAX, CPU) beside Hugging Face PyTorch in one run.

    python -m benchmarks.paged_bench [--configs tiny,bench] [--out results.json]

For each config: prefill tokens/s at 512 and 2048 prompt tokens, decode tokens/s at batch 1, 8
and 32 (context 256 per sequence), medians of repeated runs after a warm-up (so compile time is
excluded). Beside each: the same work in transformers (fp32, eager attention, its own cache) and
the machine floor measured in the same run: flops over the measured fp32 matmul rate, or bytes
over the measured copy bandwidth (in place, read + write), whichever is larger.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import leyline_jax as ll
from benchmarks.common import (
    BENCH_HF_CONFIG,
    measure_copy_bandwidth,
    measure_matmul_rate,
    median_time,
)
from checkpoints.tiny import TINY_HF_CONFIGS, write_random_checkpoint

CONTEXT = 256
DECODE_STEPS = 8


def param_count(model) -> tuple[int, int]:
    """(all params, params a token touches): the embedding table is read one row per token;
    all routed experts count (dense dispatch runs them all)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    total = sum(x.size for x in leaves)
    return total, total - model.embed[...].size + model.config.hidden_size


def prefill_flops(c: ll.MLAConfig, t: int, active: int) -> float:
    """Matmul flops of a prefill of t tokens from empty (causal pairs only; last-token logits)."""
    n = c.num_attention_heads
    per_layer_pairs = t * (t + 1) / 2 * 2 * n * (c.qk_head_dim + c.v_head_dim)
    expand = t * 2 * c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
    head = 2 * c.hidden_size * c.vocab_size
    dense = 2 * (active - c.hidden_size * c.vocab_size * (0 if c.tie_word_embeddings else 1))
    return t * dense + c.num_hidden_layers * (per_layer_pairs + expand) + head


def decode_bytes(c: ll.MLAConfig, b: int, ctx: int, active: int, dtype_bytes: int = 4) -> float:
    """Bytes one decode step must read: every touched weight once, plus each sequence's cache."""
    cache = b * ctx * c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * dtype_bytes
    return active * dtype_bytes + cache


def bench_ours(model, t_prefill: int, batch: int):
    c = model.config
    pages = (batch * (CONTEXT + DECODE_STEPS + 4)) // 16 + batch + 8
    pages = max(pages, t_prefill // 16 + 2)
    rng = np.random.default_rng(0)

    def fresh():
        return ll.init_state(
            c, num_pages=pages, page_size=16, max_seqs=max(batch, 1), kv_dtype=jnp.float32
        )

    prompt = rng.integers(0, c.vocab_size, t_prefill)
    st = {"s": fresh()}

    def run_prefill():
        st["s"] = fresh()
        st["s"], logits = ll.prefill(model, st["s"], 0, prompt)
        return logits

    prefill_s = median_time(run_prefill, repeats=3)

    st["s"] = fresh()
    for s in range(batch):
        st["s"], _ = ll.prefill(model, st["s"], s, rng.integers(0, c.vocab_size, CONTEXT))
    seqs = list(range(batch))
    toks = [1] * batch

    def run_decode():
        st["s"], logits = ll.decode(model, st["s"], seqs, toks)
        return logits

    decode_s = median_time(run_decode, repeats=DECODE_STEPS, warmup=2)
    return prefill_s, decode_s


def bench_hf(path, t_prefill: int, batch: int, vocab: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    hf = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rng = np.random.default_rng(0)
    prompt = torch.tensor(rng.integers(0, vocab, (1, t_prefill)))

    def run_prefill():
        with torch.no_grad():
            return hf(prompt, use_cache=True, logits_to_keep=1).logits

    prefill_s = median_time(run_prefill, repeats=3)
    ctx = torch.tensor(rng.integers(0, vocab, (batch, CONTEXT)))
    with torch.no_grad():
        cache = hf(ctx, use_cache=True, logits_to_keep=1).cache
    step = torch.ones((batch, 1), dtype=torch.long)
    holder = {"cache": cache}

    def run_decode():
        with torch.no_grad():
            out = hf(step, cache=holder["cache"], use_cache=True)
        holder["cache"] = out.cache
        return out.logits

    decode_s = median_time(run_decode, repeats=DECODE_STEPS, warmup=2)
    return prefill_s, decode_s


def _row(config: str, kind: str, size: int, ours: float, theirs: float, floor: float) -> dict:
    """One result row; times are seconds for `size` tokens."""
    return dict(
        config=config,
        kind=kind,
        size=size,
        ours_tok_s=size / ours,
        hf_tok_s=size / theirs,
        floor_tok_s=size / floor,
        speedup_vs_hf=theirs / ours,
        ours_over_floor=ours / floor,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,bench")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)

    bw, rate = measure_copy_bandwidth(), measure_matmul_rate()
    print(
        f"machine: copy bandwidth {bw / 1e9:.1f} GB/s, fp32 matmul {rate / 1e9:.1f} GFLOP/s, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    configs = {"tiny": TINY_HF_CONFIGS["glm4_moe_lite"], "bench": BENCH_HF_CONFIG}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            path = write_random_checkpoint(os.path.join(tmp, name), configs[name])
            model = ll.load_model(path)
            c = model.config
            _, active = param_count(model)
            for t in (512, 2048):
                ours, _ = bench_ours(model, t, 1)
                theirs, _ = bench_hf(path, t, 1, c.vocab_size)
                floor = prefill_flops(c, t, active) / rate
                rows.append(_row(name, "prefill", t, ours, theirs, floor))
            for b in (1, 8, 32):
                _, ours = bench_ours(model, 16, b)
                _, theirs = bench_hf(path, 16, b, c.vocab_size)
                floor = max(decode_bytes(c, b, CONTEXT, active) / bw, 2 * active * b / rate)
                rows.append(_row(name, "decode", b, ours, theirs, floor))
    print(
        f"{'config':6s} {'kind':7s} {'size':>5s} {'ours tok/s':>11s} {'HF tok/s':>10s} "
        f"{'floor tok/s':>12s} {'ours/HF':>8s} {'time/floor':>10s}"
    )
    for r in rows:
        print(
            f"{r['config']:6s} {r['kind']:7s} {r['size']:5d} {r['ours_tok_s']:11.1f} "
            f"{r['hf_tok_s']:10.1f} {r['floor_tok_s']:12.1f} {r['speedup_vs_hf']:8.2f} "
            f"{r['ours_over_floor']:10.1f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
