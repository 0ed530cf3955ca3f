"""Paged prefill and decode throughput: ours (JAX, CPU) beside Hugging Face PyTorch in one run.

    python -m benchmarks.paged_bench [--configs tiny,bench] [--kinds prefill,decode,mixed]
                                     [--no-hf] [--out results.json]

For each config: prefill tokens/s at 512 and 2048 prompt tokens, decode tokens/s at batch 1, 8
and 32 (context 256 per sequence), and one mixed step (`mixed`: a 256-token prefill chunk of a
sequence holding 2048 tokens riding with 31 decode rows at context 256, one ragged step; HF
has no such step, so its column is empty), medians of repeated runs after a warm-up (so compile
time is excluded). Beside each: the same work in transformers (fp32, eager attention, its own
cache) and the machine floor measured in the same run: flops over the measured fp32 matmul
rate, or bytes over the measured copy bandwidth (in place, read + write), whichever is larger.
For decode also the time of the step's weight matmuls alone (`gemms`): each weight of the model
times a [batch, in] activation, in its own jitted call, medians summed: what this backend's
matrix multiplies at that batch cost before anything else runs (the floor takes the square
n=2048 matmul rate; XLA:CPU reaches a fraction of it at 8 or 32 rows).
"""

from __future__ import annotations

import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import leyline_jax as ll
from benchmarks import harness
from checkpoints.tiny import TINY_HF_CONFIGS, write_random_checkpoint
from leyline_jax import paged
from leyline_jax.model import Split

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


def attention_flops(c: ll.MLAConfig, q: int, ctx: int) -> float:
    """Least attention flops for q new tokens of one sequence ending at `ctx` tokens (causal),
    in whichever form is cheaper for it: expanded (K/V per head from every slot's latent once,
    then per pair) or absorbed (per pair, against the latent)."""
    n, r = c.num_attention_heads, c.kv_lora_rank
    pairs = q * ctx - q * (q - 1) / 2
    expanded = ctx * 2 * r * n * (c.qk_nope_head_dim + c.v_head_dim) + pairs * 2 * n * (
        c.qk_head_dim + c.v_head_dim
    )
    absorbed = pairs * 2 * n * (2 * r + c.qk_rope_head_dim)
    return c.num_hidden_layers * min(expanded, absorbed)


def decode_bytes(c: ll.MLAConfig, b: int, ctx: int, active: int, dtype_bytes: int = 4) -> float:
    """Bytes one decode step must read: every touched weight once, plus each sequence's cache."""
    cache = b * ctx * c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * dtype_bytes
    return active * dtype_bytes + cache


def gemm_time(model, batch: int) -> float:
    """Sum of the median times of every weight matrix of `model` applied to a [batch, in]
    activation (a [batch, N, in] one for head-major [N, in, out] weights), each its own jit."""
    c = model.config
    total = 0.0
    rng = np.random.default_rng(2)
    for w in jax.tree.leaves(nnx.state(model, nnx.Param)):
        if w.ndim < 2:
            continue
        if w.shape == (c.vocab_size, c.hidden_size):  # the embedding: a row per token
            if not c.tie_word_embeddings:
                continue
            w = w.T  # tied: it is also the LM head
        lead = (batch,) + w.shape[:-2] + w.shape[-2:-1]
        x = jnp.asarray(rng.standard_normal(lead), w.dtype)
        mm = jax.jit(lambda x, w: jnp.einsum("b...i,...io->b...o", x, w))
        total += harness.median_time(lambda x=x, w=w, mm=mm: mm(x, w), repeats=7)
    return total


def bench_ours(model, t_prefill: int, batch: int):
    c = model.config
    pages = (batch * (CONTEXT + DECODE_STEPS + 4)) // 16 + batch + 8
    pages = max(pages, t_prefill // 16 + 2)
    rng = np.random.default_rng(0)

    size = dict(num_pages=pages, page_size=16, max_seqs=max(batch, 1), kv_dtype=jnp.float32)
    fresh = functools.partial(ll.init_state, c, **size)
    prompt = rng.integers(0, c.vocab_size, t_prefill)
    st = {"s": fresh()}

    def run_prefill():
        st["s"] = fresh()
        st["s"], logits = ll.prefill(model, st["s"], 0, prompt)
        return logits

    prefill_s = harness.median_time(run_prefill, repeats=3)

    st["s"] = fresh()
    for s in range(batch):
        st["s"], _ = ll.prefill(model, st["s"], s, rng.integers(0, c.vocab_size, CONTEXT))
    seqs = list(range(batch))
    toks = [1] * batch

    def run_decode():
        st["s"], logits = ll.decode(model, st["s"], seqs, toks)
        return logits

    decode_s = harness.median_time(run_decode, repeats=DECODE_STEPS, warmup=2)
    return prefill_s, decode_s


MIXED_CHUNK, MIXED_CTX, MIXED_DECODE = 256, 2048, 31


def bench_mixed(model, rate: float, bw: float, active: int):
    """Time one ragged step of a prefill chunk beside decode rows, several times (the chunk row
    grows by a chunk each time); returns (median time, median time / floor, tokens per step)."""
    c = model.config
    rng = np.random.default_rng(1)
    reps = 5
    need = (MIXED_CTX + MIXED_CHUNK * (reps + 2)) // 16 + MIXED_DECODE * ((CONTEXT + 16) // 16 + 1)
    size = dict(num_pages=need + 8, page_size=16, max_seqs=MIXED_DECODE + 1, kv_dtype=jnp.float32)
    st = ll.init_state(c, **size)
    st, _ = ll.prefill(model, st, 0, rng.integers(0, c.vocab_size, MIXED_CTX))
    for s in range(1, MIXED_DECODE + 1):
        st, _ = ll.prefill(model, st, s, rng.integers(0, c.vocab_size, CONTEXT))
    graph = Split.of(model)
    seqs = list(range(MIXED_DECODE + 1))
    times, ratios = [], []
    for i in range(reps + 1):  # the first compiles
        blocks = [rng.integers(0, c.vocab_size, MIXED_CHUNK).tolist()] + [[1]] * MIXED_DECODE
        lens = [int(st.lengths[s]) for s in seqs]
        step = functools.partial(paged.extend, model, st, seqs, blocks, graph=graph)
        (st, _), dt = harness.clocked(step)
        tokens = MIXED_CHUNK + MIXED_DECODE
        flops = 2 * active * tokens + attention_flops(c, MIXED_CHUNK, lens[0] + MIXED_CHUNK)
        flops += sum(attention_flops(c, 1, n + 1) for n in lens[1:])
        cache = sum(lens) + tokens
        bytes_ = (active + cache * c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim)) * 4
        floor = max(flops / rate, bytes_ / bw)
        if i:
            times.append(dt)
            ratios.append(dt / floor)
    return float(np.median(times)), float(np.median(ratios)), MIXED_CHUNK + MIXED_DECODE


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

    prefill_s = harness.median_time(run_prefill, repeats=3)
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

    decode_s = harness.median_time(run_decode, repeats=DECODE_STEPS, warmup=2)
    return prefill_s, decode_s


def _row(config: str, kind: str, size: int, ours, theirs, floor, gemms=float("nan")) -> dict:
    """One result row; times are seconds for `size` tokens (`theirs`: nan where HF did not run)."""
    row = dict(gemm_tok_s=size / gemms, ours_over_gemms=ours / gemms, config=config, kind=kind)
    return row | dict(size=size) | harness.beside(size, ours, floor, theirs)


def main(argv=None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--configs", default="tiny,bench")
    ap.add_argument("--kinds", default="prefill,decode,mixed")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (its columns: nan)")
    args = ap.parse_args(argv)
    bw, rate = harness.copy_bandwidth()["inplace_bytes_s"], harness.matmul_rate()
    rates = f"copy bandwidth {bw / 1e9:.1f} GB/s, fp32 matmul {rate / 1e9:.1f} GFLOP/s"
    print(f"machine: {rates}, {harness.platform()}")
    configs = {"tiny": TINY_HF_CONFIGS["glm4_moe_lite"], "bench": harness.BENCH_HF_CONFIG}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            path = write_random_checkpoint(os.path.join(tmp, name), configs[name])
            model = ll.load_model(path)
            c = model.config
            _, active = param_count(model)
            kinds = args.kinds.split(",")

            def hf(t, b, path=path, vocab=c.vocab_size):
                nan = (float("nan"), float("nan"))
                return nan if args.no_hf else bench_hf(path, t, b, vocab)

            for t in (512, 2048) if "prefill" in kinds else ():
                ours, _ = bench_ours(model, t, 1)
                theirs, _ = hf(t, 1)
                floor = prefill_flops(c, t, active) / rate
                rows.append(_row(name, "prefill", t, ours, theirs, floor))
            for b in (1, 8, 32) if "decode" in kinds else ():
                _, ours = bench_ours(model, 16, b)
                _, theirs = hf(16, b)
                floor = max(decode_bytes(c, b, CONTEXT, active) / bw, 2 * active * b / rate)
                rows.append(_row(name, "decode", b, ours, theirs, floor, gemm_time(model, b)))
            if "mixed" in kinds:
                ours, ratio, size = bench_mixed(model, rate, bw, active)
                rows.append(_row(name, "mixed", size, ours, float("nan"), ours / ratio))
    header = ["config", "kind", "size", "ours tok/s", "HF tok/s", "floor tok/s", "ours / HF"]
    header += ["time / floor", "time / gemms"]
    rates, ratios = ("ours_tok_s", "hf_tok_s", "floor_tok_s"), ("speedup_vs_hf", "ours_over_floor")
    cells = [
        [r["config"], r["kind"], str(r["size"]), *(f"{r[k]:.1f}" for k in rates)]
        + [f"{r[k]:.2f}" for k in (*ratios, "ours_over_gemms")]
        for r in rows
    ]
    print("\n".join(harness.table(header, cells, "ll" + "r" * 7)))
    harness.save_json(args.out, rows)


if __name__ == "__main__":
    main()
