"""Render a device-suite run as markdown: the tables to paste into BENCHMARKS.md.

    python -m benchmarks.device.to_markdown OUTDIR [--out FILE]

Reads OUTDIR/summary.json, env.json and each part's JSON (whatever exists: a part that failed
shows as its status) and writes (to FILE, else stdout) the run's header (mode, date, GPU,
driver and CUDA, versions beside the pins, commit, the failed imports, each part's status, wall
time and budget), then the tables: the splice pass against the copy bandwidth, one layer's
decode attention against it, the model beside its floor and Hugging Face, AMORTIZE vs FORGET,
the compiled-kernel tests, and the targets (met, **not met**, or not measured). Every row names
the implementation it measured (the kernel its lowered program calls, or jnp). run.sh writes
OUTDIR/tables.md with it. No jax or torch: it renders a run whose jax did not import. Older
runs' files (before issue 49) render too.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.device.report import read_json, section, table


def _load(out: str, name: str) -> dict | None:
    return read_json(os.path.join(out, f"{name}.json"))


def _num(x, fmt: str = ".3g", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{fmt}}{suffix}"


def _ms(s) -> str:
    return "—" if s is None else f"{s * 1e3:.3g} ms"


def _path(kernel) -> str:
    return kernel or "jnp"


def _header(summary: dict, env: dict | None) -> list[str]:
    environment = summary.get("environment", {})
    env = env or {}
    device, git = environment.get("device") or {}, summary.get("git") or {}
    packages = environment.get("packages", {})
    mode = summary.get("mode") or ("smoke" if summary.get("smoke") else "full")
    smi = env.get("nvidia_smi") or environment.get("nvidia_smi") or {}
    gpus = smi.get("gpus") or []
    gpu = summary.get("gpu") or device.get("device_kind", "?")
    machine = gpu
    if gpus:
        machine += f", driver {gpus[0].get('driver_version')}, CUDA {smi.get('cuda_version')}"
    pins = ((env.get("pins") or environment.get("pins")) or {}).get("packages", {})

    def version(name: str) -> str:
        pin = pins.get(name)
        note = f" (pin {pin['pinned']})" if pin and not pin["matches"] else ""
        return f"{name} {packages.get(name)}{note}"

    flags = {"smoke": " --smoke", "full": "", "full, quick": " --quick"}
    flag = flags.get(mode, " --smoke --quick")
    lines = [
        f"Device suite ({mode}; {machine}; {summary.get('date', '?')}; commit "
        f"{(git.get('commit') or '?')[:7]}{' + changes' if git.get('dirty') else ''}): "
        + ", ".join(version(p) for p in ("jax", "jaxlib", "flax", "torch", "transformers"))
        + f". Command: `benchmarks/device/run.sh OUTDIR{flag}`.",
    ]
    failed = summary.get("imports_failed") or []
    if failed:
        blocked = summary.get("parts_blocked") or {}
        lines += [
            "",
            f"**Imports failed**: {', '.join(failed)}"
            + (f" (parts that cannot run: {', '.join(blocked)})" if blocked else "")
            + ".",
        ]
    elif env:
        lines += ["", "Every piece the suite needs imported (env.json)."]
    for problem in env.get("problems") or []:
        if not problem.startswith("import failed"):
            lines += ["", f"**Environment**: {problem}."]

    def part(name: str, p: dict) -> str:
        budget = f" of {p['budget_s']:.0f}" if p.get("budget_s") is not None else ""
        return f"{name} {p['status']} ({p['wall_s']:.0f}{budget} s)"

    parts = summary.get("parts", {})
    lines += ["", "Parts: " + ", ".join(part(n, p) for n, p in parts.items()) + "."]
    return lines


def _kernels(kernels: dict) -> list[str]:
    c = kernels["counts"]
    skipped = len(kernels.get("skipped") or [])
    late = f" ({skipped} of them out of time)" if skipped else ""
    return [
        "",
        f"Compiled-kernel tests (`pytest -m accelerator` over "
        f"{', '.join(kernels['files']) or 'no file'}): {c['passed']} passed, "
        f"{c['failed']} failed, {c['skipped']} skipped{late}, {c['error']} errors.",
    ]


def _splice(splice: dict) -> list[str]:
    cfg, bw = splice["config"], splice["copy_bandwidth"]
    header = ["downstream", "path", "runs", "time", "bytes", "GB/s", "of copy bw", "of spec HBM"]
    rows = [
        [str(r["downstream"]), _path(r.get("kernel")), str(r["runs"]), _ms(r["splice_s"])]
        + [f"{r['bytes'] / 1e6:.0f} MB"]
        + [_num(r["bytes_s"] / 1e9, ".0f")]
        + [_num(r[k], ".0%") for k in ("fraction_of_copy_bw", "fraction_of_spec_bw")]
        for r in splice["rows"]
    ]
    beside = any(r.get("impl") == "jnp" for r in splice["rows"])
    caption = (
        f"Splice pass (`splice_pools`, impl None: `{_path(splice['kernel'])}`"
        f"{', the jnp path beside it' if beside else ''}; {cfg['layers']} layers, "
        f"c_kv {cfg['kv_lora_rank']} bf16 + k_pe {cfg['qk_rope_head_dim']} fp32, page "
        f"{cfg['page_size']}); copy bandwidth measured in the same run: "
        f"{bw['bytes_s'] / 1e9:.0f} GB/s (read + write)."
    )
    return section(caption, header, rows, "rlrrrrrr")


def _attention(attention: dict) -> list[str]:
    header = ["step", "C", "context", "path", "time", "cache read", "of copy bw", "row 0 error"]
    rows = [
        [f"{r['kind']} ({r['queries']} q)", str(r["batch"]), str(r["context"])]
        + [_path(r.get("kernel")), _ms(r["step_s"]), f"{r['bytes'] / 1e6:.0f} MB"]
        + [_num(r["fraction_of_copy_bw"], ".1%"), _num(r["error_row0"], ".1e")]
        for r in attention["rows"]
    ]
    bw = attention["copy_bandwidth"]["bytes_s"]
    beside = any(r.get("impl") == "jnp" for r in attention["rows"])
    schedule = sorted({k for r in attention["rows"] for k in r.get("schedule") or []})
    caption = (
        "Ragged paged attention, one V2-Lite layer (`ragged_paged_attention` jitted, impl "
        f"None{', the jnp path beside it' if beside else ''}"
        f"{'; host schedule: ' + ', '.join(schedule) if schedule else ''}; 16 heads, c_kv 512 "
        f"bf16 + k_pe 64 fp32, page {attention['page_size']}); copy bandwidth measured in the "
        f"same run: {bw / 1e9:.0f} GB/s. Row 0 error: against float64 numpy, relative to the "
        "output's largest value."
    )
    return section(caption, header, rows, "lrrlrrrr")


def _edit(edit: dict) -> list[str]:
    cfg = edit["config"]
    note = f" ({cfg['layers_note']})" if cfg.get("layers_note") else ""
    splice = _path((edit.get("splice") or {}).get("kernel"))
    rows = [
        [str(r["downstream"]), r.get("splice_path", splice), r.get("step_path", "—")]
        + [_ms(r["amortize_s"]), _ms(r["forget_s"]), _num(r["forget_over_amortize"], ".3g", "x")]
        for r in edit["rows"]
    ]
    caption = (
        f"AMORTIZE vs FORGET (`apply_directive`; {cfg['layers']} of "
        f"{cfg['full_layers']} layers{note}; prefix {cfg['prefix']}, span {cfg['span']} -> "
        f"stub {cfg['stub']}; splice path: the splice's kernel, step path: the model step's):"
    )
    header = ["downstream", "splice path", "step path", "AMORTIZE", "FORGET", "FORGET / AMORTIZE"]
    return section(caption, header, rows, "rllrrr")


def _model(model: dict, hf: dict | None) -> list[str]:
    cfg, peaks = model["config"], model["peaks"]
    hf_cfg, hf_dev = (hf or {}).get("config", {}), (hf or {}).get("device", {})
    header = ["kind", "size", "path", "ours tok/s", "HF tok/s", "floor tok/s", "ours / HF"]
    header += ["time / floor"]
    rows = [
        [r["kind"], str(r["size"]), r.get("path", "—")]
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
        f"Path: the kernels our step's programs call. "
        f"HF: transformers {hf_dev.get('transformers', '?')} on {hf_dev.get('name', '?')}, "
        f"attention `{hf_cfg.get('attn_implementation')}`, experts "
        f"`{hf_cfg.get('experts_implementation')}`{note}."
    )
    return section(caption, header, rows, "lrlrrrrr")


def _value(t: dict) -> str:
    unit, v = t.get("unit"), t.get("value")
    if v is None:
        return "—"
    if unit == "fraction":
        return f"{v:.1%}"
    if unit == "ms":
        return f"{v:.3g} ms"
    if unit == "x":
        return f"{v:.2f}x"
    return f"{v:.2f}"


def _targets(targets: list[dict]) -> list[str]:
    met = {True: "met", False: "**not met**", None: "not measured"}
    rows = [[t["target"], _value(t), met[t.get("met")]] for t in targets]
    issue = " (issue 49)" if all("unit" in t for t in targets) else ""  # older runs: issue 29's
    return ["", f"Targets{issue}:", "", *table(["target", "measured", "met"], rows)]


def render(out: str) -> str:
    summary = _load(out, "summary") or {}
    lines = _header(summary, _load(out, "env"))
    for name, render_part in (("splice", _splice), ("attention", _attention)):
        part = _load(out, name)
        if part and part.get("rows"):
            lines += render_part(part)
    model = _load(out, "model")
    if model and model.get("rows"):
        lines += _model(model, _load(out, "hf"))
    edit = _load(out, "edit")
    if edit and edit.get("rows"):
        lines += _edit(edit)
    kernels = _load(out, "kernels")
    if kernels and "counts" in kernels:
        lines += _kernels(kernels)
    if summary.get("targets"):
        lines += _targets(summary["targets"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--out", dest="file", default=None, help="write here (default: stdout)")
    args = ap.parse_args(argv)
    text = render(args.out)
    if args.file is None:
        print(text, end="")
        return
    tmp = f"{args.file}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, args.file)


if __name__ == "__main__":
    main()
