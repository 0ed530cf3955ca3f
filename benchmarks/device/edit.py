"""(c) AMORTIZE vs FORGET at long downstream lengths, on a V2-Lite-shaped model.

    python -m benchmarks.device.edit --out edit.json [--smoke] [--quick] [--budget S]

Model: the V2-Lite config with `edit_layers` decoder layers (4 at full size, a dense one then
MoE ones: every 32k-token prefill through 27 layers would not fit this part's time budget; both
arms' costs grow about linearly with layers, so their ratio carries over), random bf16 weights
made on the device. Paged state: bf16 `c_kv`, fp32 `k_pe`, page 16. Sequence 0 holds a prefix,
a span and D downstream tokens, prefilled through the model. Each timed run forks it into
sequence 1 (pages shared), applies `Directive(prefix, prefix + span, stub, mode)` there through
`leyline_jax.apply_directive` and frees it again: AMORTIZE splices the D downstream tokens and
prefills the stub; FORGET drops everything from the prefix on and re-prefills stub + D. Time:
from the call until its pools are ready; medians after a warm-up run (compiles excluded). On a
fork the pages FORGET drops stay referenced by sequence 0, so neither arm zeroes pages here.
D: 8k and 32k (--quick: 8k). Each row names its implementations: `splice_path`, the kernel of
the public `splice_pools` lowered at these pools' widths (`splice.splice_impl`), and
`step_path`, the kernels the model's step programs call in the row's warm-up runs
(`measure.Programs`; FORGET warms up in the first row only, its shapes being the same at every
D).
"""

from __future__ import annotations

import contextlib
import statistics

import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from benchmarks.device import measure, report
from benchmarks.device.model import finite
from benchmarks.device.shapes import sizes
from benchmarks.device.splice import splice_impl
from leyline_jax.allocator import pages_for
from leyline_jax.loader import config_from_hf


def run_arm(model, state, directive, warm: int, runs: int, programs: measure.Programs) -> tuple:
    """`warm` untimed applications of `directive` to forks of sequence 0 (their step programs
    recorded into `programs`), then `runs` timed ones -> (state, seconds of the timed ones)."""
    out = []
    for i in range(warm + runs):
        state = ll.fork(state, 0, 1)
        with programs if i < warm else contextlib.nullcontext():
            state, dt = harness.clocked(lambda s=state: ll.apply_directive(model, s, 1, directive))
        if i >= warm:
            out.append(dt)
        state = ll.free(state, 1)
    return state, out


def describe(part: report.Part, config, sz) -> str | None:
    """The part's device, splice implementation and config (and why it has fewer layers);
    returns the splice's kernel (None: jnp)."""
    full = sz.hf["num_hidden_layers"]
    note = None
    if config.num_hidden_layers < full:
        note = (
            "fewer layers than the full config: 32k-token prefills through every layer do not "
            "fit this part's time budget; both arms scale about linearly in layers"
        )
    cfg = dict(layers=config.num_hidden_layers, full_layers=full, layers_note=note)
    cfg |= dict(prefix=sz.edit_prefix, span=sz.edit_span, stub=sz.edit_stub)
    cfg |= dict(page_size=sz.page_size, weights="bfloat16")
    part.set(device=measure.device_info(), splice=splice_impl(config, sz.page_size), config=cfg)
    return part.data["splice"]["kernel"]


def main(argv=None) -> None:
    args = report.parser(__doc__.splitlines()[0]).parse_args(argv)
    sz = sizes(args.smoke, args.quick)
    with report.Part("edit", args) as part:
        config = config_from_hf(dict(sz.hf, num_hidden_layers=sz.edit_layers))
        splice_kernel = describe(part, config, sz)
        model = measure.random_model(config, jnp.bfloat16)
        ps, top = sz.page_size, sz.edit_prefix + sz.edit_span + max(sz.edit_downstream)
        held, fresh = pages_for(top, ps), pages_for(sz.edit_stub + max(sz.edit_downstream), ps)
        size = dict(num_pages=held + fresh + 4, page_size=ps, max_seq_len=(held + 1) * ps)
        state = ll.init_state(config, max_seqs=2, **size)
        span = (sz.edit_prefix, sz.edit_prefix + sz.edit_span)  # replaced by the stub
        rng = np.random.default_rng(0)
        stub = rng.integers(0, config.vocab_size, sz.edit_stub).tolist()
        for i, d in enumerate(part.each(sz.edit_downstream, "downstream={}")):
            tokens = rng.integers(0, config.vocab_size, span[1] + d)
            state, logits = ll.prefill(model, state, 0, tokens)
            finite(logits)
            times, programs = {}, measure.Programs()
            for mode in (ll.Mode.AMORTIZE, ll.Mode.FORGET):
                directive = ll.Directive(*span, stub, mode=mode)
                # AMORTIZE compiles a splice per move bucket (one per D); FORGET's shapes are
                # the same at every D (whole chunks plus the stub's remainder)
                warm = 1 if mode is ll.Mode.AMORTIZE or i == 0 else 0
                runs = sz.repeats if mode is ll.Mode.AMORTIZE else sz.edit_forget_repeats
                state, times[mode.value] = run_arm(model, state, directive, warm, runs, programs)
            state = ll.free(state, 0)
            amortize, forget = (statistics.median(times[m]) for m in ("amortize", "forget"))
            row = dict(downstream=d, amortize_s=amortize, forget_s=forget)
            row |= dict(splice_path=splice_kernel or "jnp", step_path=programs.path()["path"])
            row |= dict(forget_over_amortize=forget / amortize)
            row |= dict(amortize_samples_s=times["amortize"], forget_samples_s=times["forget"])
            part.add(row | dict(spliced_tokens=d, forget_prefilled_tokens=sz.edit_stub + d))


if __name__ == "__main__":
    main()
