"""What log-probabilities and penalties cost a decode step: SmolLM2-135M-Instruct (fp32, its
49,152-token vocabulary), decode steps of 8 rows (64 prompt tokens each) with no row asking,
with every row asking for its tokens' log-probabilities and 20 alternatives
(`SamplingParams.logprobs`), and with every row penalized (presence, frequency, repetition);
the arms alternate in rounds, medians. Beside them: `token_logprobs` alone on the step's logits,
and its floor (one read of the logits at the read bandwidth measured in the same run).

    python -m benchmarks.sampling_bench [--steps 30] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from serve.engine.config import EngineConfig
from serve.http.backend import load_backend
from serve.sampling import MAX_LOGPROBS, SamplingParams, token_logprobs

ROWS, PROMPT = 8, 64


def decode_steps(engine, steps: int, asks: dict, rng) -> list[float]:
    """Seconds of `steps` decode steps of ROWS rows, each asking for `asks`."""
    vocab = engine.model.config.vocab_size
    prompts = [rng.integers(0, vocab, PROMPT).tolist() for _ in range(ROWS)]
    sp = SamplingParams(steps + 8, **asks)
    ts, reqs = harness.decode_step_times(engine, prompts, sp, steps)
    want = 0 if sp.logprobs is None else 1
    assert all(len(r.logprobs) == want * len(r.output) for r in reqs)
    return ts


def main() -> None:
    ap = harness.parser(__doc__, out=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    config = EngineConfig(num_pages=512, page_size=16, max_seqs=ROWS, max_seq_len=1024)
    engine = load_backend("smollm2", config).worker.engine
    rng = np.random.default_rng(0)
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    arms = {"none": {}, "logprobs": {"logprobs": MAX_LOGPROBS}, "penalties": penalties}
    for lp in arms.values():  # compiled and warm
        decode_steps(engine, 3, lp, rng)
    samples = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, lp in arms.items():
            samples[name] += decode_steps(engine, args.steps, lp, rng)
    step = {name: statistics.median(ts) for name, ts in samples.items()}
    vocab = engine.model.config.vocab_size
    logits = jax.random.normal(jax.random.PRNGKey(0), (ROWS, vocab), jnp.float32)
    toks = jnp.zeros(ROWS, jnp.int32)
    alone = harness.median_time(lambda: token_logprobs(logits, toks), iters=10)
    floor = ROWS * vocab * 4 / harness.read_bandwidth()
    base = step["none"]
    res = {
        "command": "python -m benchmarks.sampling_bench",
        "platform": harness.platform(),
        "rows": ROWS,
        "vocab": vocab,
        "step_s": step,
        "overhead_s": {k: v - base for k, v in step.items()},
        "overhead_fraction": {k: v / base - 1 for k, v in step.items()},
        "token_logprobs_alone_s": alone,
        "floor_s": floor,
        "alone_over_floor": alone / floor,
        "steps_per_arm": len(next(iter(samples.values()))),
    }
    print(res)
    harness.save_json(args.out, res)


if __name__ == "__main__":
    main()
