"""A small replay through the engine: counters add up per step, the arms behave as defined,
and the command line writes its three files."""

from __future__ import annotations

import json

import pytest

import leyline_jax as ll
from benchmarks import replay, traces
from benchmarks.replay import __main__ as cli
from serve.chat import ChatTokenizer


@pytest.fixture(scope="module")
def setup(np_ckpt):
    model = ll.load_model(np_ckpt("deepseek_v3"))
    trace_list = traces.synthetic(sessions=2, turns=4, tool_words=60, seed=3)
    tok = ChatTokenizer()
    return model, trace_list, tok


@pytest.mark.parametrize("policy", [None, "truncate"])
def test_counters_add_up_per_step(setup, policy):
    model, trace_list, tok = setup
    kw = {"keep": 2} if policy else {}  # a whole tool turn stays between an edit and the end
    work = replay.prompts(trace_list, tok, model.config.vocab_size, policy, kw)
    rows = {}
    for arm in ("radix", "amortize", "forget", "radix_move"):
        row, records = replay.run_arm(model, work, arm, 2, max_new=2, page_size=16)
        assert len(records) == 8
        for r in records:
            assert r["reused"] + r["spliced"] + r["prefilled"] == r["prompt"]
            assert r["prompt"] == len(work[r["trace"]][r["step"]])  # the real prompt size
            assert 0 < r["ttft_s"] <= r["latency_s"]
        assert row["prompt_tokens"] == sum(len(s) for w in work for s in w)
        assert 0 <= row["hit_rate"] <= 1
        rows[arm] = row
    assert rows["radix"]["spliced_tokens"] == rows["forget"]["spliced_tokens"] == 0
    if policy:  # the policy edits the middle: only AMORTIZE keeps what follows the edit
        assert rows["amortize"]["spliced_tokens"] > 0
        assert rows["amortize"]["hit_rate"] > rows["radix"]["hit_rate"]
        # ... or MOVE, for a new request of the trace's lineage: the shifted history's pages
        assert rows["radix_move"]["moved_tokens"] > 0
        assert rows["radix_move"]["spliced_tokens"] == rows["radix_move"]["moved_tokens"]
    else:  # nothing moves: every page of the re-sent history is an exact prefix hit
        assert rows["radix_move"]["moved_tokens"] == 0
        assert rows["radix_move"]["hit_rate"] == rows["radix"]["hit_rate"]


def test_scratch_arm_on_reasoning_traces(setup):
    """Replies with reasoning (R1's rule: the next prompt re-sends them without it): SCRATCH
    splices each reply's block out when its step ends, so the next prompt extends the session
    and is reused as cached (nothing left for edit detection to splice); radix reuses only up
    to the block."""
    model, _, tok = setup
    trace_list = traces.synthetic(sessions=2, turns=3, tool_words=40, seed=3, reasoning_words=40)
    work = replay.prompts(trace_list, tok, model.config.vocab_size, None, {})
    work, marks = replay.with_replies(trace_list, tok, work, model.config.vocab_size)
    blocks = sum(e - s for steps in marks for m in steps for s, e in m)
    assert blocks > 0 and all(not m[-1] for m in marks)  # the last step has no reply
    rows = {}
    for arm in ("radix", "amortize", "scratch"):
        rows[arm], records = replay.run_arm(
            model, work, arm, 2, max_new=2, page_size=16, scratch=marks
        )
        for r in records:
            assert r["reused"] + r["spliced"] + r["prefilled"] == r["prompt"]
    assert rows["scratch"]["scratch_tokens"] == blocks
    assert rows["amortize"]["scratch_tokens"] == rows["radix"]["scratch_tokens"] == 0
    assert rows["amortize"]["spliced_tokens"] > rows["scratch"]["spliced_tokens"]
    assert rows["scratch"]["hit_rate"] >= rows["amortize"]["hit_rate"] > rows["radix"]["hit_rate"]


def test_command_line_writes_results(setup, tmp_path):
    _, trace_list, _ = setup
    path = tmp_path / "t.jsonl"
    traces.write(path, trace_list)
    rows = cli.main(
        [
            "--traces",
            str(path),
            "--arms",
            "radix,amortize",
            "--concurrency",
            "1,2",
            "--policy",
            "truncate",
            "--keep",
            "2",
            "--limit",
            "2",
            "--max-new",
            "2",
            "--warmup",
            "compile",
            "--compile-cache",
            "off",  # nothing written outside tmp_path (the cache has its own test)
            "--out",
            str(tmp_path / "out"),
            "--root",
            str(tmp_path / "ckpt"),
        ]
    )
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved == rows and len(rows) == 4
    # one engine size for every concurrency: the compile pass covered every shape both runs met
    # (with an engine sized per concurrency, C = 1 met shapes of its own)
    assert [r["compiles"] for r in rows] == [0, 0, 0, 0]
    for r in rows:
        assert set(r) >= {
            "arm",
            "concurrency",
            "hit_rate",
            "prompt_tokens",
            "reused_tokens",
            "spliced_tokens",
            "prefilled_tokens",
            "latency_p50_s",
            "latency_p95_s",
            "ttft_p50_s",
        }
        assert (
            r["reused_tokens"] + r["spliced_tokens"] + r["prefilled_tokens"] == r["prompt_tokens"]
        )
    assert (tmp_path / "out" / "results.md").read_text().count("\n") == 6
    assert (tmp_path / "out" / "results.png").stat().st_size > 1000


def test_seeded_sample():
    items = list(range(100))
    a = replay.seeded_sample(items, 10, seed=0)
    assert a == replay.seeded_sample(items, 10, seed=0) == sorted(a) and len(set(a)) == 10
    assert a != replay.seeded_sample(items, 10, seed=1) and a != items[:10]
    assert replay.seeded_sample(items, 200, seed=0) == items
