"""The edited-turn case: what one edited agent turn costs through the serving engine.

A session holds a 4096-token prompt and its one generated token; the harness then resends the
whole history with tokens 1000-1500 replaced by 20 new ones and asks for one token. Timed, each
the median of `--repeats` runs after a warm-up (compiles excluded):

- `amortize` / `forget`: the edited turn (`Engine.submit_prompt`, the edit detected and applied
  in that mode) from submission to its token;
- `cold`: the whole edited prompt prefilled in a new session of an engine without a prefix
  cache (what a stack that cannot edit its cache pays at best), and `cold_prefix`: its first
  1000 tokens alone (what FORGET keeps), so `cold - cold_prefix` is what a cold prefill spends
  on the tokens FORGET re-prefills, at the same positions;
- `splice`: `apply_directives` of the same edit on a paged state alone (move + rotate of the
  downstream KV and the 20-token fill), and `decode`: one decode step at the edited length.

The targets (issue 12): AMORTIZE's edited turn within 2x of splice + decode; FORGET's
re-prefill at least as fast per token as a cold prefill of the same tokens. Model: 2-layer
DeepSeek-V2 shapes with hidden 256 (kv_lora_rank 512, rope 64, 16 heads), random fp32 params;
engine defaults (bf16 c_kv, fp32 k_pe, page 16).

    python -m benchmarks.edited_turn [--repeats 7] [--out FILE.json]
"""

from __future__ import annotations

import functools
import statistics
import tempfile

import jax
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from checkpoints.tiny import write_random_checkpoint
from leyline_jax import paged
from serve.engine import Engine
from serve.sampling import SamplingParams

CONTEXT, START, END, NEW = 4096, 1000, 1500, 20
CONFIG = dict(harness.BENCH_HF_CONFIG, hidden_size=256, intermediate_size=1024, vocab_size=32000)
ENGINE = dict(num_pages=1024, page_size=16, max_seqs=4, max_seq_len=8192)


def edited(history: list[int], new: list[int]) -> list[int]:
    return history[:START] + new + history[END:]


def one_round(model, engines: dict, cold: Engine, context, new) -> dict[str, float]:
    """Seconds of every arm, once each, in turn."""
    one, out = SamplingParams(max_new_tokens=1), {}

    def turn(engine: Engine, session: int, prompt: list[int], mode=None):
        """One token's turn: `prompt` appended to the session, or (`mode`) its whole prompt."""
        if mode is None:
            return engine.submit(session, prompt, sampling=one).result()
        return engine.submit_prompt(session, prompt, mode=mode, sampling=one).result()

    for arm, engine in engines.items():
        s = engine.open_session()
        turn(engine, s, context)
        prompt = edited(engine.sessions[s].tokens, new)
        out[arm] = harness.timed(functools.partial(turn, engine, s, prompt, ll.Mode(arm)))
        engine.close_session(s)
    prompt = edited(context + [0], new)
    for arm, p in (("cold", prompt), ("cold_prefix", prompt[:START])):
        s = cold.open_session()
        out[arm] = harness.timed(functools.partial(turn, cold, s, p))
        cold.close_session(s)
    # the splice and one decode step alone, on a paged state
    state = ll.init_state(model.config, num_pages=600, page_size=16, max_seqs=1)
    state, _ = ll.prefill(model, state, 0, context + [0])
    jax.block_until_ready(state.pools)
    edit = ll.Directive(START, END, new)
    state, out["splice"] = harness.clocked(lambda: ll.apply_directive(model, state, 0, edit))
    out["decode"] = harness.timed(lambda: paged.decode(model, state, [0], [1]))
    return out


def main(argv=None) -> dict:
    ap = harness.parser(__doc__, repeats=7)
    args = ap.parse_args(argv)
    model = ll.load_model(write_random_checkpoint(tempfile.mkdtemp(), CONFIG, seed=0))
    rng = np.random.default_rng(0)
    context = rng.integers(0, CONFIG["vocab_size"], CONTEXT).tolist()
    new = rng.integers(0, CONFIG["vocab_size"], NEW).tolist()
    engines = {m: Engine(model, **ENGINE) for m in ("amortize", "forget")}
    cold = Engine(model, radix=False, **ENGINE)
    rounds = [one_round(model, engines, cold, context, new) for _ in range(args.repeats + 1)]
    times = {k: [r[k] for r in rounds[1:]] for k in rounds[0]}  # the first round compiles
    med = {k: statistics.median(v) for k, v in times.items()}
    med["amortize / (splice + decode)"] = med["amortize"] / (med["splice"] + med["decode"])
    med["forget / (cold - cold_prefix)"] = med["forget"] / (med["cold"] - med["cold_prefix"])
    med["forget / cold"] = med["forget"] / med["cold"]
    for k, v in med.items():
        print(f"{k:40s} {v * 1000:10.1f} ms" if "/" not in k else f"{k:40s} {v:10.2f}")
    harness.save_json(args.out, {"medians_s": med, "runs_s": times, "repeats": args.repeats}, 1)
    return med


if __name__ == "__main__":
    main()
