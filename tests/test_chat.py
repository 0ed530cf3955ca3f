"""The real tokenizer and the chat format: real vocabulary, exact spans, prefix stability."""

from __future__ import annotations

import pytest

from serve.chat import ASSISTANT, BOS, EOS, USER, ChatTokenizer, render


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
