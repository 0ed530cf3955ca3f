"""Render a device-suite run as the markdown to paste into BENCHMARKS.md.

    python -m benchmarks.device.to_markdown OUTDIR

Reads OUTDIR/summary.json and each part's JSON (whatever exists: a part that failed shows as
its status) and prints the tables: kernel tests, the splice pass against the copy bandwidth,
one layer's attention against it,
AMORTIZE vs FORGET, the model beside its floor and Hugging Face, and the targets.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.device.report import read_json
from benchmarks.harness import section, table


def _load(out: str, name: str) -> dict | None:
    return read_json(os.path.join(out, f"{name}.json"))


def _num(x, fmt: str = ".3g", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{fmt}}{suffix}"


def _ms(s) -> str:
    return "—" if s is None else f"{s * 1e3:.3g} ms"


def _header(summary: dict) -> list[str]:
    env = summary.get("environment", {})
    device, git = env.get("device") or {}, summary.get("git") or {}
    packages = env.get("packages", {})
    return [
        f"Device suite ({'smoke, ' if summary.get('smoke') else ''}"
        f"{device.get('device_kind', '?')}, {summary.get('date', '?')}, "
        f"commit {(git.get('commit') or '?')[:7]}{' + changes' if git.get('dirty') else ''}, "
        f"jax {packages.get('jax')}, torch {packages.get('torch')}, "
        f"transformers {packages.get('transformers')}). Command: "
        f"`benchmarks/device/run.sh OUTDIR`.",
        "",
        "Parts: "
        + ", ".join(
            f"{name} {p['status']} ({p['wall_s']:.0f} s)"
            for name, p in summary.get("parts", {}).items()
        )
        + ".",
    ]


def _kernels(kernels: dict) -> list[str]:
    c = kernels["counts"]
    return [
        "",
        f"Compiled-kernel tests (`pytest -m accelerator` over "
        f"{', '.join(kernels['files']) or 'no file'}): {c['passed']} passed, "
        f"{c['failed']} failed, {c['skipped']} skipped, {c['error']} errors.",
    ]


def _splice(splice: dict) -> list[str]:
    cfg, bw = splice["config"], splice["copy_bandwidth"]
    header = ["downstream", "path", "runs", "time", "bytes", "GB/s", "of copy bw", "of spec HBM"]
    rows = [
        [str(r["downstream"]), r.get("kernel") or "jnp", str(r["runs"]), _ms(r["splice_s"])]
        + [f"{r['bytes'] / 1e6:.0f} MB"]
        + [_num(r["bytes_s"] / 1e9, ".0f")]
        + [_num(r[k], ".0%") for k in ("fraction_of_copy_bw", "fraction_of_spec_bw")]
        for r in splice["rows"]
    ]
    caption = (
        f"Splice pass (`splice_pools`, impl None: `{splice['kernel'] or 'jnp'}`"
        f"{', the jnp path beside it' if splice['kernel'] else ''}; {cfg['layers']} layers, "
        f"c_kv {cfg['kv_lora_rank']} bf16 + k_pe {cfg['qk_rope_head_dim']} fp32, page "
        f"{cfg['page_size']}); copy bandwidth measured in the same run: "
        f"{bw['bytes_s'] / 1e9:.0f} GB/s (read + write)."
    )
    return section(caption, header, rows)


def _attention(attention: dict) -> list[str]:
    header = ["step", "C", "context", "path", "time", "cache read", "of copy bw", "row 0 error"]
    rows = [
        [f"{r['kind']} ({r['queries']} q)", str(r["batch"]), str(r["context"])]
        + [r.get("kernel") or "jnp", _ms(r["step_s"]), f"{r['bytes'] / 1e6:.0f} MB"]
        + [_num(r["fraction_of_copy_bw"], ".1%"), _num(r["error_row0"], ".1e")]
        for r in attention["rows"]
    ]
    bw = attention["copy_bandwidth"]["bytes_s"]
    caption = (
        "Ragged paged attention, one V2-Lite layer (`ragged_paged_attention` jitted, impl "
        "None, the jnp path beside it; 16 heads, c_kv 512 bf16 + k_pe 64 fp32, page "
        f"{attention['page_size']}); copy bandwidth measured in the same run: {bw / 1e9:.0f} "
        "GB/s. Row 0 error: against float64 numpy, relative to the output's largest value."
    )
    return section(caption, header, rows)


def _edit(edit: dict) -> list[str]:
    cfg = edit["config"]
    note = f" ({cfg['layers_note']})" if cfg.get("layers_note") else ""
    rows = [
        [str(r["downstream"]), _ms(r["amortize_s"]), _ms(r["forget_s"])]
        + [_num(r["forget_over_amortize"], ".3g", "x")]
        for r in edit["rows"]
    ]
    caption = (
        f"AMORTIZE vs FORGET (`apply_directive`; {cfg['layers']} of "
        f"{cfg['full_layers']} layers{note}; prefix {cfg['prefix']}, span {cfg['span']} -> "
        f"stub {cfg['stub']}; splice `{edit['splice']['kernel'] or 'jnp'}`):"
    )
    return section(caption, ["downstream", "AMORTIZE", "FORGET", "FORGET / AMORTIZE"], rows)


def _model(model: dict, hf: dict | None) -> list[str]:
    cfg, peaks = model["config"], model["peaks"]
    hf_cfg, hf_dev = (hf or {}).get("config", {}), (hf or {}).get("device", {})
    header = ["kind", "size", "ours tok/s", "HF tok/s", "floor tok/s", "ours / HF", "time / floor"]
    rows = [
        [r["kind"], str(r["size"])]
        + [_num(r[k], ".4g") for k in ("ours_tok_s", "hf_tok_s", "floor_tok_s")]
        + [_num(r["speedup_vs_hf"], ".2f"), _num(r["ours_over_floor"], ".1f")]
        for r in sorted(model["rows"], key=lambda r: (r["kind"] != "prefill", r["size"]))
    ]
    note = f" ({model['hf_note']})" if model.get("hf_note") else ""
    caption = (
        f"Model: {cfg['layers']} layers, {cfg['params'] / 1e9:.3g}B params, "
        f"random {cfg['weights']} weights; decode at {cfg['decode_context']} tokens of "
        f"context. Floor = max(flops / {peaks['bf16_matmul_flop_s'] / 1e12:.3g} TFLOP/s, "
        f"bytes / {peaks['copy_bytes_s'] / 1e12:.3g} TB/s), both measured in the same run. "
        f"HF: transformers {hf_dev.get('transformers', '?')} on {hf_dev.get('name', '?')}, "
        f"attention `{hf_cfg.get('attn_implementation')}`, experts "
        f"`{hf_cfg.get('experts_implementation')}`{note}."
    )
    return section(caption, header, rows)


def render(out: str) -> str:
    summary = _load(out, "summary") or {}
    lines = _header(summary)
    kernels = _load(out, "kernels")
    if kernels and "counts" in kernels:
        lines += _kernels(kernels)
    for name, render_part in (("splice", _splice), ("attention", _attention), ("edit", _edit)):
        part = _load(out, name)
        if part and part.get("rows"):
            lines += render_part(part)
    model = _load(out, "model")
    if model and model.get("rows"):
        lines += _model(model, _load(out, "hf"))
    if summary.get("targets"):
        rows = [
            [t["target"], _num(t["value"], ".2f"), "yes" if t["met"] else "**no**"]
            for t in summary["targets"]
        ]
        lines += ["", *table(["target", "measured", "met"], rows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    print(render(ap.parse_args(argv).out), end="")


if __name__ == "__main__":
    main()
