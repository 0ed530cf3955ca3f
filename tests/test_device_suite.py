"""The device suite's smoke run: `benchmarks/device/run.sh OUTDIR --smoke`, every part end to end
on CPU at toy sizes, as the GPU run would go (the environment first, one process per part, then
the summary and tables.md); the targets' readings (met, not met, not measured) on made-up
results; the rows `--quick` keeps; a failed import named in env.json, the summary and the
tables."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks.device import env, summary, to_markdown
from benchmarks.device.report import write_json
from benchmarks.device.shapes import FULL, SMOKE, quick

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = ("env", "splice", "attention", "hf", "model", "edit", "kernels")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def run_suite(out: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks/device/run.sh"), str(out), *flags],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=400,
    )


def load_parts(out: pathlib.Path, summary_: dict) -> dict:
    """Every part's JSON, each checked ok in its file and in the summary."""
    parts = {}
    for name in PARTS:
        parts[name] = json.loads((out / f"{name}.json").read_text())
        assert parts[name]["status"] == "ok", parts[name]["error"]
        assert summary_["parts"][name]["status"] == "ok"
        assert positive(summary_["parts"][name]["wall_s"])
        assert positive(summary_["parts"][name]["budget_s"])
    return parts


def check_environment(out: pathlib.Path, run: subprocess.CompletedProcess, summary_: dict):
    """env.json ran first, found every import, and its report reached the output at once."""
    e = json.loads((out / "env.json").read_text())
    assert e["status"] == "ok" and e["imports"]["failed"] == [] and not e["problems"]
    assert e["jax"]["platform"] == "cpu" and e["jax"]["jit_ok"]
    assert e["pins"]["packages"]["jax"]["installed"] == summary_["jax"]
    assert list(summary_["parts"])[0] == "env" and list(summary_["parts"])[-1] == "kernels"
    assert run.stdout.index("imports: ") < run.stdout.index("splice: exit")
    assert summary_["imports_failed"] == [] and summary_["date"] and summary_["gpu"]
    assert summary_["git"]["commit"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    """The smoke run: (OUTDIR, the finished run). `--quick` runs the same parts at the rows
    `shapes.quick` keeps (test_quick_keeps_every_target_row), so it is not run end to end here
    (another 45 s of the suite on this machine's two cores)."""
    out = tmp_path_factory.mktemp("smoke")
    return out, run_suite(out, "--smoke")


def test_smoke_writes_every_part(smoke):
    out, run = smoke
    assert run.returncode == 0, run.stdout + run.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "ok" and s["environment"]["device"]["platform"] == "cpu"
    assert s["mode"] == "smoke"
    parts = load_parts(out, s)
    check_environment(out, run, s)

    k = parts["kernels"]
    assert k["counts"]["failed"] == k["counts"]["error"] == 0 and not k["collect_errors"]
    # on CPU tests/conftest.py skips every accelerator test it collects
    assert k["counts"]["passed"] == 0 and k["counts"]["skipped"] > 0

    default = [r for r in parts["splice"]["rows"] if r["impl"] is None]  # jnp beside: a device's
    assert [r["downstream"] for r in default] == [256, 1024]
    for r in parts["splice"]["rows"]:
        assert positive(r["splice_s"]) and positive(r["fraction_of_copy_bw"])

    assert [r["downstream"] for r in parts["edit"]["rows"]] == [130, 170]
    for r in parts["edit"]["rows"]:
        assert positive(r["amortize_s"]) and positive(r["forget_s"])
        assert positive(r["forget_over_amortize"])
        assert r["splice_path"] == r["step_path"] == "jnp"  # read from the lowered programs

    hf = {(r["kind"], r["size"]) for r in parts["hf"]["rows"]}
    rows = parts["model"]["rows"]
    assert (
        {(r["kind"], r["size"]) for r in rows}
        == hf
        == {("prefill", 40), ("prefill", 52), ("prefill", 64), ("decode", 4), ("decode", 3)}
    )
    for r in rows:
        for key in ("time_s", "ours_tok_s", "hf_tok_s", "floor_tok_s", "speedup_vs_hf"):
            assert positive(r[key]), (key, r)
        assert r["ours_over_floor"] > 1, r  # nothing runs faster than its floor
        assert r["path"] == "jnp" and r["programs"], r  # the step's programs ran and lowered

    cases = [
        (r["kind"], r["batch"], r["context"], r["queries"]) for r in parts["attention"]["rows"]
    ]
    assert cases == [("decode", 1, 64, 1), ("decode", 2, 64, 1), ("prefill", 1, 64, 16)]
    for r in parts["attention"]["rows"]:  # on CPU: the jnp path alone, exact to float64's 1e-5
        assert r["kernel"] is None and positive(r["step_s"]) and r["error_row0"] < 1e-5

    # issue 49's targets at the smoke's sizes: C = 1 and 2 (for >= 32), the splice twice,
    # prefill at two lengths, decode at the first batch; every one measured
    assert len(s["targets"]) == 7
    assert all(positive(t["value"]) and t["met"] in (True, False) for t in s["targets"])

    table = (out / "tables.md").read_text()
    assert "| decode | 4 | jnp |" in table and "FORGET / AMORTIZE" in table
    assert "| decode (1 q) | 2 | 64 | jnp |" in table
    assert "Targets (issue 49)" in table and "not measured" not in table
    assert "Every piece the suite needs imported" in table and "env ok" in table
    printed = subprocess.run(
        [sys.executable, "-m", "benchmarks.device.to_markdown", str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == table


def test_quick_keeps_every_target_row():
    q = quick(FULL)
    assert q.attention_contexts == (32768,) and q.attention_batches == (1, 32, 128)
    assert q.splice_downstream == (8192, 131072) and q.edit_downstream == (8192,)
    assert q.prefill_lengths == (2048, 8192) and q.decode_batches == (32,)
    assert not q.beside_jnp and q.attention_chunk == 0
    sz = quick(SMOKE)
    assert (sz.decode_steps, sz.decode_warmup, sz.repeats) == (3, 1, 2)


def made_up_parts(fraction: float, splice_ms: float, prefill_x: float, decode_x: float) -> dict:
    """Parts' rows at every size FULL reads its targets at (and a jnp row beside, ignored)."""
    attention = [
        dict(kind="decode", impl=impl, context=32768, batch=c, fraction_of_copy_bw=fraction)
        for c in (1, 32, 128)
        for impl in (None, "jnp")
    ]
    splice = [
        dict(impl=None, downstream=d, fraction_of_copy_bw=fraction, splice_s=splice_ms / 1e3)
        for d in (8192, 131072)
    ]
    model = [dict(kind="prefill", size=t, speedup_vs_hf=prefill_x) for t in (2048, 8192)]
    model.append(dict(kind="decode", size=32, speedup_vs_hf=decode_x))
    return dict(attention=dict(rows=attention), splice=dict(rows=splice), model=dict(rows=model))


def test_targets_read_met_not_met_and_not_measured(tmp_path):
    below = summary.targets(made_up_parts(0.2, 0.6, 0.9, 4.9), FULL)
    assert len(below) == 8 and [t["met"] for t in below] == [False] * 8
    above = summary.targets(made_up_parts(0.8, 0.4, 1.1, 5.1), FULL)
    assert [t["met"] for t in above] == [True] * 8
    one = summary.targets(made_up_parts(0.3, 0.4, 1.1, 5.1), FULL)  # 30%: C = 1 only
    assert [t["met"] for t in one[:3]] == [True, False, False]
    assert one[1]["target"].startswith("decode attention, 32768 context, C = 32: >= 60%")
    parts = made_up_parts(0.8, 0.4, 1.1, 5.1)
    del parts["model"]  # a part that failed: its targets are not measured, not passed
    missing = summary.targets(parts, FULL)
    assert [t["met"] for t in missing[-3:]] == [None] * 3
    assert [t["value"] for t in missing[-3:]] == [None] * 3

    write_json(str(tmp_path / "summary.json"), dict(targets=below + missing[-1:]))
    table = to_markdown.render(str(tmp_path))
    assert "| splice, 131072 downstream tokens: >= 75% of copy bandwidth | 20.0% |" in table
    assert "| splice, 8192 downstream tokens, 27 layers: <= 0.5 ms | 0.6 ms |" in table
    assert "| decode, C = 32: >= 5x Hugging Face tok/s | 4.90x | **not met** |" in table
    assert "| decode, C = 32: >= 5x Hugging Face tok/s | — | not measured |" in table
    assert table.count("**not met**") == 8


def test_a_failed_import_is_named_in_env_summary_and_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(env, "PIECES", ("json", "leyline_no_such_module", "os:no_such_name"))
    monkeypatch.setattr(env, "PART_NEEDS", {"splice": ("leyline_no_such_module",), "hf": ("os",)})
    found = env.imports()
    assert found["failed"] == ["leyline_no_such_module", "os:no_such_name"]
    assert found["parts_blocked"] == {"splice": ["leyline_no_such_module"]}
    assert "ModuleNotFoundError" in found["checked"][1]["error"]
    assert "AttributeError" in found["checked"][2]["error"]

    problems = [f"import failed: {m}" for m in found["failed"]]
    write_json(str(tmp_path / "env.json"), dict(status="failed", imports=found, problems=problems))
    code = summary.main(
        [str(tmp_path), "--smoke", "--part", "env:1:2.5:30", "--part", "splice:1:1.0:30"]
    )
    assert code == 1
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["imports_failed"] == found["failed"] and s["parts"]["splice"]["status"] == "failed"
    assert s["parts_blocked"] == {"splice": ["leyline_no_such_module"]}
    assert all(t["met"] is None for t in s["targets"])  # nothing measured: nothing passes
    table = to_markdown.render(str(tmp_path))
    assert "**Imports failed**: leyline_no_such_module, os:no_such_name" in table
    assert "(parts that cannot run: splice)" in table and "env failed (2 of 30 s)" in table


def test_budgets_fit_eight_and_four_minutes():
    """The full run's budgets, the 10 s its last part may take to be killed and a few seconds of
    summary stay under 8 minutes; --quick's under 4; the environment first, kernels last."""
    script = (ROOT / "benchmarks/device/run.sh").read_text()
    lines = [line.split('"')[1] for line in script.splitlines() if "parts=" in line]
    smoke, quick_, full = ([p.split(":") for p in line.split()] for line in lines)
    for parts, limit in ((full, 8 * 60), (quick_, 4 * 60)):
        assert sum(int(s) for _, s in parts) + 10 + 5 <= limit
        assert [n for n, _ in parts] == list(PARTS) == [n for n, _ in smoke]


def test_bad_arguments_are_refused(tmp_path):
    run = run_suite(tmp_path, "--fast")
    assert run.returncode == 2 and "usage" in run.stderr
    assert not (tmp_path / "summary.json").exists()
