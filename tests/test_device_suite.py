"""The device suite's smoke run: `benchmarks/device/run.sh OUTDIR --smoke`, every part end to end
on CPU at toy sizes, as the GPU run would go (one process per part, then the summary)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = ("kernels", "splice", "attention", "hf", "model", "edit")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_smoke_writes_every_part(tmp_path):
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks/device/run.sh"), str(tmp_path), "--smoke"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["environment"]["device"]["platform"] == "cpu"
    parts = {}
    for name in PARTS:
        parts[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert parts[name]["status"] == "ok", parts[name]["error"]
        assert summary["parts"][name]["status"] == "ok"
        assert positive(summary["parts"][name]["wall_s"])

    k = parts["kernels"]
    assert k["counts"]["failed"] == k["counts"]["error"] == 0 and not k["collect_errors"]
    # on CPU tests/conftest.py skips every accelerator test it collects
    assert k["counts"]["passed"] == 0

    default = [r for r in parts["splice"]["rows"] if r["impl"] is None]  # jnp beside: a device's
    assert [r["downstream"] for r in default] == [256, 1024]
    for r in parts["splice"]["rows"]:
        assert positive(r["splice_s"]) and positive(r["fraction_of_copy_bw"])

    assert [r["downstream"] for r in parts["edit"]["rows"]] == [130, 170]
    for r in parts["edit"]["rows"]:
        assert positive(r["amortize_s"]) and positive(r["forget_s"])
        assert positive(r["forget_over_amortize"])

    hf = {(r["kind"], r["size"]) for r in parts["hf"]["rows"]}
    rows = parts["model"]["rows"]
    assert (
        {(r["kind"], r["size"]) for r in rows}
        == hf
        == {
            ("prefill", 40),
            ("prefill", 52),
            ("prefill", 64),
            ("decode", 4),
            ("decode", 3),
        }
    )
    for r in rows:
        for key in ("time_s", "ours_tok_s", "hf_tok_s", "floor_tok_s", "speedup_vs_hf"):
            assert positive(r[key]), (key, r)
        assert r["ours_over_floor"] > 1, r  # nothing runs faster than its floor

    cases = [
        (r["kind"], r["batch"], r["context"], r["queries"]) for r in parts["attention"]["rows"]
    ]
    assert cases == [("decode", 1, 64, 1), ("decode", 2, 64, 1), ("prefill", 1, 64, 16)]
    for r in parts["attention"]["rows"]:  # on CPU: the jnp path alone, exact to float64's 1e-5
        assert r["kernel"] is None and positive(r["step_s"]) and r["error_row0"] < 1e-5

    assert len(summary["targets"]) == 3
    assert all(positive(t["value"]) for t in summary["targets"])
    table = subprocess.run(
        [sys.executable, "-m", "benchmarks.device.to_markdown", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| decode | 4 |" in table and "FORGET / AMORTIZE" in table
    assert "| decode (1 q) | 2 | 64 | jnp |" in table
