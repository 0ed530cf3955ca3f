"""`POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API) through the
official `anthropic` client, on one SmolLM2-135M-Instruct server with a tenant's key: a message
and its stream agree (the SDK's own accumulator, the deltas and the whole reply, greedy); a
forced tool's `input` validates against its `input_schema` and the `tool_result` turn after it
reuses the session's KV; `count_tokens` is the prompt the usage adds up to; a wrong key is an
`authentication_error`; every bad field is a 400 naming it, in Anthropic's error shape;
`clear_tool_uses_20250919` reports what chat completions reports for the same history.
"""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

from serve.http.errors import APIError  # noqa: E402
from serve.http.messages_input import MessagesRequest, session_name  # noqa: E402

# its time is SmolLM2 generating text, not compiling: XLA optimises (tests/conftest.py)
pytestmark = pytest.mark.xla_optimized

KEY = "key-of-alice-1"
MODEL = "smollm2"
GREEDY = {"temperature": 0}  # the SDK has no `temperature` argument any more: a body field
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    from serve.engine import EngineConfig
    from serve.http.auth import Tenants
    from serve.http.backend import load_backend
    from serve.http.server import ServerThread

    config = EngineConfig(num_pages=128, page_size=16, max_seqs=2, max_seq_len=1024)
    backend = load_backend(
        "smollm2", config, tenants=Tenants({KEY: "alice"}), max_body_bytes=1 << 16
    )
    with ServerThread(backend) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def prompt_of(usage) -> int:
    """The prompt's tokens, as Anthropic's usage adds them up."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_message_its_stream_and_its_count_agree(client):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ask = dict(model=MODEL, max_tokens=12, system="Be brief.", extra_body=GREEDY)
    session = {"X-Session-Id": "capital-1"}
    r = client.messages.create(messages=question, extra_headers=session, **ask)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.stop_reason in ("end_turn", "max_tokens") and r.content[0].type == "text"
    assert (r.usage.output_tokens == 12) == (r.stop_reason == "max_tokens")
    deltas, raw = [], []
    with client.messages.stream(messages=question, **ask) as stream:  # no session: its own
        for event in stream:
            if event.type != "text":  # the SDK's own event beside each text delta
                raw.append(event.type)
            if event.type == "content_block_delta":
                deltas.append(event.delta.text)
        final = stream.get_final_message()
    assert final.content[0].text == "".join(deltas) == r.content[0].text
    assert final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}
    # Anthropic's usage adds up to the prompt: read (reused / spliced) + input (prefilled); a
    # prompt nothing was cached for is all input, as count_tokens counts it
    assert r.usage.cache_read_input_tokens == r.usage.cache_creation_input_tokens == 0
    assert prompt_of(final.usage) == prompt_of(r.usage)
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=question)
    assert counted.input_tokens == r.usage.input_tokens
    cut = client.messages.create(messages=question, stop_sequences=["Paris", "Rome"], **ask)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", "Paris")
    assert r.content[0].text.startswith(cut.content[0].text + "Paris")
    # the next turn in the session reads the whole first turn from its KV: its prompt and
    # reply but the last token sampled (never fed), not whole pages as the radix cache would
    history = [*question, {"role": "assistant", "content": r.content},
               {"role": "user", "content": "And of Germany?"}]  # fmt: skip
    r2 = client.messages.create(messages=history, extra_headers=session, **ask | {"max_tokens": 2})
    read = prompt_of(r.usage) + r.usage.output_tokens - 1
    assert read % 16 and r2.usage.cache_read_input_tokens == read
    assert r2.usage.input_tokens == prompt_of(r2.usage) - read


def test_a_forced_tool_its_result_and_the_session(client):
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    ask = dict(model=MODEL, max_tokens=200, tools=[WEATHER], extra_body=GREEDY,
               tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    session = {"X-Session-Id": "weather-1"}
    r = client.messages.create(messages=ASK, extra_headers=session, **ask)
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert r.stop_reason == "tool_use"
    jsonschema_rs.validate(WEATHER["input_schema"], use.input)
    assert client.messages.count_tokens(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=ask["tool_choice"]
    ).input_tokens == prompt_of(r.usage)
    with client.messages.stream(messages=ASK, **ask) as stream:  # no session: its own
        events = list(stream)
        streamed = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["tool_use"]  # no text block before it
    sent = "".join(e.partial_json for e in events if e.type == "input_json")
    assert json.loads(sent) == use.input
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", "get_weather", use.input)
    ]
    assert streamed.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Rain, 12 C."}
    history = [*ASK, {"role": "assistant", "content": r.content},
               {"role": "user", "content": [result]}]  # fmt: skip
    r2 = client.messages.create(
        model=MODEL, max_tokens=4, tools=[WEATHER], messages=history, extra_body=GREEDY,
        extra_headers=session,
    )  # fmt: skip
    assert r2.content[0].type == "text" and r2.stop_reason in ("end_turn", "max_tokens")
    assert r2.usage.cache_read_input_tokens >= prompt_of(r.usage)  # the first turn's prompt
    with pytest.raises(anthropic.BadRequestError) as e:  # a result of no tool use
        client.messages.create(
            model=MODEL, max_tokens=8, tools=[WEATHER], extra_body=GREEDY,
            messages=[*ASK, {"role": "assistant", "content": "No."},
                      {"role": "user", "content": [result]}],
        )  # fmt: skip
    assert e.value.body["error"]["message"].startswith("messages.2.content.0.tool_use_id:")


def test_a_budget_past_the_context_is_cut_to_it(client):
    """`max_tokens` past the context left (Claude Code asks 32,000 of a model it does not
    know) is served up to the context's end: `model_context_window_exceeded`, not a 400."""
    ask = dict(model=MODEL, extra_body=GREEDY)
    words = "Repeat the words: " + "pear " * 900
    n = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": words}])
    words += "pear " * (1024 - 4 - n.input_tokens)  # four tokens of room
    long = [{"role": "user", "content": words}]
    assert client.messages.count_tokens(model=MODEL, messages=long).input_tokens == 1020
    r = client.messages.create(messages=long, max_tokens=32_000, **ask)
    assert r.stop_reason == "model_context_window_exceeded" and r.usage.output_tokens == 4
    with client.messages.stream(messages=long, max_tokens=5000, **ask) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "model_context_window_exceeded"
    assert streamed.content[0].text == r.content[0].text
    exact = client.messages.create(messages=long, max_tokens=4, **ask)  # the room asked: its own
    assert exact.stop_reason == "max_tokens" and exact.content[0].text == r.content[0].text
    with pytest.raises(anthropic.BadRequestError) as e:  # a prompt the context cannot hold
        client.messages.create(messages=[{"role": "user", "content": words + "pear " * 8}],
                               max_tokens=1, **ask)  # fmt: skip
    assert e.value.body["error"]["message"].startswith("messages:")


def test_a_system_message_where_it_stands(server, client):
    """A message of role `system` (Claude Code sends its environment so) is a system message
    where it stands, as chat completions renders the same conversation."""
    said = [*ASK, {"role": "system", "content": [{"type": "text", "text": "Today is Monday."}]}]
    counted = client.messages.count_tokens(model=MODEL, messages=said).input_tokens
    chat = [*ASK, {"role": "system", "content": "Today is Monday."}]
    c = httpx.post(
        server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "max_tokens": 1, "messages": chat}, timeout=120,
    ).json()  # fmt: skip
    assert counted == c["usage"]["prompt_tokens"]
    r = client.messages.create(model=MODEL, max_tokens=1, messages=said, extra_body=GREEDY)
    assert prompt_of(r.usage) == counted


def test_the_session_is_the_header_else_claude_codes_else_the_user():
    req = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 1, "messages": ASK, "metadata": {"user_id": "u 1"}}
    )
    assert session_name("a", "b", req) == "a" and session_name(None, "b", req) == "b"
    assert (
        session_name(None, None, req).startswith("user-")
        and len(session_name(None, None, req)) == 37
    )
    assert session_name(None, None, req.model_copy(update={"metadata": None})) is None


def test_claude_codes_session_header_names_the_session(client):
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=1, messages=ASK,
        extra_headers={"X-Claude-Code-Session-Id": "cc-1", "anthropic-beta": "x-2025-01-01"},
        extra_query={"beta": "true"}, metadata={"user_id": "someone"},
    )  # fmt: skip
    assert raw.headers["x-session-id"] == "cc-1"
    assert raw.parse().model_extra["leyline"]["session_id"] == "cc-1"


def test_keys_x_api_key_or_bearer(server, client):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0


def test_clear_tool_uses_reports_what_chat_reports(server, client):
    """Three tool uses, a trigger at two, one kept: two cleared, as chat completions clears
    them in the same history."""
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
            "keep": {"type": "tool_uses", "value": 1}}  # fmt: skip
    cities = ["Paris", "Rome", "Oslo"]
    said, chat = [*ASK], [*ASK]
    for k, city in enumerate(cities):
        use = {"type": "tool_use", "id": f"toolu_{k}", "name": "get_weather",
               "input": {"city": city}}  # fmt: skip
        out = f"{city}: rain, {10 + k} C. " * 8
        said += [
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use["id"], "content": out}]},
        ]  # fmt: skip
        call = {
            "id": use["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(use["input"])},
        }
        chat += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": use["id"], "content": out},
        ]  # fmt: skip
    said.append({"role": "user", "content": "And now?"})
    chat.append({"role": "user", "content": "And now?"})
    r = client.messages.create(
        model=MODEL, max_tokens=1, tools=[WEATHER], messages=said,
        extra_body={"context_management": {"edits": [edit]}, **GREEDY},
    )  # fmt: skip
    tool = {"type": "function", "function": {"name": "get_weather",
                                               "parameters": WEATHER["input_schema"]}}  # fmt: skip
    c = httpx.post(
        server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": chat,
              "tools": [tool], "context_management": {"edits": [edit]}}, timeout=120,
    ).json()  # fmt: skip
    applied = r.model_extra["context_management"]["applied_edits"]
    assert applied == c["context_management"]["applied_edits"]
    assert [a["cleared_tool_uses"] for a in applied] == [2] and applied[0][
        "cleared_input_tokens"
    ] > 0
    assert prompt_of(r.usage) == c["usage"]["prompt_tokens"]


def _body(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": ASK} | fields


_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
BAD = [  # (a body, the field its error names)
    ({"model": MODEL, "messages": ASK}, "max_tokens"),
    (_body(max_tokens=0), "max_tokens"),
    (_body(max_tokens="4"), "max_tokens"),
    (_body(model="claude-sonnet-4-5"), "model"),
    (_body(messages=[]), "messages"),
    (_body(messages=[{"role": "developer", "content": "x"}]), "messages.0.role"),
    (_body(messages=[*ASK, {"role": "system", "content": [_USE]}]), "messages.1.content.0.type"),
    (_body(messages=[{"role": "user", "content": 3}]), "messages.0.content"),
    (_body(messages=[{"role": "user", "content": "x", "name": "a"}]), "messages.0.name"),
    (_body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages.0.content.0"),
    (_body(messages=[*ASK, {"role": "assistant", "content": "It"}]), "messages.1.role"),
    (_body(messages=[{"role": "user", "content": [_USE]}]), "messages.0.content.0.type"),
    (_body(messages=[*ASK, {"role": "assistant", "content": [_USE | {"input": "Oslo"}]},
                     {"role": "user", "content": "ok"}]), "messages.1.content.0.input"),
    (_body(messages=[*ASK, {"role": "assistant", "content": [_USE]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]),
     "messages.2.content.0.tool_use_id"),
    (_body(messages=[*ASK, {"role": "assistant", "content": [_USE]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image"}]}]}]),
     "messages.2.content.0.content.0.type"),
    (_body(system=3), "system"),
    (_body(system=[{"type": "image"}]), "system.0.type"),
    (_body(tools=[WEATHER | {"input_schema": {"type": "array"}}]), "tools.0.input_schema"),
    (_body(tools=[WEATHER | {"name": "get weather"}]), "tools.0.name"),
    (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type"),
    (_body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice"),
    (_body(tools=[WEATHER], tool_choice={"type": "sometimes"}), "tool_choice"),
    (_body(tools=[WEATHER], tool_choice={"type": "auto", "x": 1}), "tool_choice.x"),
    (_body(tool_choice={"type": "any"}), "tool_choice"),  # no tools
    (_body(stop_sequences=["a", "b", "c", "d", "e"]), "stop_sequences"),
    (_body(stop_sequences=[""]), "stop_sequences"),
    (_body(temperature=1.5), "temperature"),
    (_body(top_p=0), "top_p"),
    (_body(top_k=40), "top_k"),  # sampling from the top k: not supported
    (_body(metadata={"user_id": "u" * 300}), "metadata.user_id"),
    (_body(metadata={"session": "x"}), "metadata.session"),
    (_body(context_management={"edits": [{"type": "compact_20260112", "trigger": 5}]}),
     "context_management.edits.0.trigger"),
    (_body(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": 3}]}),
     "context_management.edits.0.keep"),
    (_body(context_management={"edits": [{"type": "clear_tool_uses_20250919", "keep": 3}]}),
     "context_management.edits.0.keep"),
    (_body(output_config={"effort": "extreme"}), "output_config.effort"),
    (_body(output_config={"format": {"type": "yaml"}}), "output_config.format.type"),
    (_body(thinking="adaptive"), "thinking"),
    (_body(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), "mcp_servers"),
    (_body(stream="yes"), "stream"),
    (_body(leyline={"directives": [{"messages": [0, 5]}]}), "leyline.directives.0.messages"),
    (_body(service_tier="fastest"), "service_tier"),
    (_body(n=2), "n"),  # not Anthropic's: unknown fields are refused
]  # fmt: skip


@pytest.mark.parametrize("body, field", BAD, ids=[f for _, f in BAD])
def test_a_bad_field_is_refused_by_name(client, body, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=object, body=body)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["message"].startswith(f"{field}:"), err


def test_other_errors_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:  # count_tokens takes no max_tokens
        client.post("/v1/messages/count_tokens", cast_to=object, body=_body())
    assert e.value.body["error"]["message"].startswith("max_tokens:")
    with pytest.raises(anthropic.BadRequestError) as e:  # a header's value: by its name
        client.messages.create(model=MODEL, max_tokens=1, messages=ASK,
                               extra_headers={"X-Session-Id": "has space"})  # fmt: skip
    assert e.value.body["error"]["message"].startswith("x-session-id:")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.post("/v1/messages/batches", cast_to=object, body={})
    assert e.value.body["error"]["type"] == "not_found_error"
    big = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                     content=b"x" * (1 << 17))  # fmt: skip
    assert big.status_code == 413
    assert big.json()["error"]["type"] == "request_too_large"
    # the statuses Anthropic names its own way: 503 is its 529 overloaded_error
    named = {503: (529, "overloaded_error"), 504: (504, "timeout_error"),
             429: (429, "rate_limit_error"), 500: (500, "api_error")}  # fmt: skip
    for status, answer in named.items():
        got, body = APIError(status, "why").anthropic()
        assert (got, body["error"]["type"]) == answer
