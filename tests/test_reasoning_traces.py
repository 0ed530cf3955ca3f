"""Traces with reasoning (`reasoning_content`) and its rendering: seeded reasoning that leaves
the rest of a trace as it was, `render` never re-sending it, and `render_reply`'s reply whose
reasoning block removed is exactly what the history re-sends, in both chat formats."""

from __future__ import annotations

import hashlib
import json

import pytest

from benchmarks import traces
from checkpoints.tiny import ensure_default_checkpoints
from serve.chat import (
    ChatTokenizer,
    close_reply,
    render,
    render_reply,
    tokenizer_for,
)
from serve.chat_formats import (
    CHATML,
    DEEPSEEK,
    THINK_CLOSE,
    THINK_OPEN,
)


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The tokenizer the replay uses by default (the embedded tiny DeepSeek-family checkpoint's:
    DeepSeek's), and SmolLM2's GGUF tokenizer with ChatML."""
    from leyline_jax import gguf

    default = ensure_default_checkpoints(tmp_path_factory.mktemp("ckpt"))["deepseek_v3"]
    out = {"deepseek": tokenizer_for(default)}
    assert out["deepseek"].format is DEEPSEEK
    try:
        out["chatml"] = ChatTokenizer.from_gguf(gguf.smollm2_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert out["chatml"].format is CHATML
    return out


def strip(trace_list):
    """The traces with every `reasoning_content` removed."""
    return [
        {
            **t,
            "steps": [
                {
                    **s,
                    "messages": [
                        {k: v for k, v in m.items() if k != "reasoning_content"}
                        for m in s["messages"]
                    ],
                }
                for s in t["steps"]
            ],
        }
        for t in trace_list
    ]


def assistants(trace_list):
    return [
        m for t in trace_list for s in t["steps"] for m in s["messages"] if m["role"] == "assistant"
    ]


# ---- traces ----------------------------------------------------------------------------------
# sha256 of `traces.write(synthetic(3, 4, 100, 5))` before reasoning existed (commit 27868d3)
SYNTHETIC_3_4_100_5 = "057558c9d07d87fb9d4f8748ec3a8093230a75d4a53cd1fe5e7e065f583c2c8e"


def test_traces_without_reasoning_are_unchanged(tmp_path):
    path = tmp_path / "t.jsonl"
    for kw in ({}, {"reasoning_words": 0}):
        traces.write(path, traces.synthetic(3, 4, 100, 5, **kw))
        assert hashlib.sha256(path.read_bytes()).hexdigest() == SYNTHETIC_3_4_100_5
    with_reasoning = traces.synthetic(3, 4, 100, 5, reasoning_words=20)
    traces.write(path, with_reasoning)
    assert hashlib.sha256(path.read_bytes()).hexdigest() != SYNTHETIC_3_4_100_5
    assert strip(with_reasoning) == traces.synthetic(3, 4, 100, 5)  # only the reasoning added


def test_synthetic_reasoning_is_seeded_sized_and_stable_across_steps():
    a = traces.synthetic(2, 4, 50, 7, reasoning_words=20)
    assert a == traces.synthetic(2, 4, 50, 7, reasoning_words=20)
    assert a == traces.add_reasoning(traces.synthetic(2, 4, 50, 7), 20, 7)  # the same way
    assert assistants(a) and all(m["reasoning_content"] for m in assistants(a))
    assert all(10 <= len(m["reasoning_content"].split()) <= 30 for m in assistants(a))
    assert all(w in traces.WORDS for m in assistants(a) for w in m["reasoning_content"].split())
    texts = {m["reasoning_content"] for m in assistants(a)}
    assert len(texts) == 8  # 2 traces x 4 turns: one text per assistant message
    for t in a:  # steps still grow: a message carries the same reasoning in every later step
        for s0, s1 in zip(t["steps"], t["steps"][1:], strict=False):
            assert s1["messages"][: len(s0["messages"])] == s0["messages"]
    other = traces.add_reasoning(traces.synthetic(2, 4, 50, 7), 20, 8)  # another seed
    assert strip(other) == strip(a) and other != a


def test_add_reasoning_to_bfcl_traces():
    base = traces.bfcl("base", limit=2)
    before = json.dumps(base)
    out = traces.add_reasoning(base, 12, seed=1)
    assert json.dumps(base) == before  # the input is not modified
    assert strip(out) == base
    msgs = assistants(out)
    assert msgs and all(6 <= len(m["reasoning_content"].split()) <= 18 for m in msgs)
    for t in out:
        for s0, s1 in zip(t["steps"], t["steps"][1:], strict=False):
            assert s1["messages"][: len(s0["messages"])] == s0["messages"]
    assert traces.add_reasoning(base, 0) == base
    with pytest.raises(ValueError, match="reasoning"):
        traces.add_reasoning(base, -1)
    # reasoning a message already carries is kept
    kept = traces.add_reasoning(out, 30, seed=2)
    assert kept == out


def test_command_line_reasoning_words(tmp_path):
    path = tmp_path / "t.jsonl"
    traces.main(["--sessions", "2", "--turns", "2", "--tool-words", "20", "--out", str(path)])
    assert list(traces.read(path)) == traces.synthetic(2, 2, 20, 0)
    args = ["--sessions", "2", "--turns", "2", "--tool-words", "20", "--reasoning-words", "8"]
    traces.main([*args, "--seed", "3", "--out", str(path)])
    assert list(traces.read(path)) == traces.synthetic(2, 2, 20, 3, reasoning_words=8)
    traces.main(["--bfcl", "base", "--limit", "1", "--reasoning-words", "5", "--out", str(path)])
    assert list(traces.read(path)) == traces.add_reasoning(traces.bfcl("base", 1), 5, 0)


def test_reply_of():
    (t,) = traces.synthetic(1, 3, 20, 0, reasoning_words=5)
    steps = [s["messages"] for s in t["steps"]]
    for s0, s1 in zip(steps, steps[1:], strict=False):
        reply = traces.reply_of(s0, s1)
        assert reply is s1[len(s0)] and reply["role"] == "assistant" and reply["tool_calls"]
    assert traces.reply_of(steps[-1], steps[-1]) is None  # nothing follows
    assert traces.reply_of(steps[1], steps[0]) is None
    (b,) = traces.bfcl("base", limit=1)
    bsteps = [s["messages"] for s in b["steps"]]
    replies = [traces.reply_of(s0, s1) for s0, s1 in zip(bsteps, bsteps[1:], strict=False)]
    assert replies[0]["tool_calls"]  # the first user turn is answered by a call
    followed_by_user = [
        s1[len(s0)]["role"] == "user" for s0, s1 in zip(bsteps, bsteps[1:], strict=False)
    ]
    assert any(followed_by_user)  # a turn's last tool output, then the next user turn: no reply
    assert [r is None for r in replies] == followed_by_user


# ---- rendering -------------------------------------------------------------------------------
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
THOUGHT = "The user wants the weather.\nI should call get_weather for Paris."
CONV = [
    {"role": "system", "content": "You are a helpful assistant with tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp_c": 18, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 18 °C and clear."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
]


def with_reasoning(messages, text=THOUGHT):
    return [{**m, "reasoning_content": text} if m["role"] == "assistant" else m for m in messages]


@pytest.mark.parametrize("fmt", ["deepseek", "chatml"])
def test_render_drops_reasoning(formats, fmt):
    tok = formats[fmt]
    for tools in (None, TOOLS):
        for gen in (True, False):
            a = render(tok, with_reasoning(CONV), tools, add_generation_prompt=gen)
            assert a == render(tok, CONV, tools, add_generation_prompt=gen)
            assert THINK_CLOSE not in tok.decode(a.tokens) and THOUGHT not in tok.decode(a.tokens)


@pytest.mark.parametrize("fmt", ["deepseek", "chatml"])
@pytest.mark.parametrize("reasoning", [False, True], ids=["plain", "reasoning"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-schemas", "schemas"])
def test_reply_without_reasoning_is_what_the_history_resends(formats, fmt, reasoning, tools):
    """For every assistant reply A after messages M (content only, a call with content, two
    calls without content; schemas or none): the generation prompt, then the reply with its
    reasoning block removed, is the rendering of M + [A] through A's end; the whole reply
    (reasoning kept) is not."""
    tok = formats[fmt]
    conv = with_reasoning(CONV) if reasoning else CONV
    seen = 0
    for n, a in enumerate(conv):
        if a["role"] != "assistant":
            continue
        seen += 1
        prompt = render(tok, conv[:n], tools).tokens
        reply = render_reply(tok, a)
        full = render(tok, conv[: n + 1], tools, add_generation_prompt=False)
        assert prompt + reply.without_reasoning == full.tokens
        assert full.spans[-1].end == len(full.tokens)  # through the message's end
        longer = render(tok, conv, tools, add_generation_prompt=False).tokens
        assert longer[: len(full.tokens)] == full.tokens  # and the next message follows
        if reasoning:
            assert reply.reasoning is not None and prompt + reply.tokens != full.tokens
        else:
            assert reply.reasoning is None and reply.without_reasoning == reply.tokens
        # the generated part ends with the stop token; close_reply adds the rest
        k = len(reply.tokens) - reply.tokens[::-1].index(tok.stop_tokens[0])
        assert close_reply(tok, reply.tokens[:k]) == reply.tokens[k:]
    assert seen == 3


@pytest.mark.parametrize("fmt", ["deepseek", "chatml"])
def test_reasoning_span_holds_the_reasoning_block(formats, fmt):
    tok = formats[fmt]
    for a in (
        {"role": "assistant", "content": "Sure.", "reasoning_content": THOUGHT},
        {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "x"},
    ):
        reply = render_reply(tok, a)
        r0, r1 = reply.reasoning
        assert r0 == 0  # the reasoning block comes first
        text = tok.decode(reply.tokens[r0:r1])
        assert text == f"{THINK_OPEN}\n{a['reasoning_content']}\n{THINK_CLOSE}\n\n"
        assert reply.tokens[r1:] == render_reply(tok, {**a, "reasoning_content": ""}).tokens
        assert THINK_OPEN not in tok.decode(reply.tokens[r1:])
    if fmt == "deepseek":  # DeepSeek's vocabulary has the markers as tokens of their own
        assert tok.encode(THINK_OPEN) == [128821] and reply.tokens[0] == 128821
        assert tok.encode(THINK_CLOSE) == [128822]
    else:  # SmolLM2's spells them in text
        assert len(tok.encode(THINK_OPEN)) > 1
    with pytest.raises(ValueError, match="assistant"):
        render_reply(tok, {"role": "user", "content": "hi"})


@pytest.mark.parametrize("fmt", ["deepseek", "chatml"])
def test_traces_step_by_step(formats, fmt):
    """Through real traces (synthetic and bfcl, with reasoning): each step's prompt plus its
    reply (`reply_of`) without reasoning is the start of the next step's rendering."""
    tok = formats[fmt]
    trace_list = traces.synthetic(2, 3, 40, 1, reasoning_words=15) + traces.add_reasoning(
        traces.bfcl("base", limit=1), 10, seed=1
    )
    checked = 0
    for t in trace_list:
        for s0, s1 in zip(t["steps"], t["steps"][1:], strict=False):
            reply = traces.reply_of(s0["messages"], s1["messages"])
            if reply is None:
                continue
            prompt = render(tok, s0["messages"], s0.get("tools")).tokens
            ids = prompt + render_reply(tok, reply).without_reasoning
            nxt = render(tok, s1["messages"], s1.get("tools"), add_generation_prompt=False)
            assert nxt.tokens[: len(ids)] == ids
            checked += 1
    assert checked >= 10


def test_chatml_empty_history_is_the_exception(formats):
    """A reply with no message before it: DeepSeek's holds; ChatML's rendering of [A] opens with
    the default system message, which the generation prompt of [] has not (the GGUF's template
    adds it with a first message), unless tool schemas bring it in both."""
    a = {"role": "assistant", "content": "Hello.", "reasoning_content": THOUGHT}
    for fmt, holds in (("deepseek", True), ("chatml", False)):
        tok = formats[fmt]
        ids = render(tok, []).tokens + render_reply(tok, a).without_reasoning
        assert (ids == render(tok, [a], add_generation_prompt=False).tokens) is holds
        # with tool schemas the default system message (holding them) opens both
        ids = render(tok, [], TOOLS).tokens + render_reply(tok, a).without_reasoning
        assert ids == render(tok, [a], TOOLS, add_generation_prompt=False).tokens


@pytest.mark.parametrize("fmt", ["deepseek", "chatml"])
def test_interleaved_rule_resends_the_current_turns_reasoning(formats, fmt):
    """keep_reasoning: an assistant reply after the last user message is re-sent with its
    reasoning block, exactly as `render_reply` generated it (the generation prompt + the whole
    reply starts the next rendering), and `Rendered.reasoning` holds exactly those blocks;
    replies of earlier user turns are re-sent without theirs."""
    tok = formats[fmt]
    conv = with_reasoning(CONV)
    last_user = max(i for i, m in enumerate(conv) if m["role"] == "user")
    for n, a in enumerate(conv):
        if a["role"] != "assistant":
            continue
        prompt = render(tok, conv[:n], TOOLS, keep_reasoning=True)
        full = render(tok, conv[: n + 1], TOOLS, add_generation_prompt=False, keep_reasoning=True)
        reply = render_reply(tok, a)
        current = n > max(i for i, m in enumerate(conv[: n + 1]) if m["role"] == "user")
        assert full.tokens[: len(prompt.tokens)] == prompt.tokens[: len(full.tokens)]
        if current:
            assert prompt.tokens + reply.tokens == full.tokens
            r0, r1 = full.reasoning[-1]
            assert tok.decode(full.tokens[r0:r1]) == f"{THINK_OPEN}\n{THOUGHT}\n{THINK_CLOSE}\n\n"
    every = render(tok, conv, TOOLS, keep_reasoning=True)
    assert len(every.reasoning) == sum(
        1 for i, m in enumerate(conv) if m["role"] == "assistant" and i > last_user
    )
    # the rule can fail: without it, the current turn's reasoning is not re-sent
    assert render(tok, conv, TOOLS).reasoning == ()
    assert len(every.tokens) > len(render(tok, conv, TOOLS).tokens)
