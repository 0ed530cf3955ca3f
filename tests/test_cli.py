"""`python -m serve` (what `make run` runs): the scripted conversation on the embedded default."""

from __future__ import annotations

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
