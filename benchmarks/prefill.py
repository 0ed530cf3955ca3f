"""Cold prefill through the engine: the attention forms side by side, beside the matmul floor.

A new session of an engine without a prefix cache prefills a random prompt of 4096 and of 8192
tokens and samples one token; timed from submission to the token, the median of `--repeats`
rounds (the two lengths interleaved) after a warm-up call (compiles excluded). The forms are
chosen when a step is traced, so each form runs apart, after the compiled programs are dropped.
Arms, for each chunk setting
(`prefill_chunk` = `max_num_batched_tokens` = 256, the engine's default chunk, and 1024):

- `absorbed`: every query in the absorbed form (the cost model switched off);
- `chosen`: the form per query tile from `leyline_jax.mla.expanded_tiles` (the default).

Beside each: the floor, the step's multiply-adds in the chosen form (`flops`, counted below from
the model's widths) at the square-matmul rate measured in the same run (`harness.matmul_rate`,
fp32), and the growth from 4k to 8k tokens. Model: `benchmarks.edited_turn`'s (2-layer
DeepSeek-V2 attention shapes, hidden 256, kv_lora_rank 512, 16 heads, fp32 params, bf16 c_kv).

    python -m benchmarks.prefill [--repeats 3] [--out FILE.json]
"""

from __future__ import annotations

import functools
import tempfile

import jax
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from benchmarks.edited_turn import CONFIG
from checkpoints.tiny import write_random_checkpoint
from leyline_jax import mla
from serve.engine import Engine
from serve.sampling import SamplingParams

LENGTHS = (4096, 8192)
CHUNKS = (256, 1024)


def flops(c, tokens: int, chunk: int, expanded: bool) -> float:
    """Floating-point operations (2 per multiply-add) of a cold prefill of `tokens` in chunks:
    the per-token projections and MLP of every layer, the last token's logits, and attention
    over the causal pairs in the form the cost model picks for the chunk (expanded: each chunk's
    context expanded to per-head K and V once per expanded tile)."""
    h, n, r, dr = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    dn, dv = c.qk_nope_head_dim, c.v_head_dim
    per_token = h * n * (dn + dr) + h * (r + dr) + n * dv * h + 3 * h * c.intermediate_size
    per_token += n * dn * r + n * r * dv  # queries into the latent space, outputs out of it
    total = 0.0
    for start in range(0, tokens, chunk):
        t = min(chunk, tokens - start)
        pairs = t * start + t * (t + 1) / 2
        tiles = mla.expanded_tiles(t, c) if expanded else ()
        if tiles:  # whole tiles of the largest size, as the chunk is cut
            count = t // tiles[0]
            total += count * (start + t) * n * r * (dn + dv) + pairs * n * (dn + dr + dv)
        else:
            total += pairs * n * (2 * r + dr)
    return 2 * (c.num_hidden_layers * (tokens * per_token + total) + h * c.vocab_size)


def main(argv=None) -> dict:
    ap = harness.parser(__doc__, repeats=3)
    args = ap.parse_args(argv)
    model = ll.load_model(write_random_checkpoint(tempfile.mkdtemp(), CONFIG, seed=0))
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, CONFIG["vocab_size"], n).tolist() for n in LENGTHS}
    rate = harness.matmul_rate()
    one = SamplingParams(max_new_tokens=1)
    chosen = mla.expanded_tiles

    def prefill(engine: Engine, prompt):
        s = engine.open_session()
        try:
            return engine.submit(s, prompt, sampling=one).result()
        finally:
            engine.close_session(s)

    def forms(engine: Engine) -> dict[str, float]:  # median seconds of each form and length
        med = {}
        for form in ("absorbed", "chosen"):
            mla.expanded_tiles = chosen if form == "chosen" else lambda *a, **k: ()
            jax.clear_caches()
            try:
                arms = {
                    f"{form} {n}": functools.partial(prefill, engine, p) for n, p in prompts.items()
                }
                med |= harness.interleaved(arms, args.repeats)
            finally:
                mla.expanded_tiles = chosen
        jax.clear_caches()
        return med

    rows, results = [], {"matmul_gflop_s": rate / 1e9, "platform": harness.platform()}
    for chunk in CHUNKS:
        engine = Engine(
            model,
            radix=False,
            num_pages=1200,
            page_size=16,
            max_seqs=4,
            max_seq_len=16384,
            prefill_chunk=chunk,
            max_num_batched_tokens=max(chunk, 512),
        )
        med = forms(engine)
        for n in LENGTHS:
            floor = flops(model.config, n, chunk, True) / rate
            a, b = med[f"absorbed {n}"], med[f"chosen {n}"]
            results[f"chunk {chunk} {n}"] = dict(absorbed_s=a, chosen_s=b, floor_s=floor)
            rows.append(
                [
                    str(chunk),
                    str(n),
                    f"{a * 1e3:.0f}",
                    f"{b * 1e3:.0f}",
                    f"{a / b:.2f}",
                    f"{floor * 1e3:.0f}",
                    f"{b / floor:.1f}",
                ]
            )
        growth = med[f"chosen {LENGTHS[1]}"] / med[f"chosen {LENGTHS[0]}"]
        results[f"chunk {chunk} growth"] = growth
        rows.append([str(chunk), "8k / 4k", "", f"{growth:.2f}x", "", "", ""])
    header = ["chunk", "tokens", "absorbed ms", "chosen ms", "speedup", "floor ms", "x floor"]
    print(f"square matmul (fp32, 2048): {rate / 1e9:.0f} GFLOP/s; {harness.platform()}")
    print("\n".join(harness.table(header, rows)))
    harness.save_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
