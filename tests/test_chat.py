"""The real tokenizer and the chat format: real vocabulary, exact spans, prefix stability."""

from __future__ import annotations

import pytest

from serve.chat import ASSISTANT, BOS, CALLS_BEGIN, EOS, USER, ChatTokenizer, render, tools_text


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer()


CONV = [
    {"role": "system", "content": "You are a helpful assistant with tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp_c": 18, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 18 °C and clear."},
]


def test_real_vocabulary_round_trip(tok):
    assert tok.vocab_size == 129280
    text = "Hello! 1 + 1 = 2, get_weather(city='Paris') 毕老师"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.special(USER) == 128803 and tok.special(BOS) == 0 and tok.special(EOS) == 1
    with pytest.raises(KeyError):
        tok.special("<not a token>")


def test_spans_are_exact(tok):
    r = render(tok, CONV)
    assert r.tokens[0] == tok.special(BOS) and r.tokens[-1] == tok.special(ASSISTANT)
    for span, m in zip(r.spans, CONV, strict=True):
        assert span.role == m["role"]
        assert tok.decode(r.tokens[span.content_start : span.content_end]) == m["content"]
    # spans tile the rendering between the BOS and the generation prompt
    assert r.spans[0].start == 1 and r.spans[-1].end == len(r.tokens) - 1
    for a, b in zip(r.spans, r.spans[1:], strict=False):
        assert a.end == b.start
    call = tok.decode(r.tokens[r.spans[2].start : r.spans[2].end])
    assert "get_weather" in call and '"city": "Paris"' in call


def test_rendering_is_prefix_stable(tok):
    """Appending messages never changes earlier tokens; with the generation prompt, neither does
    the assistant reply that follows it (the prompt is the reply's first token)."""
    for n in range(1, len(CONV)):
        a = render(tok, CONV[:n], add_generation_prompt=False).tokens
        b = render(tok, CONV[: n + 1], add_generation_prompt=False).tokens
        assert b[: len(a)] == a
        if CONV[n]["role"] == "assistant":
            a = render(tok, CONV[:n]).tokens
            assert b[: len(a)] == a


def test_unknown_role(tok):
    with pytest.raises(ValueError, match="role"):
        render(tok, [{"role": "robot", "content": "x"}])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "ls", "description": "List files."}},
]


def test_tool_schemas_follow_the_system_prompt(tok):
    plain = render(tok, CONV)
    r = render(tok, CONV, TOOLS)
    assert plain.tools is None and r.tools is not None
    t0, t1 = r.tools
    sys_end = r.spans[0].end
    assert t0 == sys_end  # right after the system message, before the user's
    assert r.spans[1].start == t1
    text = tok.decode(r.tokens[t0:t1])
    assert text == tools_text(TOOLS)
    assert "### get_weather" in text and '"city": {"type": "string"}' in text and "### ls" in text
    assert tok.special(CALLS_BEGIN) in r.tokens[t0:t1]  # the format line's special tokens
    # everything else is what it was without tools, shifted by the section
    n = t1 - t0
    assert r.tokens[:t0] == plain.tokens[:t0] and r.tokens[t1:] == plain.tokens[t0:]
    for a, b in zip(plain.spans[1:], r.spans[1:], strict=True):
        assert (b.start, b.content_start) == (a.start + n, a.content_start + n)
    # prefix-stable with tools too
    for k in range(1, len(CONV)):
        a = render(tok, CONV[:k], TOOLS, add_generation_prompt=False).tokens
        b = render(tok, CONV[: k + 1], TOOLS, add_generation_prompt=False).tokens
        assert b[: len(a)] == a


def test_tool_schemas_without_a_system_prompt(tok):
    r = render(tok, CONV[1:], TOOLS)
    assert r.tools[0] == 1 and r.spans[0].start == r.tools[1]  # right after BOS
    only_system = render(tok, CONV[:1], TOOLS)
    assert only_system.tools[0] == only_system.spans[0].end
