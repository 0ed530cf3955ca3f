"""(d) The whole V2-Lite-shaped model: prefill and decode tokens/s, beside the floor and HF.

    python -m benchmarks.device.model --out model.json [--hf hf.json] [--smoke] [--quick]
        [--budget S]

Model: DeepSeek-V2-Lite's config (all 27 layers; `MLAConfig` from the HF config dict through
`leyline_jax.loader.config_from_hf`), random bf16 weights made on the device
(`measure.random_model`). One paged state for every run (bf16 `c_kv`, fp32 `k_pe`, page 16,
page tables as wide as the longest prompt), so every run meets the same compiled shapes:

- decode C (32, 8, 1; first, since C = 32 is the target; --quick: 32): C sequences of
  `decode_context` tokens each, then `paged.decode` steps of one token for each (the serving
  engine's call, graph split once), each step timed until its logits are ready (a server reads
  them every step), median of `decode_steps` steps after `decode_warmup`; tokens/s = C / step
  time.
- prefill T (512, 2048, 8192; --quick: 2048, 8192): `leyline_jax.prefill` of T random tokens
  into an empty sequence (chunks of the state's step size past that), wall time until its logits
  are ready, median of `repeats` runs after one warm-up; the sequence is freed after each run.

Each row's `path` names the kernels the programs its warm-up ran call (`measure.Programs`:
the layer programs of `leyline_jax.paged`, lowered at the shapes they ran), "jnp" for none.

Floor: `floors.prefill_cost` / `decode_cost` (flops and bytes the work needs) over the bf16
matmul rate and the copy bandwidth measured at the start of this run: max(flops / rate,
bytes / bandwidth). HF: the rows of `--hf` (the Hugging Face part's JSON, same config and
lengths) when that part succeeded, side by side; `speedup_vs_hf` = HF time / ours (targets,
issue 49: >= 1 for prefill at 2048 and 8192, >= 5 for decode at C = 32).
"""

from __future__ import annotations

import contextlib
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import leyline_jax as ll
from benchmarks import harness
from benchmarks.device import floors, measure, report
from benchmarks.device.shapes import sizes
from leyline_jax import paged
from leyline_jax.allocator import pages_for
from leyline_jax.loader import config_from_hf
from leyline_jax.model import Split


def hf_rows(path: str | None, layers: int) -> tuple[dict, str]:
    """{(kind, size): seconds} of the HF part's result at `layers` layers, and why it is empty
    when it is."""
    hf = report.read_json(path) if path else None
    if hf is None:
        return {}, "no HF result file"
    if hf.get("status") not in ("ok", "partial"):
        return {}, f"the HF part's status is {hf.get('status')!r}"
    if hf.get("config", {}).get("layers") != layers:
        return {}, f"HF ran {hf.get('config', {}).get('layers')} layers, ours {layers}"
    return {(r["kind"], r["size"]): r["time_s"] for r in hf["rows"]}, ""


def finite(logits) -> None:
    """Random weights that overflow bf16 would time garbage (and NaN paths can run faster)."""
    if not bool(jnp.isfinite(logits).all()):
        raise FloatingPointError("the random model's logits are not finite")


def describe(part: report.Part, model, sz, flop_s: float, bytes_s: float) -> None:
    """The part's rates, device and model (checked: the floors count this model's parameters)."""
    config = model.config
    counted = floors.Params.of(config).total
    held = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if counted != held:  # the floors would count a model other than this one
        raise AssertionError(f"floors count {counted} parameters, the model holds {held}")
    cfg = dict(layers=config.num_hidden_layers, params=held, hidden=config.hidden_size)
    cfg |= dict(experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok)
    cfg |= dict(vocab=config.vocab_size, weights="bfloat16", page_size=sz.page_size)
    cfg |= dict(decode_context=sz.decode_context)
    peaks = dict(bf16_matmul_flop_s=flop_s, copy_bytes_s=bytes_s)
    part.set(device=measure.device_info(), peaks=peaks, config=cfg)


class Runs:
    """The timed runs, on one paged state for all of them (page tables as wide as the longest
    prompt), so that every run meets the same compiled shapes."""

    def __init__(self, model, sz):
        self.model, self.sz, self.graph = model, sz, Split.of(model)
        self.rng = np.random.default_rng(0)
        ps, top, batch = sz.page_size, max(sz.prefill_lengths), max(sz.decode_batches)
        longest = sz.decode_context + sz.decode_warmup + sz.decode_steps
        pages = max(pages_for(top, ps), batch * pages_for(longest, ps)) + 4
        size = dict(num_pages=pages, page_size=ps, max_seqs=batch, max_seq_len=max(top, longest))
        self.state = ll.init_state(model.config, **size)

    def decode(self, c: int, path: dict) -> float:
        """Median seconds of a decode step of c sequences of `decode_context` tokens each (the
        implementation its warm-up steps ran into `path`)."""
        sz, seqs, step = self.sz, list(range(c)), [1] * c
        for s in seqs:
            ctx = self.rng.integers(0, self.model.config.vocab_size, sz.decode_context)
            self.state, _ = ll.prefill(self.model, self.state, s, ctx)

        def run():
            self.state, logits = paged.decode(self.model, self.state, seqs, step, graph=self.graph)
            return logits

        with measure.recorded(path):
            for _ in range(sz.decode_warmup):
                jax.block_until_ready(run())
        samples = []
        for _ in range(sz.decode_steps):
            logits, dt = harness.clocked(run)
            samples.append(dt)
        finite(logits)
        for s in seqs:
            self.state = ll.free(self.state, s)
        return statistics.median(samples)

    def prefill(self, t: int, path: dict) -> float:
        """Median seconds of prefilling t tokens into an empty sequence (after one warm-up, whose
        implementation goes into `path`)."""
        prompt = self.rng.integers(0, self.model.config.vocab_size, t)

        def run():
            self.state, logits = ll.prefill(self.model, self.state, 0, prompt)
            return logits

        samples = []
        for i in range(1 + self.sz.repeats):  # the first compiles
            with measure.recorded(path) if i == 0 else contextlib.nullcontext():
                logits, dt = harness.clocked(run)
            samples.append(dt)
            self.state = ll.free(self.state, 0)
        finite(logits)
        return statistics.median(samples[1:])


def main(argv=None) -> None:
    ap = report.parser(__doc__.splitlines()[0])
    ap.add_argument("--hf", default=None, help="the Hugging Face part's JSON")
    args = ap.parse_args(argv)
    sz = sizes(args.smoke, args.quick)
    with report.Part("model", args) as part:
        config = config_from_hf(sz.hf)
        flop_s = harness.matmul_rate(sz.matmul_n, jnp.bfloat16, iters=5)
        bytes_s = harness.copy_bandwidth(sz.copy_bytes, iters=10, fresh=True)["bytes_s"]
        model = measure.random_model(config, jnp.bfloat16)
        describe(part, model, sz, flop_s, bytes_s)
        hf, hf_note = hf_rows(args.hf, config.num_hidden_layers)
        part.set(hf_note=hf_note or None)

        def row(kind: str, size: int, ours: float, path: dict, cost: tuple) -> None:
            floor, theirs = floors.floor_s(cost, flop_s, bytes_s), hf.get((kind, size))
            row = dict(kind=kind, size=size, time_s=ours, flops=cost[0], bytes=cost[1])
            part.add(row | harness.beside(size, ours, floor, theirs) | path)

        runs = Runs(model, sz)
        context = sz.decode_context + sz.decode_warmup + sz.decode_steps // 2
        for c in part.each(sz.decode_batches, "decode {}"):
            path = {}
            ours = runs.decode(c, path)
            row("decode", c, ours, path, floors.decode_cost(config, c, context))
        for t in part.each(sz.prefill_lengths, "prefill {}"):
            path = {}
            ours = runs.prefill(t, path)
            row("prefill", t, ours, path, floors.prefill_cost(config, t))


if __name__ == "__main__":
    main()
