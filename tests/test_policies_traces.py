"""Policies (each parameter) and traces (format, synthetic generator)."""

from __future__ import annotations

import json

import pytest

from benchmarks import traces
from serve import policies
from serve.policies import STUB, ClearToolUses, Truncate


def conv(n_tools: int, words: int = 50, names=None):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    for t in range(n_tools):
        name = (names or ["read_file"])[t % len(names or ["read_file"])]
        msgs.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": f"c{t}",
                        "type": "function",
                        "function": {"name": name, "arguments": '{"arg": "x"}'},
                    }
                ],
            }
        )
        msgs.append(
            {
                "role": "tool",
                "tool_call_id": f"c{t}",
                "name": name,
                "content": " ".join(["word"] * words),
            }
        )
    return msgs


def tool_contents(msgs):
    return [m["content"] for m in msgs if m["role"] == "tool"]


def test_truncate_keeps_the_last_n_tool_turns():
    m = conv(5)
    out = Truncate(keep=2).apply("s", m)
    assert tool_contents(out)[:3] == [STUB] * 3 and STUB not in tool_contents(out)[3:]
    assert tool_contents(m)[0] != STUB  # the input is not modified
    assert tool_contents(Truncate(keep=0).apply("s", m)) == [STUB] * 5
    assert tool_contents(Truncate(keep=9).apply("s", m)) == tool_contents(m)
    with pytest.raises(ValueError):
        Truncate(keep=-1)


def test_clear_tool_uses_trigger_keep_and_state():
    # 4 tool outputs of 50 words (~250 chars, ~63 tokens each at 4 chars/token)
    p = ClearToolUses(trigger_input_tokens=1000, keep=1)
    assert STUB not in tool_contents(p.apply("s", conv(4)))  # below the trigger
    out = p.apply("s", conv(20))  # above: all but the last one cleared
    assert tool_contents(out)[:19] == [STUB] * 19 and tool_contents(out)[19] != STUB
    # later, shorter history (below the trigger): what was cleared stays cleared
    assert tool_contents(p.apply("s", conv(20)))[:19] == [STUB] * 19
    assert STUB not in tool_contents(p.apply("other", conv(4)))  # state is per session
    q = ClearToolUses(trigger_input_tokens=None, trigger_tool_uses=3, keep=2)
    assert STUB not in tool_contents(q.apply("s", conv(2)))
    assert tool_contents(q.apply("s", conv(3))) == [
        STUB,
        tool_contents(conv(3))[1],
        tool_contents(conv(3))[2],
    ]
    with pytest.raises(ValueError):
        ClearToolUses(trigger_input_tokens=None, trigger_tool_uses=None)


def test_clear_at_least_excluded_tools_and_inputs():
    big = ClearToolUses(trigger_tool_uses=1, keep=1, clear_at_least=10_000)
    assert STUB not in tool_contents(big.apply("s", conv(4)))  # would clear too little
    ex = ClearToolUses(trigger_tool_uses=1, keep=0, exclude_tools=("run_tests",))
    out = ex.apply("s", conv(4, names=["read_file", "run_tests"]))
    assert [c == STUB for c in tool_contents(out)] == [True, False, True, False]
    inputs = ClearToolUses(trigger_tool_uses=1, keep=1, clear_tool_inputs=True)
    out = inputs.apply("s", conv(3))
    args = [m["tool_calls"][0]["function"]["arguments"] for m in out if m.get("tool_calls")]
    assert args == ["{}", "{}", '{"arg": "x"}']
    assert policies.make("truncate", keep=3).keep == 3
    with pytest.raises(ValueError, match="unknown policy"):
        policies.make("lru")


def test_synthetic_traces_and_jsonl_round_trip(tmp_path):
    a = traces.synthetic(sessions=3, turns=4, tool_words=100, seed=5)
    assert a == traces.synthetic(sessions=3, turns=4, tool_words=100, seed=5)  # seeded
    assert a != traces.synthetic(sessions=3, turns=4, tool_words=100, seed=6)
    for t in a:
        assert len(t["steps"]) == 4
        for s0, s1 in zip(t["steps"], t["steps"][1:], strict=False):
            assert s1["messages"][: len(s0["messages"])] == s0["messages"]  # steps grow
        words = [
            len(m["content"].split()) for m in t["steps"][-1]["messages"] if m["role"] == "tool"
        ]
        assert all(50 <= w <= 150 for w in words)
    path = tmp_path / "t.jsonl"
    traces.write(path, a)
    assert list(traces.read(path)) == a
    assert len(list(traces.read(path, limit=2))) == 2
    path.write_text(json.dumps({"id": "x", "steps": [{"nope": 1}]}) + "\n")
    with pytest.raises(ValueError, match="messages"):
        list(traces.read(path))


@pytest.mark.parametrize("category", ["base", "long_context"])
def test_bfcl_conversations_become_traces_with_executed_tool_outputs(category):
    ts = traces.bfcl(category, limit=3)
    assert [t["id"] for t in ts] == [f"multi_turn_{category}_{i}" for i in range(3)]
    first = ts[0]
    users = [m for m in first["steps"][-1]["messages"] if m["role"] == "user"]
    assert len(users) == 4  # multi_turn_*_0 has four user turns
    calls = [m for m in first["steps"][-1]["messages"] if m.get("tool_calls")]
    outputs = [m for m in first["steps"][-1]["messages"] if m["role"] == "tool"]
    assert len(calls) == len(outputs) > 0
    # executing the ground truth on the shipped file-system back-end: `cd` then `mkdir`...
    assert calls[0]["tool_calls"][0]["function"]["name"] == "cd"
    assert json.loads(outputs[0]["content"]) == {"current_working_directory": "document"}
    for s0, s1 in zip(first["steps"], first["steps"][1:], strict=False):
        assert s1["messages"][: len(s0["messages"])] == s0["messages"]
    assert first["steps"][0]["tools"] and "name" in first["steps"][0]["tools"][0]["function"]
    with pytest.raises(ValueError, match="category"):
        traces.bfcl("nope")
