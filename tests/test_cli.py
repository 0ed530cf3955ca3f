"""`python -m serve` (what `make run` runs): the scripted conversation on the embedded default,
and as real text with SmolLM2 (`--model smollm2`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from serve import __main__ as cli


def test_cli_runs_the_scripted_conversation(tmp_path, capsys):
    cli.main(
        [
            "--root",
            str(tmp_path),
            "--sessions",
            "2",
            "--turns",
            "4",
            "--max-new",
            "2",
            "--no-warmup",
            "--compile-cache",
            "off",  # in this process: the cache is tested in its own processes below
        ]
    )
    out = capsys.readouterr().out
    assert (tmp_path / "deepseek_v3" / "model.safetensors").is_file()
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 8  # 2 sessions x 4 turns
    for row in rows:
        prompt, reused, spliced, prefilled = (int(x) for x in row[3:7])
        assert reused + spliced + prefilled == prompt
    edits = [row[2] for row in rows]
    assert "amortize" in edits and "forget" in edits
    assert any(int(row[4]) > 0 for row in rows if row[1] == "0")  # the shared system prompt


def test_a_second_run_loads_its_programs_from_the_compile_cache(tmp_path):
    """The CLI keeps compiled programs on disk: a second process finds every program it needs
    there and writes none (the first one wrote them all)."""
    cache = tmp_path / "cache"
    args = ["--root", str(tmp_path / "ckpt"), "--sessions", "2", "--turns", "2"]
    args += ["--max-new", "2", "--no-warmup", "--compile-cache", str(cache)]
    root = Path(__file__).resolve().parents[1]

    def run():
        subprocess.run([sys.executable, "-m", "serve", *args], cwd=root, check=True, timeout=600)
        return sorted(p.name for p in cache.rglob("*") if p.is_file())

    first = run()
    assert len(first) >= 5  # the steps, the directive steps, sampling
    assert run() == first


def test_cli_runs_real_text_with_smollm2(request, tmp_path):
    """`--model smollm2`: the real model and tokenizer, one session of two turns; the table
    shows decoded text and the second turn's tool-output stub (AMORTIZE) reuses and splices.
    Compiled programs are kept in pytest's cache folder, so later runs skip compilation (the
    first compiles the 30-layer steps: about a minute on two CPU cores)."""
    store = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    cache = store.mkdir("leyline_xla") if store is not None else tmp_path
    args = ["--model", "smollm2", "--sessions", "1", "--turns", "2", "--max-new", "4"]
    args += ["--num-pages", "32", "--compile-cache", str(cache)]
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "serve", *args],
        cwd=root,
        check=True,
        timeout=600,
        capture_output=True,
        text=True,
    ).stdout
    assert "chatml text, greedy, max 4 new" in out
    rows = [line.split(None, 9) for line in out.splitlines() if line.split()[:1] == ["0"]]
    assert [row[:3] for row in rows] == [["0", "0", "-"], ["0", "1", "amortize"]]
    for row in rows:
        prompt, reused, spliced, prefilled = (int(x) for x in row[3:7])
        assert reused + spliced + prefilled == prompt
        text = json.loads(row[9])  # the reply, decoded
        assert isinstance(text, str) and any(c.isalpha() for c in text)
    reused, spliced = int(rows[1][4]), int(rows[1][5])
    assert reused > 0 and spliced > 0  # before the stubbed output, and after it
