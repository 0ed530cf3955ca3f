"""The suite's summary.json: the environment, each part's status, and the targets' readings.

    python -m benchmarks.device.summary OUTDIR --part NAME:EXIT_CODE:SECONDS[:BUDGET] ...
        [--smoke] [--quick]

run.sh calls it last with every part's exit code, wall time and budget. A part's status is what
its JSON says, except: "timeout" when run.sh's timeout stopped it (its JSON keeps the rows it had
finished), "failed" when it died without saying so (a JSON still "running", or none at all:
the tail of its log is kept instead). The environment is the env part's (env.json: versions
beside the pins, the GPUs, driver and CUDA, the failed imports) over what this process reads
from package metadata; the headline fields (`date`, `gpu`, `jax`, `git`) are at the top.

Targets (issue 49; `targets`), each read at a size the run's `shapes.Sizes` names, so that
one not measured (a row skipped, a part failed) reads "not measured" rather than passing:

- decode attention at the largest context: >= 60% of the copy bandwidth at every C >= 32,
  >= 25% at C = 1;
- the splice: >= 75% of the copy bandwidth at the largest D (131k), <= 0.5 ms (27 layers) at
  the smallest (8k);
- prefill >= 1x Hugging Face's tokens/s at 2048 and 8192 tokens;
- decode at C = 32 >= 5x Hugging Face's tokens/s.

No jax or torch: versions come from package metadata, the device from the parts' JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys

from benchmarks.device.report import read_json, write_json
from benchmarks.device.shapes import Sizes, sizes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "torch", "transformers")
TIMEOUT_CODES = (124, 137)  # timeout(1): the budget ran out (TERM), or KILL after it

# Issue 49's thresholds (the readings' units: a fraction of the copy bandwidth, ms, x HF)
ATTENTION_WIDE_FRACTION = 0.60  # decode attention at the largest context, every C >= 32
ATTENTION_ONE_FRACTION = 0.25  # the same at C = 1
SPLICE_FRACTION = 0.75  # the splice at the largest D
SPLICE_MS = 0.5  # the splice at the smallest D, every layer
PREFILL_VS_HF = 1.0
DECODE_VS_HF = 5.0


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> dict | None:
    """LEYLINE_COMMIT where given (a device machine gets a copy of the working tree, whose .git
    may be absent or older than the tree), else the checkout's commit and whether it has
    changes."""
    if given := os.environ.get("LEYLINE_COMMIT"):
        return {"commit": given, "dirty": None}

    def git(*args) -> str:
        run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        return run.stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return None


def part_status(out: str, name: str, code: int, wall: float) -> tuple[dict, dict | None]:
    """(the summary's entry for a part, its JSON or None)."""
    data = read_json(os.path.join(out, f"{name}.json"))
    status = data["status"] if data else "failed"
    if code in TIMEOUT_CODES:
        status = "timeout"
    elif status == "running" or (code != 0 and status == "ok"):
        status = "failed"
    error = data.get("error") if data else None
    if status in ("failed", "timeout") and not error:
        log = os.path.join(out, f"{name}.log")
        if os.path.isfile(log):
            with open(log, errors="replace") as f:
                error = f.read()[-3000:]
    entry = dict(status=status, exit_code=code, wall_s=wall, file=f"{name}.json", error=error)
    return entry, data


def reading(text: str, value, threshold: float, unit: str, *, at_most: bool = False) -> dict:
    """One target's reading: `met` True / False, or None where `value` is None (not measured).
    `unit`: "fraction" (of the copy bandwidth), "ms", or "x" (times Hugging Face's)."""
    if value is None:
        met = None
    else:
        met = value <= threshold if at_most else value >= threshold
    op = "<=" if at_most else ">="
    return dict(target=text, value=value, unit=unit, threshold=threshold, op=op, met=met)


def _rows(parts: dict, name: str, **match) -> list[dict]:
    rows = (parts.get(name) or {}).get("rows") or []
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _one(rows: list[dict], key: str):
    return rows[0].get(key) if rows else None


def targets(parts: dict, sz: Sizes) -> list[dict]:
    """Issue 49's targets, read off the parts' rows of the default path (impl None) at the sizes
    `sz` names (module docstring); each reading says met, not met, or not measured."""
    out = []
    ctx = max(sz.attention_contexts)
    wide = [c for c in sz.attention_batches if c >= sz.attention_wide]
    for c, at_least in [(1, ATTENTION_ONE_FRACTION)] + [(c, ATTENTION_WIDE_FRACTION) for c in wide]:
        rows = _rows(parts, "attention", kind="decode", impl=None, context=ctx, batch=c)
        text = f"decode attention, {ctx} context, C = {c}: >= {at_least:.0%} of copy bandwidth"
        out.append(reading(text, _one(rows, "fraction_of_copy_bw"), at_least, "fraction"))
    big, small = max(sz.splice_downstream), min(sz.splice_downstream)
    layers = sz.hf["num_hidden_layers"]
    rows = _rows(parts, "splice", impl=None, downstream=big)
    text = f"splice, {big} downstream tokens: >= {SPLICE_FRACTION:.0%} of copy bandwidth"
    out.append(reading(text, _one(rows, "fraction_of_copy_bw"), SPLICE_FRACTION, "fraction"))
    rows = _rows(parts, "splice", impl=None, downstream=small)
    ms = None if _one(rows, "splice_s") is None else rows[0]["splice_s"] * 1e3
    text = f"splice, {small} downstream tokens, {layers} layers: <= {SPLICE_MS} ms"
    out.append(reading(text, ms, SPLICE_MS, "ms", at_most=True))
    for t in sz.prefill_targets:
        rows = _rows(parts, "model", kind="prefill", size=t)
        text = f"prefill, {t} tokens: >= {PREFILL_VS_HF:g}x Hugging Face tok/s"
        out.append(reading(text, _one(rows, "speedup_vs_hf"), PREFILL_VS_HF, "x"))
    c = sz.decode_batches[0]
    rows = _rows(parts, "model", kind="decode", size=c)
    text = f"decode, C = {c}: >= {DECODE_VS_HF:g}x Hugging Face tok/s"
    out.append(reading(text, _one(rows, "speedup_vs_hf"), DECODE_VS_HF, "x"))
    return out


def overall(statuses) -> str:
    """Every part ok: "ok"; each ok or short of rows it skipped to stay in time: "partial"."""
    statuses = set(statuses)
    return "ok" if statuses <= {"ok"} else "partial" if statuses <= {"ok", "partial"} else "failed"


def environment(parts: dict) -> dict:
    """This process's view (Python, packages) under the env part's (env.json), and the device
    the parts' jax saw."""
    env = parts.get("env") or {}
    device = next(
        (p["device"] for p in parts.values() if "platform" in (p.get("device") or {})), None
    )
    keep = ("pins", "cuda_dists", "nvidia_smi", "jax", "torch", "imports", "problems", "report")
    return dict(
        python=sys.version.split()[0],
        platform=platform.platform(),
        packages={name: _version(name) for name in PACKAGES},
        device=device,
        hf_device=(parts.get("hf") or {}).get("device"),
        env_status=env.get("status"),
        **{k: env.get(k) for k in keep},
    )


def headline(env: dict) -> dict:
    """The GPU (name x count, from nvidia-smi, else what jax saw) and jax's version."""
    gpus = ((env.get("nvidia_smi") or {}).get("gpus")) or []
    device = env.get("device") or env.get("jax") or {}
    if gpus:
        gpu = f"{gpus[0].get('name')} x{len(gpus)}"
    elif device.get("device_kind"):
        gpu = f"{device['device_kind']} x{device.get('device_count', '?')} ({device['platform']})"
    else:
        gpu = None
    return dict(gpu=gpu, jax=env["packages"].get("jax"), jaxlib=env["packages"].get("jaxlib"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--part", action="append", default=[], help="NAME:EXIT_CODE:SECONDS[:BUDGET]")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    entries, parts = {}, {}
    for spec in args.part:
        name, code, wall, *budget = spec.split(":")
        entries[name], data = part_status(args.out, name, int(code), float(wall))
        entries[name]["budget_s"] = float(budget[0]) if budget else None
        if data:
            parts[name] = data
    sz = sizes(args.smoke, args.quick)
    env = environment(parts)
    mode = ("smoke" if args.smoke else "full") + (", quick" if args.quick else "")
    summary = dict(
        suite="leyline-jax device suite",
        mode=mode,
        smoke=args.smoke,
        quick=args.quick,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        git=git_commit(),
        **headline(env),
        environment=env,
        imports_failed=(env.get("imports") or {}).get("failed", []),
        parts_blocked=(env.get("imports") or {}).get("parts_blocked", {}),
        total_s=sum(e["wall_s"] for e in entries.values()),
        status=overall(e["status"] for e in entries.values()),
        parts=entries,
        sizes={k: v for k, v in dataclasses.asdict(sz).items() if k != "hf"},
        targets=targets(parts, sz),
    )
    write_json(os.path.join(args.out, "summary.json"), summary)
    commit = (summary["git"] or {}).get("commit")
    print(f"{summary['date']}  {summary['gpu']}  jax {summary['jax']}  commit {commit}  ({mode})")
    for bad in summary["imports_failed"]:
        print(f"IMPORT FAILED: {bad}")
    for name, e in entries.items():
        budget = f" of {e['budget_s']:.0f}" if e["budget_s"] is not None else ""
        print(f"{name:9s} {e['status']:8s} {e['wall_s']:7.1f} s{budget}")
    for t in summary["targets"]:
        met = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
        print(f"target {met:12s} {t['target']}: {t['value']}")
    print(f"summary: {summary['status']} ({summary['total_s']:.0f} s)")
    return 0 if summary["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
