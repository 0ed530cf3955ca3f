"""(b) The splice pass against the device's memory bandwidth, measured in the same run.

    python -m benchmarks.device.splice --out splice.json [--smoke] [--quick] [--budget S]

Pools as `leyline_jax.init_state` stores them at the config's shapes (V2-Lite: 27 layers, bf16
`c_kv` [P, 16, 512] as raw bits, fp32 `k_pe` [P, 16, 64]), page size 16. The moves are those of
an AMORTIZE splice of D downstream tokens: a span of `edit_span` tokens after a prefix of
`edit_prefix` replaced by `edit_stub` (a shift that is not a whole page, so a page's rows split
into two runs, as a real splice's do), the sequence's pages and the fresh ones scattered over
the pool (a serving pool after some churn: no run continues across a page). Timed:
`leyline_jax.splice.splice_pools` (`splice_rotate` over every layer's pools, one jitted,
donated step a layer, as the directive runs it; whatever program the entry point runs), with the
runs `plan_runs` makes of those rows: impl=None (the platform's kernel; each row records the
kernel call its lowered program holds, if any) and, on an accelerator outside --quick, the jnp
path beside it (3 samples of one call: it is 50-100x slower). Bytes = D x layers x (R x 2 B +
Dr x 4 B) x 2 (read + write); achieved bandwidth = bytes / time, as a fraction of the copy
bandwidth measured here (targets, issue 49: >= 0.75 at 131k tokens, <= 0.5 ms at 8k).
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from benchmarks.device import measure, report
from benchmarks.device.floors import kv_bytes_per_token
from benchmarks.device.measure import kernel_in
from benchmarks.device.shapes import sizes
from leyline_jax.allocator import pages_for
from leyline_jax.loader import config_from_hf
from leyline_jax.splice import splice_pools
from pallas_kernels.splice_runs import Runs, phase_table, plan_runs


def plan(d: int, prefix: int, span: int, stub: int, ps: int, pages: int) -> Runs:
    """The runs of moving one sequence's d downstream tokens from positions prefix + span + i
    to prefix + stub + i, from its pages to fresh ones, both drawn at random from `pages`."""
    old = pages_for(prefix + span + d, ps)
    first = prefix // ps  # the first page the edit changes: fresh pages replace it on
    order = np.random.default_rng(0).permutation(pages)
    table, fresh = order[:old], order[old : old + old - first]
    i = prefix + span + np.arange(d)
    j = prefix + stub + np.arange(d)
    src = table[i // ps] * ps + i % ps
    dst = fresh[j // ps - first] * ps + j % ps
    return plan_runs(src, dst, i, j, max_run=ps)


def splice_impl(config, page_size: int) -> dict:
    """What impl=None runs here: the kernel call in the splice step lowered for this backend at
    a small pool of `config`'s widths, or None for the jnp path ("error: ..." where the step
    does not lower: the jnp rows are still timed)."""
    state = ll.init_state(config, num_pages=8, page_size=page_size, max_seqs=1, max_seq_len=128)
    runs = Runs(*(jnp.zeros(4, jnp.int32) for _ in range(5)))
    inv = jnp.asarray(config.rope_inv_freq())
    step = jax.jit(splice_pools, static_argnames="impl")
    try:
        text = step.lower(state.pools, runs, inv, phase_table(inv, 8 * page_size)).as_text()
    except Exception as e:  # noqa: BLE001  (recorded; the part goes on with the jnp path)
        return {"impl": None, "kernel": f"error: {type(e).__name__}: {str(e)[:300]}"}
    return {"impl": None, "kernel": kernel_in(text)}


def time_splice(config, sz, d: int, samples: int, iters: int, impl=None) -> tuple[list, int]:
    """(seconds per splice of d downstream tokens, `samples` samples of `iters` calls each;
    runs per splice), on fresh pools sized for it."""
    ps = sz.page_size
    pages = 2 * (pages_for(sz.edit_prefix + sz.edit_span + d, ps) + 1)
    state = ll.init_state(config, num_pages=pages, page_size=ps, max_seqs=1, max_seq_len=pages * ps)
    runs = plan(d, sz.edit_prefix, sz.edit_span, sz.edit_stub, ps, pages)
    device_runs = Runs(*(jnp.asarray(a) for a in runs))
    inv = jnp.asarray(config.rope_inv_freq())
    table = phase_table(inv, pages * ps)
    box = {"pools": state.pools}

    def run():
        box["pools"] = splice_pools(box["pools"], device_runs, inv, table, impl=impl)
        return box["pools"].rotated[-1]

    return harness.times(run, repeats=samples, iters=iters), len(runs.src)


def main(argv=None) -> None:
    args = report.parser(__doc__.splitlines()[0]).parse_args(argv)
    sz = sizes(args.smoke, args.quick)
    with report.Part("splice", args) as part:
        config = config_from_hf(sz.hf)
        bw = harness.copy_bandwidth(sz.copy_bytes, iters=10, fresh=True)
        device = measure.device_info()
        cfg = dict(layers=config.num_hidden_layers, kv_lora_rank=config.kv_lora_rank)
        cfg |= dict(qk_rope_head_dim=config.qk_rope_head_dim, page_size=sz.page_size)
        cfg |= dict(c_kv_dtype="bfloat16", k_pe_dtype="float32")
        impl = splice_impl(config, sz.page_size)
        part.set(device=device, **impl, copy_bandwidth=bw, config=cfg)
        spec = (device["spec_peaks"] or {}).get("hbm_bytes_s")
        kernel = impl["kernel"]
        arms = [] if kernel and kernel.startswith("error") else [(None, kernel)]
        arms += [("jnp", None)] if kernel and sz.beside_jnp else []
        for d in part.each(sz.splice_downstream, "downstream={}"):
            for arm, kernel in arms:
                # the default path: `splice_samples` of `splice_iters` calls; jnp beside it:
                # 3 of one (a call takes 50-100x the kernel's)
                n, iters = (sz.splice_samples, sz.splice_iters) if arm is None else (3, 1)
                samples, runs = time_splice(config, sz, d, n, iters, arm)
                t = statistics.median(samples)
                nbytes = d * kv_bytes_per_token(config) * 2
                row = dict(downstream=d, impl=arm, kernel=kernel, runs=runs, splice_s=t)
                row |= dict(samples_s=samples, bytes=nbytes, bytes_s=nbytes / t)
                row |= dict(fraction_of_copy_bw=nbytes / t / bw["bytes_s"])
                part.add(row | dict(fraction_of_spec_bw=nbytes / t / spec if spec else None))


if __name__ == "__main__":
    main()
