"""The rest of the OpenAI / vLLM surface `serve.http` serves, through a live server and the
official `openai` client: `/v1/models/{id}`, `/tokenize` and `/detokenize` (checked against
the ids the chat route itself reports), fields the server cannot honour refused by name,
usage in a stream only when asked, a stop string that ends a turn counted as finished (not
cancelled), `ignore_eos` output without the end token in its text.

The tiny default model (vocabulary 256) with DeepSeek's tokenizer, ids modulo the vocabulary.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serve import chat  # noqa: E402
from serve.http.text import ModVocabTokenizer, OutputText  # noqa: E402

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def call(server, method, path, body=None):
    """(status, parsed JSON body) of a raw request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_model_by_id(server, client):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


def test_tokenize_is_what_the_chat_route_runs(server, client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
        extra_body={"leyline": {"return_token_ids": True}},
    )  # fmt: skip
    ids = r.model_extra["leyline"]
    status, t = call(server, "POST", "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert (
        status == 200 and t["tokens"] == ids["prompt_token_ids"] and t["count"] == len(t["tokens"])
    )
    status, d = call(server, "POST", "/detokenize", {"tokens": ids["output_token_ids"]})
    assert status == 200 and d["prompt"].startswith(r.choices[0].message.content)
    tok = ModVocabTokenizer(chat.ChatTokenizer(), 256)
    status, t = call(server, "POST", "/tokenize", {"prompt": "plain text"})
    assert status == 200 and t["tokens"] == tok.encode("plain text")
    # without the generation prompt: the history as a prefix of what the chat route runs
    status, t = call(server, "POST", "/tokenize", {"messages": MESSAGES,
                                                   "add_generation_prompt": False})  # fmt: skip
    assert status == 200 and ids["prompt_token_ids"][: t["count"]] == t["tokens"]
    assert t["count"] < len(ids["prompt_token_ids"])


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),  # a lone surrogate: not text
        ("/detokenize", {"tokens": [1, 256]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
    ],
)
def test_bad_tokenize_bodies_name_the_field(server, path, body, param):
    status, err = call(server, "POST", path, body)
    assert status == 400 and err["error"]["param"] == param


@pytest.mark.parametrize(
    "field, value",
    [
        ("logit_bias", {"5": 3.0}),
        # the tiny model's modulo tokenizer cannot constrain; no `tools` to choose from
        ("response_format", {"type": "json_object"}),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_what_the_server_cannot_honour_is_refused_by_name(server, field, value):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, field: value}
    status, err = call(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and err["error"]["param"] == field, err
    if field != "tool_choice":
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1, field: value}
        status, err = call(server, "POST", "/v1/completions", body)
        assert status == 400 and err["error"]["param"] == field, err


def test_neutral_values_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, presence_penalty=0, frequency_penalty=0,
        logit_bias={}, response_format={"type": "text"}, tool_choice="none",
        extra_body={"repetition_penalty": 1},
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_usage_in_a_stream_only_when_asked(client, route):
    def stream(**kw):
        if route == "chat":
            return list(client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw))
        return list(client.completions.create(model=MODEL, prompt="x y z", **kw))

    kw = dict(max_tokens=3, temperature=0, stream=True)
    assert all(c.usage is None for c in stream(**kw))
    asked = stream(**kw, stream_options={"include_usage": True})
    assert all(c.usage is None for c in asked[:-1])
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 3


def test_a_stop_string_finishes_the_turn(server, client):
    kw = dict(model=MODEL, prompt="x y z", max_tokens=24, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = next(ch for ch in full[1:] if ch not in (full[0], "\ufffd"))  # not at the start
    counters = server.backend.worker.engine.counters
    before = dict(counters)
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**kw, stop=[stop], stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.completions.create(**kw, stop=[stop])
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert text == full[: full.index(stop)] and finish == "stop"
    # finished, not cancelled: by the engine's counters and the server's metrics
    assert counters["stopped_turns"] - before.get("stopped_turns", 0) == 2
    assert counters["cancelled_turns"] == before.get("cancelled_turns", 0)
    metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()
    assert 'leyline_turns_total{outcome="TurnCancelled"}' not in metrics


def test_ignore_eos_leaves_the_end_token_out_of_the_text(client):
    class Tok:  # one character per id; 0 is the end of a turn
        def decode(self, ids):
            return "".join("<END>" if i == 0 else chr(96 + i) for i in ids)

    out = OutputText(Tok(), [0], [], [])
    out.update([1, 2, 0, 3, 0, 4], final=True)
    assert out.text == "abcd"
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "leyline": {"return_token_ids": True}},
    )  # fmt: skip
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
