"""`POST /v1/responses` through the official `openai` client (`client.responses`): a response
equals the chat turn of the same history (greedy), its stream's deltas make its text and end
in `response.completed`, `previous_response_id` continues the conversation in one session (the
chain's prefix reused, not re-prefilled), function calls and their outputs as input items, and
what it cannot take is a 400 / 404 naming the field.

The tiny default model (vocabulary 256) with DeepSeek's tokenizer, ids modulo the vocabulary.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serve import chat  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)


def test_a_response_is_the_chat_turn_of_its_history(client):
    r = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hi there!", max_output_tokens=6,
        temperature=0, store=False,
    )  # fmt: skip
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there!"},
    ]
    c = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=history)
    # a reply the budget cut is "incomplete", as the chat turn's finish reason "length"
    status = {"stop": "completed", "length": "incomplete"}[c.choices[0].finish_reason]
    assert r.object == "response" and r.status == status
    cut = None if status == "completed" else "max_output_tokens"
    assert (r.incomplete_details and r.incomplete_details.reason) == cut
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    events = list(client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hi there!", max_output_tokens=6,
        temperature=0, store=False, stream=True,
    ))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_previous_response_id_continues_one_session(client):
    r1 = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=4,
                                 temperature=0)  # fmt: skip
    r2 = client.responses.create(model=MODEL, input="And then?", max_output_tokens=4,
                                 temperature=0, previous_response_id=r1.id)  # fmt: skip
    assert r2.model_extra["session_id"] == r1.model_extra["session_id"] is not None
    # the chain's history is the session's tokens: reused, only the new message prefilled
    assert r2.usage.model_extra["reused_tokens"] >= r1.usage.input_tokens
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    # each request's instructions apply, the earlier ones are not carried over
    kw = dict(model=MODEL, input="And then?", max_output_tokens=1, temperature=0, store=False)
    a = client.responses.create(**kw, previous_response_id=r1.id, instructions="Be brief.")
    b = client.responses.create(**kw, previous_response_id=r1.id, instructions="Be long-winded.")
    tok = chat.ChatTokenizer()
    grew = len(tok.encode("Be long-winded.")) - len(tok.encode("Be brief."))
    assert b.usage.input_tokens - a.usage.input_tokens == grew
    assert b.usage.model_extra["spliced_tokens"] > 0  # the changed instructions: an edit
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"


def test_function_calls_and_outputs_as_input_items(client):
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "name": "get_weather", "parameters": params}]
    args, result = '{"city": "Paris"}', '{"sky": "rain"}'
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "c1", "output": result},
    ]
    r = client.responses.create(
        model=MODEL, input=items, tools=tools, max_output_tokens=3, temperature=0, store=False
    )
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    c = client.chat.completions.create(
        model=MODEL,
        max_tokens=3,
        temperature=0,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": params}}],
        messages=[
            items[0],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": result},
        ],
    )
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == c.choices[0].message.content


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),  # past the context
        (
            {"input": "x", "extra_body": {"leyline": {"directives": [{"messages": [0, 3]}]}}},
            "leyline.directives.0.messages",
        ),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": "json"}}, "text.format"),
    ],
)
def test_what_it_cannot_take_is_named(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **body)
    assert e.value.body["param"] == param, e.value.body


def test_a_stored_response_is_its_tenants_alone():
    from serve.http.errors import APIError
    from serve.http.responses_input import Store, Stored

    store = Store(limit=2)
    store.put("r1", Stored("alice", "s1", []))
    assert store.get("alice", "r1").session == "s1"
    with pytest.raises(APIError) as e:
        store.get("bob", "r1")  # another tenant's: not found, as an unknown one
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    store.put("r2", Stored("alice", "s2", []))
    for k in range(3):  # another tenant's traffic evicts none of alice's
        store.put(f"b{k}", Stored("bob", "sb", []))
    assert store.get("alice", "r1").session == "s1"
    store.put("r3", Stored("alice", "s3", []))  # past her limit: her oldest goes
    with pytest.raises(APIError):
        store.get("alice", "r1")
    assert store.get("alice", "r3").session == "s3" and store.get("bob", "b2").session == "sb"


def test_an_edit_holds_down_the_chain(client, tiny_server):
    """A directive on a continued response edits the stored conversation: the next response
    extends the edited history (its KV reused), and what a FORGET evicted is stored no more."""
    secret = "The vault code is 7341."
    kw = dict(model=MODEL, max_output_tokens=2, temperature=0)
    r1 = client.responses.create(input=secret, **kw)
    forget = {"directives": [{"messages": [0, 0], "replacement": "(gone)", "mode": "forget"}]}
    r2 = client.responses.create(input="Hi", previous_response_id=r1.id, **kw,
                                 extra_body={"leyline": forget})  # fmt: skip
    assert r2.usage.model_extra["spliced_tokens"] == 0  # FORGET: prefilled from the edit on
    r3 = client.responses.create(input="Again", previous_response_id=r2.id, **kw)
    assert r3.usage.model_extra["reused_tokens"] >= r2.usage.input_tokens
    stored = tiny_server.backend.responses.get("", r3.id).messages
    assert stored[0] == {"role": "user", "content": "(gone)"}
    assert not any(secret in str(m) for m in stored)
