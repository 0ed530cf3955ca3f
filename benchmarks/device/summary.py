"""The suite's summary.json: the environment, each part's status, and the targets' readings.

    python -m benchmarks.device.summary OUTDIR --part NAME:EXIT_CODE:SECONDS ... [--smoke]

run.sh calls it last with every part's exit code and wall time. A part's status is what its
JSON says, except: "timeout" when run.sh's timeout stopped it (its JSON keeps the rows it had
finished), "failed" when it died without saying so (a JSON still "running", or none at all:
the tail of its log is kept instead). No jax or torch: versions come from package metadata,
the device from the parts' JSON.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys

from benchmarks.device.report import read_json, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "torch", "transformers")
TIMEOUT_CODES = (124, 137)  # timeout(1): the budget ran out (TERM), or KILL after it


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


def _target(text: str, value, at_least: float) -> dict:
    return dict(target=text, value=value, met=value is not None and value >= at_least)


def targets(parts: dict) -> list[dict]:
    """The issue's targets, read off the largest size each part measured."""
    out = []
    splice = parts.get("splice")
    rows = [r for r in (splice or {}).get("rows", []) if r.get("impl") is None]  # the default
    if rows:
        r = max(rows, key=lambda r: r["downstream"])
        text = f"splice bandwidth >= 0.7 x copy bandwidth (D = {r['downstream']})"
        out.append(_target(text, r["fraction_of_copy_bw"], 0.7))
    attention = [r for r in parts.get("attention", {}).get("rows", []) if r["impl"] is None]
    decode = [r for r in attention if r["kind"] == "decode"]
    if decode:
        r = max(decode, key=lambda r: (r["context"], r["batch"]))
        text = (
            f"decode attention >= 0.5 x copy bandwidth ({r['context']} context, C = {r['batch']})"
        )
        out.append(_target(text, r["fraction_of_copy_bw"], 0.5))
    decode = [r for r in parts.get("model", {}).get("rows", []) if r["kind"] == "decode"]
    if decode:
        r = max(decode, key=lambda r: r["size"])
        text = f"decode tokens/s >= 3 x Hugging Face (C = {r['size']})"
        out.append(_target(text, r["speedup_vs_hf"], 3.0))
    return out


def overall(statuses) -> str:
    """Every part ok: "ok"; each ok or short of rows it skipped to stay in time: "partial"."""
    statuses = set(statuses)
    return "ok" if statuses <= {"ok"} else "partial" if statuses <= {"ok", "partial"} else "failed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--part", action="append", default=[], help="NAME:EXIT_CODE:SECONDS")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    entries, parts = {}, {}
    for spec in args.part:
        name, code, wall = spec.split(":")
        entries[name], data = part_status(args.out, name, int(code), float(wall))
        if data:
            parts[name] = data
    device = next((p["device"] for p in parts.values() if "platform" in p.get("device", {})), None)
    summary = dict(
        suite="leyline-jax device suite",
        smoke=args.smoke,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        git=git_commit(),
        environment=dict(
            python=sys.version.split()[0],
            platform=platform.platform(),
            packages={name: _version(name) for name in PACKAGES},
            device=device,
            hf_device=parts.get("hf", {}).get("device"),
        ),
        total_s=sum(e["wall_s"] for e in entries.values()),
        status=overall(e["status"] for e in entries.values()),
        parts=entries,
        targets=targets(parts),
    )
    write_json(os.path.join(args.out, "summary.json"), summary)
    for name, e in entries.items():
        print(f"{name:8s} {e['status']:8s} {e['wall_s']:7.1f} s")
    print(f"summary: {summary['status']} ({summary['total_s']:.0f} s)")
    return 0 if summary["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
