"""(d) The whole V2-Lite-shaped model: prefill and decode tokens/s, beside the floor and HF.

    python -m benchmarks.device.model --out model.json [--hf hf.json] [--smoke] [--budget S]

Model: DeepSeek-V2-Lite's config (all 27 layers; `MLAConfig` from the HF config dict through
`leyline_jax.loader.config_from_hf`), random bf16 weights made on the device
(`measure.random_model`). One paged state for every run (bf16 `c_kv`, fp32 `k_pe`, page 16,
page tables as wide as the longest prompt), so every run meets the same compiled shapes:

- decode C (32, 8, 1; first, since C = 32 is the target): C sequences of `decode_context`
  tokens each, then `paged.decode` steps of one token for each (the serving engine's call,
  graph split once), each step timed until its logits are ready (a server reads them every
  step), median of `decode_steps` steps after `decode_warmup`; tokens/s = C / step time.
- prefill T (512, 2048, 8192): `leyline_jax.prefill` of T random tokens into an empty sequence
  (chunks of 1024 past that), wall time until its logits are ready, median of `repeats` runs
  after one warm-up; the sequence is freed after each run.

Floor: `floors.prefill_cost` / `decode_cost` (flops and bytes the work needs) over the bf16
matmul rate and the copy bandwidth measured at the start of this run: max(flops / rate,
bytes / bandwidth). HF: the rows of `--hf` (the Hugging Face part's JSON, same config and
lengths) when that part succeeded, side by side; `speedup_vs_hf` = HF time / ours.
"""

from __future__ import annotations

import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import leyline_jax as ll
from benchmarks.device import floors, measure, report
from benchmarks.device.shapes import sizes
from leyline_jax import paged
from leyline_jax.loader import config_from_hf


def hf_rows(path: str | None, layers: int) -> tuple[dict, str]:
    """{(kind, size): seconds} of the HF part's result at `layers` layers, and why it is empty
    when it is."""
    if not path or not os.path.isfile(path):
        return {}, "no HF result file"
    with open(path) as f:
        hf = json.load(f)
    if hf.get("status") not in ("ok", "partial"):
        return {}, f"the HF part's status is {hf.get('status')!r}"
    if hf.get("config", {}).get("layers") != layers:
        return {}, f"HF ran {hf.get('config', {}).get('layers')} layers, ours {layers}"
    return {(r["kind"], r["size"]): r["time_s"] for r in hf["rows"]}, ""


def finite(logits) -> None:
    """Random weights that overflow bf16 would time garbage (and NaN paths can run faster)."""
    if not bool(jnp.isfinite(logits).all()):
        raise FloatingPointError("the random model's logits are not finite")


def main(argv=None) -> None:
    ap = report.parser(__doc__.splitlines()[0])
    ap.add_argument("--hf", default=None, help="the Hugging Face part's JSON")
    args = ap.parse_args(argv)
    sz = sizes(args.smoke)
    with report.Part("model", args) as part:
        config = config_from_hf(sz.hf)
        flop_s = measure.matmul_rate(sz.matmul_n)
        bytes_s = measure.copy_bandwidth(sz.copy_bytes)["bytes_s"]
        model = measure.random_model(config, jnp.bfloat16)
        counted = floors.Params.of(config).total
        held = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        if counted != held:  # the floors would count a model other than this one
            raise AssertionError(f"floors count {counted} parameters, the model holds {held}")
        part.set(
            device=measure.device_info(),
            peaks=dict(bf16_matmul_flop_s=flop_s, copy_bytes_s=bytes_s),
            config=dict(
                layers=config.num_hidden_layers,
                params=held,
                hidden=config.hidden_size,
                experts=config.n_routed_experts,
                experts_per_token=config.num_experts_per_tok,
                vocab=config.vocab_size,
                weights="bfloat16",
                page_size=sz.page_size,
                decode_context=sz.decode_context,
            ),
        )
        hf, hf_note = hf_rows(args.hf, config.num_hidden_layers)
        part.set(hf_note=hf_note or None)
        ps, top = sz.page_size, max(sz.prefill_lengths)
        per_seq = -(-(sz.decode_context + sz.decode_warmup + sz.decode_steps) // ps)
        state = ll.init_state(
            config,
            num_pages=max(-(-top // ps), max(sz.decode_batches) * per_seq) + 4,
            page_size=ps,
            max_seqs=max(sz.decode_batches),
            max_seq_len=max(top, sz.decode_context + sz.decode_warmup + sz.decode_steps),
        )
        rng = np.random.default_rng(0)
        box = {"state": state}

        def row(kind: str, size: int, ours: float, cost: tuple) -> None:
            floor = floors.floor_s(cost, flop_s, bytes_s)
            theirs = hf.get((kind, size))
            part.add(
                dict(
                    kind=kind,
                    size=size,
                    time_s=ours,
                    ours_tok_s=size / ours,
                    floor_tok_s=size / floor,
                    ours_over_floor=ours / floor,
                    flops=cost[0],
                    bytes=cost[1],
                    hf_tok_s=size / theirs if theirs else None,
                    speedup_vs_hf=theirs / ours if theirs else None,
                )
            )

        graph = nnx.split(model)
        for c in sz.decode_batches:
            if part.out_of_time():
                part.skip(f"decode {c}: out of time")
                continue
            seqs = list(range(c))
            for s in seqs:
                ctx = rng.integers(0, config.vocab_size, sz.decode_context)
                box["state"], _ = ll.prefill(model, box["state"], s, ctx)
            step = [1] * c

            def run_decode(seqs=seqs, step=step):
                box["state"], box["logits"] = paged.decode(
                    model, box["state"], seqs, step, graph=graph
                )
                return box["logits"]

            samples = [measure.timed(run_decode) for _ in range(sz.decode_warmup + sz.decode_steps)]
            finite(box["logits"])
            for s in seqs:
                box["state"] = ll.free(box["state"], s)
            context = sz.decode_context + sz.decode_warmup + sz.decode_steps // 2
            ours = statistics.median(samples[sz.decode_warmup :])
            row("decode", c, ours, floors.decode_cost(config, c, context))

        for t in sz.prefill_lengths:
            if part.out_of_time():
                part.skip(f"prefill {t}: out of time")
                continue
            prompt = rng.integers(0, config.vocab_size, t)

            def run_prefill(prompt=prompt):
                box["state"], box["logits"] = ll.prefill(model, box["state"], 0, prompt)
                return box["logits"]

            samples = []
            for _ in range(1 + sz.repeats):  # the first compiles
                samples.append(measure.timed(run_prefill))
                box["state"] = ll.free(box["state"], 0)
            finite(box["logits"])
            row("prefill", t, statistics.median(samples[1:]), floors.prefill_cost(config, t))


if __name__ == "__main__":
    main()
