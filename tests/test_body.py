"""A request's body parsed apart (`serve.http.body`): a body over `APART` bytes whose route
joins text parts is parsed in the parsing process, which hands back each message's list of
text parts as one part. What the route reads is the same either way (the chat dicts a
request renders from, Anthropic's chat messages), a validation error names the same place,
and a JSON syntax error the same position. And the joining can be told apart: a part with a
key of its own, or of another type, leaves its list as it came."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from fastapi.exceptions import RequestValidationError  # noqa: E402

from serve.http import body  # noqa: E402
from serve.http.messages_input import MessagesRequest, chat_messages  # noqa: E402
from serve.http.schema import ChatCompletionRequest  # noqa: E402

PARTS = [{"type": "text", "text": f"part {i}; "} for i in range(300)]


def chat(parts, **more) -> bytes:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}] * 3},
        {"role": "user", "content": "and the rest?"},
    ]
    return json.dumps({"model": "m", "messages": messages, **more}).encode()


def parsed(data: bytes, model, apart: bool, monkeypatch):
    """`data` parsed as `model`, in the parsing process (`apart`) or here."""
    monkeypatch.setattr(body, "APART", 0 if apart else 1 << 62)
    return body.Received(data, "application/json").parse(model, joins_text=True)


def chat_dicts(req: ChatCompletionRequest) -> list[dict]:
    return [m.as_chat_dict() for m in req.messages]


def test_a_chat_body_reads_the_same_parsed_apart(monkeypatch):
    data = chat(PARTS)
    here = parsed(data, ChatCompletionRequest, False, monkeypatch)
    apart = parsed(data, ChatCompletionRequest, True, monkeypatch)
    assert body._parser is not None  # the parsing process ran it
    assert len(here.messages[1].content) == 300 and len(apart.messages[1].content) == 1
    assert chat_dicts(apart) == chat_dicts(here)
    assert chat_dicts(here)[1]["content"] == "".join(p["text"] for p in PARTS)


def test_an_anthropic_body_reads_the_same_parsed_apart(monkeypatch):
    blocks = [{"type": "text", "text": f"block {i}. "} for i in range(50)]
    messages = [
        {"role": "user", "content": blocks},
        {"role": "assistant", "content": blocks[:3]},
        {"role": "user", "content": "go on"},
    ]
    data = json.dumps({"model": "m", "max_tokens": 8, "messages": messages}).encode()
    here = parsed(data, MessagesRequest, False, monkeypatch)
    apart = parsed(data, MessagesRequest, True, monkeypatch)
    assert len(apart.messages[0].content) == 1
    assert chat_messages(apart) == chat_messages(here)


@pytest.mark.parametrize(
    "odd", [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text"}]
)
def test_a_bad_part_is_named_where_it_stands(odd, monkeypatch):
    data = chat([*PARTS[:200], odd, *PARTS[200:]])
    located = []
    for apart in (False, True):
        with pytest.raises(RequestValidationError) as e:
            parsed(data, ChatCompletionRequest, apart, monkeypatch)
        located.append([err["loc"] for err in e.value.errors()])
    assert located[0] == located[1]
    lists = [loc for loc in located[1] if loc[-1] != "str"]  # the other: content as a string
    assert lists and all(loc[:4] == ("body", "messages", 1, "content") for loc in lists)
    assert all(loc[-1] == 200 or loc[5] == 200 for loc in lists), located


def test_a_json_syntax_error_at_the_same_position(monkeypatch):
    data = chat(PARTS)[:-40] + b"}"
    errs = []
    for apart in (False, True):
        with pytest.raises(RequestValidationError) as e:
            parsed(data, ChatCompletionRequest, apart, monkeypatch)
        errs.append(e.value.errors())
    assert errs[0] == errs[1] and errs[0][0]["type"] == "json_invalid"


def test_only_lists_of_bare_text_parts_are_joined():
    bare = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    keyed = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, bare[1]]
    value = {"messages": [{"content": list(bare)}, {"content": keyed}, {"content": "s"}]}
    assert body.joined_text_parts(value)
    assert value["messages"][0]["content"] == [{"type": "text", "text": "ab"}]
    assert value["messages"][1]["content"] == keyed and value["messages"][2]["content"] == "s"
    assert not body.joined_text_parts({"messages": [{"content": keyed}]})
    assert not body.joined_text_parts(
        {"messages": [{"content": [{"type": "text", "text": 1}] * 2}]}
    )
    assert not body.joined_text_parts([1, 2]) and not body.joined_text_parts({"messages": 3})
