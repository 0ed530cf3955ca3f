"""Constrained decoding: `serve.sampling.sample`'s grammar mask (against a numpy reference) and
structured output end to end on SmolLM2-135M-Instruct (`response_format` `json_schema` and
`json_object` through the official `openai` client, each reply validated against its schema by
jsonschema_rs, an independent validator); a tokenizer that cannot constrain, and a schema the
grammar library refuses, are 400s naming the field."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from serve.sampling import grammar_masks, mask_words, sample

# its time is SmolLM2 generating text, not compiling: XLA optimises (tests/conftest.py)
pytestmark = pytest.mark.xla_optimized

V = 100


class Allow:
    """A stand-in matcher allowing a fixed set of tokens."""

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def fill(self, row, left=None):
        row[:] = 0
        for t in self.tokens:
            row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))


def test_the_mask_keeps_only_allowed_tokens():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, V)).astype(np.float32)
    allowed = [[3, 31, 32, 99], None, [64], list(range(0, V, 7))]
    matchers = [None if a is None else Allow(a) for a in allowed]
    masks = grammar_masks(matchers, [10] * 4, logits.shape)
    assert masks.shape == (4, mask_words(V)) and mask_words(V) == 4
    args = [jnp.zeros(4, jnp.float32), jnp.ones(4, jnp.float32), jnp.arange(4, dtype=jnp.uint32)]
    greedy = np.asarray(sample(jnp.asarray(logits), *args, jnp.zeros(4, jnp.int32), masks))
    for row, a in enumerate(allowed):
        keep = range(V) if a is None else a
        assert greedy[row] == max(keep, key=lambda t: logits[row, t])
    # the unmasked argmax of the constrained rows lies outside their sets (the mask mattered)
    assert all(np.argmax(logits[r]) not in allowed[r] for r in (0, 2, 3))
    hot = [jnp.ones(4, jnp.float32), jnp.ones(4, jnp.float32), jnp.arange(4, dtype=jnp.uint32)]
    for step in range(20):
        drawn = np.asarray(sample(jnp.asarray(logits), *hot, jnp.full(4, step, jnp.int32), masks))
        assert all(a is None or drawn[r] in a for r, a in enumerate(allowed))
    assert grammar_masks([None, None], [1, 1], (2, V)) is None


# ---- end to end on SmolLM2 ----------------------------------------------------------------
openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

SCHEMAS = [
    {  # nested object, enum, array
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "pets": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "color", "pets", "address"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
            "done": {"type": "boolean"},
        },
        "required": ["steps", "done"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def smollm2_server():
    from serve.engine import EngineConfig
    from serve.http.backend import load_backend
    from serve.http.server import ServerThread

    config = EngineConfig(num_pages=128, page_size=16, max_seqs=2, max_seq_len=1024)
    with ServerThread(load_backend("smollm2", config)) as srv:
        yield srv


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_replies_validate(smollm2_server, k, temperature):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": SCHEMAS[k], "strict": True},
    }
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=160, temperature=temperature, seed=k, response_format=fmt,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema_rs.validate(SCHEMAS[k], json.loads(r.choices[0].message.content))


def test_a_tight_budget_closes_the_json(smollm2_server):
    """Greedy SmolLM2 writes SCHEMAS[0] in more than 50 tokens; held to 50, its reply closes
    in time: cut ("length"), and valid against the schema."""
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMAS[0]}}
    ask = dict(model="smollm2", messages=[{"role": "user", "content": "Answer in JSON."}],
               temperature=0.0, response_format=fmt)  # fmt: skip
    free = client.chat.completions.create(max_tokens=160, **ask)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens > 50
    r = client.chat.completions.create(max_tokens=50, **ask)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens <= 50
    jsonschema_rs.validate(SCHEMAS[0], json.loads(r.choices[0].message.content))


def _adversary(grammar, vocab, a, budget, tell_budget=True):
    """Decode `grammar` under `budget` with a "model" that keeps extending a string (it takes
    token `a` wherever allowed, else the lowest allowed token): its tokens, and whether the
    matcher closed them."""
    m, out = grammar.matcher(), []
    row = np.zeros(mask_words(vocab), np.int32)
    while len(out) < budget:
        m.fill(row, budget - len(out) if tell_budget else None)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
        t = a if bits[a] else int(np.flatnonzero(bits)[0])
        assert m.accept(t)
        out.append(t)
        if m.closed:
            break
    return out, m.closed


@pytest.mark.parametrize("budget", [60, 100, 200])
def test_a_budget_closes_a_string_that_never_ends(budget):
    from serve import chat
    from serve.grammar import Grammars

    tok = chat.ChatTokenizer.from_gguf()
    grammars = Grammars(tok.tokenizer_json(), tok.vocab_size, tok.stop_tokens)
    grammar = grammars.json_schema(SCHEMAS[0])
    (a,) = tok.encode("a")
    out, closed = _adversary(grammar, tok.vocab_size, a, budget)
    assert closed and len(out) <= budget
    jsonschema_rs.validate(SCHEMAS[0], json.loads(tok.decode(out)))
    # the same turn not told its budget runs into it inside the string: text that does not parse
    out, closed = _adversary(grammar, tok.vocab_size, a, budget, tell_budget=False)
    assert not closed and len(out) == budget
    with pytest.raises(json.JSONDecodeError):
        json.loads(tok.decode(out))


def test_bad_formats_name_the_field(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)
    bad = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "nonsense"}}}
    for fmt, param in [
        (bad, "response_format.json_schema.schema"),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "yaml"}, "response_format.type"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                response_format=fmt,
            )  # fmt: skip
        assert e.value.body["param"] == param, e.value.body


# ---- tool_choice: the grammar takes what the chat layout renders, and only that ------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip


class _Backend:
    def __init__(self, tok):
        from serve.grammar import Grammars

        self.tokenizer = tok
        self.grammars = Grammars(tok.tokenizer_json(), tok.vocab_size, tok.stop_tokens)


@pytest.fixture(scope="module", params=["chatml", "deepseek"])
def layout(request):
    from serve import chat

    tok = chat.ChatTokenizer.from_gguf() if request.param == "chatml" else chat.ChatTokenizer()
    return _Backend(tok)


def _accepts(grammar, tokens) -> bool:
    m = grammar.matcher()
    return all(m.accept(t) for t in tokens)


@pytest.mark.parametrize(
    "choice, calls, ok",
    [
        ("required", [("get_weather", {"city": "Paris"})], True),
        ("required", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})], True),
        ("get_weather", [("get_weather", {"city": "Rome"})], True),
        ("get_weather", [("add", {"a": 1, "b": 2})], False),  # another function than named
        ("required", [("add", {"a": "one", "b": 2})], False),  # arguments off their schema
        ("required", [("nope", {})], False),  # not a tool
        ("one", [("add", {"a": 1, "b": 2})], True),  # required, parallel_tool_calls false
        ("one", [("add", {"a": 1, "b": 2}), ("add", {"a": 1, "b": 2})], False),
    ],
)
def test_tool_grammars_take_the_rendered_calls(layout, choice, calls, ok):
    from serve import chat
    from serve.http import formats
    from serve.http.schema import ChatCompletionRequest

    named = {"type": "function", "function": {"name": choice}}
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
        "tool_choice": named if choice not in ("required", "one") else "required",
        "parallel_tool_calls": choice != "one",
    })  # fmt: skip
    grammar = formats.grammar(req, layout)
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}  # fmt: skip
    reply = chat.render_reply(layout.tokenizer, message).tokens
    stop = layout.tokenizer.stop_tokens[0]
    body = reply[: reply.index(stop) + 1]  # through the end of the reply
    assert _accepts(grammar, body) is ok
    if ok and choice != "required":  # exactly one call
        assert not _accepts(grammar, body[:-1] + body[: reply.index(stop)])


@pytest.mark.parametrize("choice", ["required", "add", "none"])
def test_tool_choice_over_http(smollm2_server, choice):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": choice}}
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS, tool_choice=named if choice == "add" else choice, max_tokens=60,
        temperature=0.7, seed=1, parallel_tool_calls=False,  # SmolLM2 repeats a call else
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls or []
    if choice == "none":
        assert not calls and r.choices[0].finish_reason != "tool_calls"
        return
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for c in calls:
        tool = next(t for t in TOOLS if t["function"]["name"] == c.function.name)
        jsonschema_rs.validate(tool["function"]["parameters"], json.loads(c.function.arguments))
    if choice == "add":
        assert [c.function.name for c in calls] == ["add"]


def test_a_budget_cut_keeps_the_complete_calls(smollm2_server):
    """Parallel calls allowed, greedy SmolLM2 repeats its call until the budget cuts one: the
    complete calls are the reply's, its finish reason "length"."""
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS, tool_choice="required", max_tokens=50, temperature=0,
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "length" and calls, r.choices[0].message
    assert not r.choices[0].message.content
    for c in calls:
        tool = next(t for t in TOOLS if t["function"]["name"] == c.function.name)
        jsonschema_rs.validate(tool["function"]["parameters"], json.loads(c.function.arguments))


def test_a_tool_schema_with_local_refs(layout):
    from serve import chat
    from serve.http import formats
    from serve.http.schema import ChatCompletionRequest

    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    at = {"at": {"$ref": "#/$defs/Loc"}}
    params = {"$defs": {"Loc": loc}, "type": "object", "properties": at, "required": ["at"]}
    tool = {"type": "function", "function": {"name": "go", "parameters": params}}
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [tool, TOOLS[1]],
            "tool_choice": "required",
        }  # fmt: skip
    )
    grammar = formats.grammar(req, layout)
    args = json.dumps({"at": {"city": "Oslo"}})
    call = {"id": "c", "type": "function", "function": {"name": "go", "arguments": args}}
    reply = chat.render_reply(
        layout.tokenizer, {"role": "assistant", "content": "", "tool_calls": [call]}
    )
    stop = layout.tokenizer.stop_tokens[0]
    assert _accepts(grammar, reply.tokens[: reply.tokens.index(stop) + 1])
