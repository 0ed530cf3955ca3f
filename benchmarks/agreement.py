"""The agreement microbenchmark: when full context and FORGET disagree, whom does AMORTIZE follow?

    python -m benchmarks.agreement [--scenarios 100] [--max-attempts 3000] [--out agreement.json]

Scenario i (seeded by i, fixed procedure, nothing tuned): a 160-token prompt of random ids; a
span [s, e) with s in [16, 80) and e - s in [16, 48) is replaced by a 4-token stub. Three
next-token predictions after the prompt's last token (greedy, fp32):

- full: the unedited prompt;
- forget: a fresh prefill of the edited prompt (what FORGET computes);
- amortize: the prompt minus its last token is prefilled, the span is spliced with AMORTIZE,
  then the last token is appended.

Scenarios where full and forget agree are skipped; over those where they disagree we count how
often amortize equals full, equals forget, or neither. Models: the embedded tiny checkpoint of
each family (random weights: these numbers describe the mechanism on untrained models, not
language behaviour).
"""

from __future__ import annotations

import os
import tempfile

import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from benchmarks.fidelity import follows
from checkpoints.tiny import TINY_HF_CONFIGS, write_random_checkpoint

PROMPT, STUB = 160, (3, 4, 5, 6)


def scenario(i: int, vocab: int):
    rng = np.random.default_rng(i)
    tokens = rng.integers(0, vocab, PROMPT).tolist()
    s = int(rng.integers(16, 80))
    e = s + int(rng.integers(16, 48))
    return tokens, s, e


def predict(model, tokens, s, e):
    full = int(np.asarray(model(np.asarray(tokens)))[-1].argmax())
    edited = tokens[:s] + list(STUB) + tokens[e:]
    forget = int(np.asarray(model(np.asarray(edited)))[-1].argmax())
    state = ll.init_state(
        model.config, num_pages=32, page_size=16, max_seqs=1, kv_dtype=jnp.float32
    )
    state, _ = ll.prefill(model, state, 0, tokens[:-1])
    state = ll.apply_directive(model, state, 0, ll.Directive(s, e, STUB))
    _, logits = ll.prefill(model, state, 0, tokens[-1:])
    return full, forget, int(np.asarray(logits).argmax())


def run(model, scenarios: int, max_attempts: int) -> dict:
    counts = {"agree_full": 0, "agree_forget": 0, "neither": 0}
    kept = attempts = 0
    while kept < scenarios and attempts < max_attempts:
        tokens, s, e = scenario(attempts, model.config.vocab_size)
        attempts += 1
        full, forget, amortize = predict(model, tokens, s, e)
        if full == forget:
            continue
        kept += 1
        key = follows(amortize, full, forget)
        counts[key if key == "neither" else f"agree_{key}"] += 1
    rates = {f"rate_{k}": counts[f"agree_{k}"] / max(kept, 1) for k in ("full", "forget")}
    return {"scenarios": kept, "attempts": attempts, **counts, **rates}


def main(argv=None) -> dict:
    ap = harness.parser(__doc__, what="write the results (per family) as JSON here")
    ap.add_argument("--scenarios", type=int, default=100)
    ap.add_argument("--max-attempts", type=int, default=3000)
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family, cfg in TINY_HF_CONFIGS.items():
            model = ll.load_model(write_random_checkpoint(os.path.join(tmp, family), cfg))
            r = run(model, args.scenarios, args.max_attempts)
            results[family] = r
            print(
                f"{family:14s} disagreeing scenarios {r['scenarios']:4d} (of {r['attempts']} "
                f"tried) | amortize = full {r['agree_full']:3d} ({r['rate_full']:.0%}) | "
                f"= forget {r['agree_forget']:3d} ({r['rate_forget']:.0%}) | neither "
                f"{r['neither']:3d}",
                flush=True,
            )
    harness.save_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
