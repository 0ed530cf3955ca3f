"""The OpenAI-compatible HTTP server (`serve.http`) against a live uvicorn on a free port, with
the official `openai` client: chat with and without streaming, tools, completions, models,
errors (status and the field named), concurrent sessions with edits whose tokens equal the same
sessions run through the engine alone (greedy, fp32), usage that adds up, a client that goes
away mid-stream, /metrics through prometheus_client's parser.

The tiny default model (vocabulary 256) with DeepSeek's tokenizer and chat layout, ids taken
modulo the vocabulary (`serve.http.ModVocabTokenizer`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import leyline_jax as ll  # noqa: E402
from checkpoints.tiny import ensure_default_checkpoints  # noqa: E402
from leyline_jax import allocator  # noqa: E402
from leyline_jax.directives import Mode  # noqa: E402
from serve import chat  # noqa: E402
from serve.chat_formats import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP  # noqa: E402
from serve.engine import Engine, SamplingParams  # noqa: E402
from serve.http.backend import Backend  # noqa: E402
from serve.http.server import ServerThread, free_port  # noqa: E402
from serve.http.text import ModVocabTokenizer, OutputText, parse_tool_calls  # noqa: E402

ENGINE = dict(num_pages=512, page_size=16, max_seqs=16, kv_dtype=jnp.float32)
MODEL = "tiny"
SYSTEM = "You are a terse assistant. Tool results arrive in tool messages."


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    ensure_default_checkpoints(root)
    return root


@pytest.fixture(scope="module")
def model(ckpt_dir):
    return ll.load_model(ensure_default_checkpoints(ckpt_dir)["deepseek_v3"])


@pytest.fixture(scope="module")
def base_tokenizer():
    return chat.ChatTokenizer()


@pytest.fixture(scope="module")
def server(model, base_tokenizer):
    backend = Backend.for_engine(Engine(model, **ENGINE), base_tokenizer, MODEL, max_queue=32)
    with ServerThread(backend) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def wait_idle(server, timeout=60.0):
    w = server.backend.worker
    t0 = time.time()
    while w.jobs or w.pending or not w.engine.idle():
        assert time.time() - t0 < timeout, "the engine did not go idle"
        time.sleep(0.05)


def post(server, path, body, headers=None):
    """(status, headers, parsed body) of a raw POST (bodies the client would refuse to send)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path,
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def usage_adds_up(u, completion: int | None = None):
    extra = u.model_extra
    cached = u.prompt_tokens_details.cached_tokens
    assert cached == extra["reused_tokens"] + extra["spliced_tokens"]
    assert cached + extra["prefilled_tokens"] == u.prompt_tokens
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if completion is not None:
        assert u.completion_tokens == completion


def ids(resp) -> dict:
    return resp.model_extra["leyline"]


# ---- endpoints ------------------------------------------------------------------------------
def test_models_health_and_metrics_parse(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server.url + "/health") as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=2, temperature=0)
    with urllib.request.urlopen(server.url + "/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    for name in (
        "leyline_http_requests",
        "leyline_prompt_tokens",
        "leyline_queue_depth",
        "leyline_free_pages",
        "leyline_ttft_seconds",
        "leyline_step_seconds",
        "leyline_cache_hit_rate",
    ):
        assert name in families, name
    prefilled = [
        s.value
        for s in families["leyline_prompt_tokens"].samples
        if s.labels.get("source") == "prefilled" and s.name.endswith("_total")
    ]
    assert prefilled and prefilled[0] >= 4
    assert families["leyline_free_pages"].samples[0].value > 0


def test_chat_streaming_equals_non_streaming(server, client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there!"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    body = {"leyline": {"return_token_ids": True}}
    r = client.chat.completions.create(**kw, extra_body=body)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    usage_adds_up(r.usage, len(ids(r)["output_token_ids"]))

    chunks = list(
        client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body=body
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == r.choices[0].finish_reason and not any(finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == r.usage.completion_tokens
    usage_adds_up(last.usage)
    assert last.model_extra["leyline"]["output_token_ids"] == ids(r)["output_token_ids"]
    # the second identical request finds the prompt's whole pages in the radix cache
    assert last.usage.prompt_tokens_details.cached_tokens >= 16

    # the wire format: SSE data lines, the last one [DONE]
    status, headers, raw = post(server, "/v1/chat/completions", {**kw, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    data = [ln[len("data: ") :] for ln in raw.splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"]
    assert not any("usage" in json.loads(d) for d in data[:-1])  # usage only when asked


def test_tools_render_and_parse(client, base_tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "rain"}'},
    ]
    body = {"leyline": {"return_token_ids": True}}
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="auto", max_tokens=3,
        temperature=0, extra_body=body,
    )  # fmt: skip
    tok = ModVocabTokenizer(base_tokenizer, 256)
    expected = chat.render(tok, messages, tools).tokens
    assert ids(r)["prompt_token_ids"] == expected and r.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError) as e:  # a named tool_choice: not enforced yet
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, max_tokens=2,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    assert e.value.body["param"] == "tool_choice"

    # DeepSeek V3 and V3.1 layouts and Hermes blocks parse back into tool_calls
    v3 = (
        f"Let me check.{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}get_weather\n"
        f'```json\n{{"city": "Oslo"}}\n```{CALL_END}{CALLS_END}'
    )
    content, calls = parse_tool_calls(v3)
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    v31 = f'{CALLS_BEGIN}{CALL_BEGIN}a{TOOL_SEP}{{"x": 1}}{CALL_END}'
    v31 += f"{CALL_BEGIN}b{TOOL_SEP}{{}}{CALL_END}"  # cut before CALLS_END
    assert [c["function"]["name"] for c in parse_tool_calls(v31)[1]] == ["a", "b"]
    hermes = 'ok<tool_call>\n{"name": "f", "arguments": {"q": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(hermes)
    assert content == "ok" and json.loads(calls[0]["function"]["arguments"]) == {"q": 2}
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    cut = hermes + '\n<tool_call>\n{"name": "f", "argu'  # the budget cut a second call
    assert [c["function"]["name"] for c in parse_tool_calls(cut)[1]] == ["f"]
    assert parse_tool_calls(cut[len(hermes) + 1 :])[1] == []  # only a cut call: text
    bad = hermes + '<tool_call>\n{"name": "f", "argu</tool_call>'  # closed, not JSON: text
    assert parse_tool_calls(bad) == (bad, [])

    # streaming holds content back at a marker or a stop string that may be starting
    class Chars:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    out = OutputText(Chars(), (), ["END"], ["<tool_call>"])
    s = [ord(c) for c in "hi <tool"]
    assert out.update(s) == "hi "
    assert out.update(s + [ord(c) for c in "_call>{}"]) == ""
    out = OutputText(Chars(), (), ["END"], [])
    assert out.update([ord(c) for c in "abcE"]) == "abc"
    assert out.update([ord(c) for c in "abcEND tail"]) == "" and out.stopped
    assert out.text == "abc"


def test_completions_text_and_token_ids(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                  temperature=0)  # fmt: skip
    assert r.object == "text_completion" and r.usage.completion_tokens <= 4
    usage_adds_up(r.usage)
    body = {"leyline": {"return_token_ids": True}}
    r1 = client.completions.create(
        model=MODEL, prompt=[3, 1, 4, 1, 5, 9, 2, 6], max_tokens=4, temperature=0, extra_body=body
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=[3, 1, 4, 1, 5, 9, 2, 6], max_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=body,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r1.choices[0].text
    assert chunks[-1].model_extra["leyline"]["output_token_ids"] == ids(r1)["output_token_ids"]
    usage_adds_up(chunks[-1].usage)


# ---- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, param",
    [
        ({"model": "gpt-4o"}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"leyline": {"mode": "sideways"}}, "leyline.mode"),
        ({"leyline": {"typo": 1}}, "leyline.typo"),
        ({"leyline": {"lineage": "session:0"}}, "leyline.lineage"),  # a session's own
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools.0.function.name"),
        ({"stream": "maybe"}, "stream"),
        ({"session_id": "snow\u2603man"}, "session_id"),  # it would be a response header
        # nothing coerced: a string, a float or a boolean is not an integer, "false" no boolean
        ({"max_tokens": "4"}, "max_tokens"),
        ({"max_tokens": 4.0}, "max_tokens"),
        ({"seed": True}, "seed"),
        ({"stream": "false"}, "stream"),
        ({"leyline": {"move": "yes"}}, "leyline.move"),
        ({"leyline": {"directives": [{"messages": [0]}]}}, "leyline.directives.0.messages"),
        ({"cache_salt": ""}, "cache_salt"),
    ],
)  # fmt: skip
def test_bad_chat_bodies_name_the_field(server, change, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, _, raw = post(server, "/v1/chat/completions", {**body, **change})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize(
    "prompt", [[True, False], [1.0, 2.0], "a\ud800b", [[True]], "too long"]
)  # fmt: skip
def test_bad_completion_prompts_name_the_prompt(server, prompt):
    """Booleans and floats are not token ids; a lone surrogate is not text; a prompt longer
    than the context names `prompt` (a 400 in OpenAI's shape, counted as such)."""
    if prompt == "too long":
        prompt = [1] * (server.backend.max_seq_len + 1)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    status, _, raw = post(server, "/v1/completions", json.dumps(body).encode())
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "prompt", err


def test_bad_requests_through_the_client_and_raw(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1, 2, 999], max_tokens=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    status, _, raw = post(server, "/v1/chat/completions", b"{not json")
    assert status == 400 and json.loads(raw)["error"]["param"] == "body"
    status, _, raw = post(server, "/v1/chat/completions", [1, 2])
    assert status == 400 and json.loads(raw)["error"]["param"] == "body"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "session_id": "a"}
    status, _, raw = post(server, "/v1/chat/completions", body, {"X-Session-Id": "b"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "session_id"
    status, _, raw = post(server, "/v1/nowhere", {})
    assert status == 404 and "error" in json.loads(raw)


def test_a_full_queue_answers_429_with_retry_after(server, client):
    worker = server.backend.worker
    limit, worker.max_queue = worker.max_queue, 0
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"]
    finally:
        worker.max_queue = limit


def test_health_says_warming_while_it_serves(model, base_tokenizer):
    """With a warmup to run (`--warmup`), the worker compiles one shape at a time between steps:
    /health is 503 with Retry-After and the progress until the last shape is done, then 200;
    a request meanwhile is served, not refused."""
    size = {"num_pages": 40, "max_num_batched_tokens": 24, "prefill_chunk": 16}
    engine = Engine(model, **ENGINE | size)
    backend = Backend.for_engine(engine, base_tokenizer, MODEL)
    backend.worker.warming = engine.warmup_plan()
    total = backend.worker.warming.total
    with ServerThread(backend) as srv:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(srv.url + "/health")
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "5"
        assert f"of {total} shapes compiled" in json.loads(e.value.read())["error"]["message"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert r.usage.completion_tokens == 2
        deadline = time.monotonic() + 300
        while backend.worker.warming is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        with urllib.request.urlopen(srv.url + "/health") as ok:
            assert ok.status == 200


def test_a_client_gone_mid_stream_frees_its_turn(server):
    wait_idle(server)
    worker = server.backend.worker
    sessions = len(worker.engine.sessions)
    cancelled = worker.engine.counters["cancelled_turns"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 400, "temperature": 0, "stream": True}  # fmt: skip
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if b'"content"' in line and b'"role"' not in line:
                break  # a token has arrived: the turn is running; now hang up
    wait_idle(server)
    engine = worker.engine
    assert engine.counters["cancelled_turns"] == cancelled + 1
    assert len(engine.sessions) == sessions  # its own session closed: pages back
    # refcounts exact: each page referenced once per page-table row and radix node holding it
    want = allocator.table_references(engine.state)
    for p in engine.radix.pages():
        want[p] += 1
    np.testing.assert_array_equal(engine.state.refcount, want)


# ---- sessions over HTTP equal the engine alone -------------------------------------------------
TURNS = 6
CLIENTS = 16


def conversation(i: int, turn: int) -> tuple[str, str]:
    return (
        json.dumps({"session": i, "turn": turn, "result": "ok" * (3 + i + turn)}),
        f"What did turn {turn} say?",
    )


def run_session(client, i: int, log: list, errors: list) -> None:
    """Session i over HTTP: TURNS turns, each re-sending the whole history; sessions with
    i % 4 in (1, 3) replace their first tool output by a stub at turn 3 (AMORTIZE), i % 4 == 2
    the same with FORGET, and the edit stays in the history after; even turns stream."""
    try:
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(TURNS):
            tool, user = conversation(i, turn)
            messages += [{"role": "tool", "content": tool}, {"role": "user", "content": user}]
            body = {"leyline": {"return_token_ids": True}}
            if i % 4 and turn == 3:
                messages[1]["content"] = "[evicted]"
                body["leyline"]["mode"] = "forget" if i % 4 == 2 else "amortize"
            kw = dict(
                model=MODEL, messages=messages, max_tokens=3 + i % 2, temperature=0,
                extra_headers={"X-Session-Id": f"s{i}"}, extra_body=body,
            )  # fmt: skip
            if turn % 2 == 0:
                opts = dict(stream=True, stream_options={"include_usage": True})
                chunks = list(client.chat.completions.create(**kw, **opts))
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                last = chunks[-1]
                usage, extra = last.usage, last.model_extra["leyline"]
            else:
                r = client.chat.completions.create(**kw)
                content, usage, extra = r.choices[0].message.content, r.usage, ids(r)
            assert extra["session_id"] == f"s{i}"
            usage_adds_up(usage, len(extra["output_token_ids"]))
            log.append((turn, extra["prompt_token_ids"], extra["output_token_ids"], body, usage))
            messages.append({"role": "assistant", "content": content})
    except BaseException as e:  # reported by the test thread
        errors.append((i, e))


def test_concurrent_sessions_equal_the_engine_alone(server, client, model):
    logs = {i: [] for i in range(CLIENTS)}
    errors: list = []
    threads = [
        threading.Thread(target=run_session, args=(client, i, logs[i], errors))
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    # every session's turns through one engine alone, from the same prompts: the sessions'
    # turn k together (greedy fp32 outputs do not depend on the batch: test_engine)
    engine = Engine(model, **ENGINE)
    sids = {i: engine.open_session() for i in logs}
    spliced = 0
    for turn in range(TURNS):
        reqs = {}
        for i, turns in logs.items():
            assert len(turns) == TURNS
            _, prompt, _, body, _ = turns[turn]
            mode = Mode.FORGET if body["leyline"].get("mode") == "forget" else Mode.AMORTIZE
            sp = SamplingParams(max_new_tokens=3 + i % 2, stop_tokens=(1,))
            reqs[i] = engine.submit_prompt(sids[i], prompt, mode=mode, sampling=sp)
        engine.run_until_idle()
        for i, turns in logs.items():
            _, prompt, output, body, usage = turns[turn]
            assert reqs[i].result() == output, (i, turn)
            assert usage.prompt_tokens == len(prompt)
            if turn and not body["leyline"].get("mode"):
                # unedited: the re-sent history extends the session (the replies' sampled ids
                # come back in place of their re-encoded text), so all of it is reused but the
                # last sampled token, never fed
                _, prev_prompt, prev_out, _, _ = turns[turn - 1]
                n = len(prev_prompt) + len(prev_out)
                assert prompt[:n] == prev_prompt + prev_out, (i, turn)
                assert usage.model_extra["reused_tokens"] == n - 1
            spliced += usage.model_extra["spliced_tokens"]
    assert spliced > 0  # the AMORTIZE sessions spliced over HTTP
    status, _, _ = post(server, "/v1/chat/completions", {})  # still serving
    assert status == 400
    req = urllib.request.Request(server.url + "/v1/sessions/s0", method="DELETE")
    with urllib.request.urlopen(req) as r:
        assert json.loads(r.read())["deleted"] is True


# ---- explicit directives ----------------------------------------------------------------------
def test_explicit_directives_splice_by_message(server, client, model, base_tokenizer):
    """`leyline.directives` edits messages of the history as sent: message 1's content becomes
    the replacement (AMORTIZE) and message 3's too (FORGET), and the turn equals the same two
    token directives, built here from the rendered message spans, run through an engine
    alone; the client's mirrored history then extends the session."""
    wait_idle(server)
    tok = ModVocabTokenizer(base_tokenizer, 256)
    body = {"leyline": {"return_token_ids": True}}
    hdr = {"X-Session-Id": "directives"}
    kw = dict(model=MODEL, max_tokens=3, temperature=0, extra_headers=hdr)
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "tool", "content": json.dumps({"rows": list(range(40))})},
        {"role": "user", "content": "Summarise the rows."},
        {"role": "tool", "content": json.dumps({"more": "x" * 90})},
        {"role": "user", "content": "And now?"},
    ]
    r1 = client.chat.completions.create(messages=history, extra_body=body, **kw)
    prompt1, out1 = ids(r1)["prompt_token_ids"], ids(r1)["output_token_ids"]
    history += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Go on."},
    ]
    edits = [
        {"messages": [1, 1], "replacement": "[evicted]"},
        {"messages": [3, 3], "replacement": "[gone]", "mode": "forget"},
    ]
    r2 = client.chat.completions.create(
        messages=history, extra_body={"leyline": {"return_token_ids": True, "directives": edits}},
        **kw,
    )  # fmt: skip
    extra = ids(r2)
    assert [d["mode"] for d in extra["directives"]] == ["amortize", "forget"]
    usage_adds_up(r2.usage, len(extra["output_token_ids"]))
    assert r2.usage.model_extra["spliced_tokens"] > 0  # between the two edits

    # the reference: the session's tokens, the two message contents replaced by token
    # directives at their rendered content spans, and the rest of the history as the tail
    spans = {sp.index: sp for sp in chat.render(tok, history[:5]).spans}
    session = prompt1 + out1
    ds = [
        ll.Directive(spans[1].content_start, spans[1].content_end, tok.encode("[evicted]")),
        ll.Directive(spans[3].content_start, spans[3].content_end, tok.encode("[gone]"),
                     Mode.FORGET),
    ]  # fmt: skip
    kept = ll.directives.apply_to_list(session, ds)
    assert extra["prompt_token_ids"][: len(kept)] == kept
    tail = extra["prompt_token_ids"][len(kept) :]
    engine = Engine(model, **ENGINE)
    sid = engine.open_session()
    sp = SamplingParams(max_new_tokens=3, stop_tokens=(1,))
    assert engine.submit_prompt(sid, prompt1, sampling=sp).result() == out1
    ref = engine.submit(sid, tail, directives=ds, sampling=sp)
    assert ref.result() == extra["output_token_ids"]
    stats = ref.stats
    served = r2.usage.model_extra
    assert (stats.reused_tokens, stats.spliced_tokens, stats.prefilled_tokens) == (
        served["reused_tokens"], served["spliced_tokens"], served["prefilled_tokens"]
    )  # fmt: skip

    # the client mirrors the edits: its next request extends the session
    mirrored = [dict(m) for m in history]
    mirrored[1]["content"], mirrored[3]["content"] = "[evicted]", "[gone]"
    mirrored += [
        {"role": "assistant", "content": r2.choices[0].message.content},
        {"role": "user", "content": "Thanks."},
    ]
    r3 = client.chat.completions.create(messages=mirrored, extra_body=body, **kw)
    prompt3, out3 = ids(r3)["prompt_token_ids"], ids(r3)["output_token_ids"]
    n = len(extra["prompt_token_ids"]) + len(extra["output_token_ids"])
    assert prompt3[:n] == extra["prompt_token_ids"] + extra["output_token_ids"]
    assert r3.usage.model_extra["reused_tokens"] == n - 1
    assert engine.submit_prompt(sid, prompt3, sampling=sp).result() == out3

    # a directive after the remembered replies (rendered with their sampled ids, which need
    # not be as long as their re-encoded text): message 8's content, located from the end
    mirrored += [
        {"role": "assistant", "content": r3.choices[0].message.content},
        {"role": "user", "content": "More."},
    ]
    r4 = client.chat.completions.create(
        messages=mirrored, extra_body={"leyline": {"return_token_ids": True, "directives": [
            {"messages": [8, 8], "replacement": "Cheers!"}]}}, **kw,
    )  # fmt: skip
    unsub = chat.render(tok, mirrored[:9])
    a = len(prompt3) - (len(unsub.tokens) - unsub.spans[8].content_start)
    b = len(prompt3) - (len(unsub.tokens) - unsub.spans[8].content_end)
    assert prompt3[a:b] == tok.encode("Thanks.")
    d = ll.Directive(a, b, tok.encode("Cheers!"))
    kept = ll.directives.apply_to_list(prompt3 + out3, [d])
    assert ids(r4)["prompt_token_ids"][: len(kept)] == kept
    ref = engine.submit(sid, ids(r4)["prompt_token_ids"][len(kept) :], directives=[d], sampling=sp)
    assert ref.result() == ids(r4)["output_token_ids"]
    assert ref.stats.spliced_tokens == r4.usage.model_extra["spliced_tokens"] > 0


@pytest.mark.parametrize(
    "directives, param",
    [
        ([{"messages": [0, 9]}], "leyline.directives.0.messages"),
        ([{"messages": [1, 0]}], "leyline.directives.0.messages"),
        ([{"messages": [0]}], "leyline.directives.0.messages"),  # a pair: [first, last]
        ([{"messages": [0, 1]}, {"messages": [1, 1]}], "leyline.directives"),
        ([{"messages": [0, 0], "mode": "later"}], "leyline.directives.0.mode"),
        ([{"messages": [0, 0], "extra": 1}], "leyline.directives.0.extra"),
    ],
)
def test_bad_directives_name_the_field(server, directives, param):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    body = {"model": MODEL, "max_tokens": 2, "leyline": {"directives": directives}}
    body["messages"] = messages
    status, _, raw = post(server, "/v1/chat/completions", body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param, err


# ---- an unmodified harness over HTTP equals the replay -----------------------------------------
def test_replay_over_http_equals_serve_replay(model, base_tokenizer):
    """Synthetic traces sent turn by turn through the `openai` client, one session per trace,
    with the truncate policy applied client-side: the prompts are `benchmarks.replay`'s and the hit
    rate its amortize arm's (C=1, greedy, no stop token, an engine of the replay's size). Then
    the same traces unedited with `context_management` (clear_tool_uses: keep 2, fire from the
    first tool use): the server's edits are the client-side policy's, token for token, and it
    reports what it cleared."""
    from benchmarks import replay, traces
    from serve import policies

    trace_list = traces.synthetic(sessions=3, turns=4, tool_words=60, seed=5)
    work = replay.prompts(trace_list, base_tokenizer, 256, "truncate", {"keep": 2})
    row, _ = replay.run_arm(model, work, "amortize", 1, max_new=2, page_size=16)
    engine = replay.make_engine(model, work, 1, max_new=2, page_size=16)
    backend = Backend.for_engine(engine, base_tokenizer, MODEL)
    truncate = policies.Truncate(keep=2)
    cm = {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 2},
                     "trigger": {"type": "tool_uses", "value": 1}}]}  # fmt: skip
    with ServerThread(backend) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        for side in ("client", "server"):
            engine.reset_prefix_cache()
            cached = prompt_tokens = 0
            for t, trace in enumerate(trace_list):
                for k, step in enumerate(trace["steps"]):
                    msgs = step["messages"]
                    extra = {"ignore_eos": True, "leyline": {"return_token_ids": True}}
                    if side == "client":
                        msgs = truncate.apply(trace["id"], msgs)
                    else:
                        extra["context_management"] = cm
                    r = client.chat.completions.create(
                        model=MODEL, messages=msgs, tools=step["tools"], max_tokens=2,
                        temperature=0, extra_body=extra,
                        extra_headers={"X-Session-Id": f"{side}-{t}"},
                    )  # fmt: skip
                    assert ids(r)["prompt_token_ids"] == work[t][k], (side, t, k)
                    usage_adds_up(r.usage, 2)
                    cached += r.usage.prompt_tokens_details.cached_tokens
                    prompt_tokens += r.usage.prompt_tokens
                    if side == "server":
                        applied = r.model_extra["context_management"]["applied_edits"]
                        tools = sum(m["role"] == "tool" for m in step["messages"])
                        assert [e["cleared_tool_uses"] for e in applied] == (
                            [tools - 2] if tools > 2 else []
                        )
                req = urllib.request.Request(srv.url + f"/v1/sessions/{side}-{t}", method="DELETE")
                urllib.request.urlopen(req).close()  # as the replay closes a finished trace
            assert prompt_tokens == row["prompt_tokens"]
            assert cached / prompt_tokens == pytest.approx(row["hit_rate"], abs=1e-12), side


# ---- durable sessions ---------------------------------------------------------------------------
def test_a_server_without_a_snapshot_dir_refuses_to_snapshot(server):
    status, _, raw = post(server, "/v1/snapshot", {})
    assert status == 409 and json.loads(raw)["error"]["param"] == "snapshot_dir"


class Process:
    """`python -m serve.http` in a process of its own (fp32 KV, a small pool, the suite's shape
    ladder: tests/conftest.py)."""

    def __init__(self, ckpt_dir, snapshots, cache):
        self.port = free_port()
        args = ["--model", "tiny", "--root", str(ckpt_dir), "--port", str(self.port),
                "--kv-dtype", "fp32", "--num-pages", "64", "--max-seqs", "4",
                "--snapshot-dir", str(snapshots), "--compile-cache", str(cache),
                "--bucket-growth", "4"]  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve.http", *args],
            cwd=Path(__file__).resolve().parents[1],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        t0 = time.time()
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read()
            assert time.time() - t0 < 300, "the server did not come up"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def turn(self, messages, session="durable", mode="amortize"):
        r = self.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0,
            extra_headers={"X-Session-Id": session} if session else {},
            extra_body={"leyline": {"return_token_ids": True, "mode": mode}},
        )  # fmt: skip
        return r, ids(r)["prompt_token_ids"], ids(r)["output_token_ids"]

    def stop(self, sig) -> str:
        self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=120)
        return out


def test_sessions_survive_a_restart(request, ckpt_dir, model, tmp_path):
    """A real server process: a turn, a snapshot on request (POST /v1/snapshot), a second
    turn, then SIGKILL (no shutdown snapshot). Restarted, it restores the requested snapshot:
    the second turn, re-sent, reuses the first turn's KV. A third turn, SIGTERM (the shutdown
    snapshot), a restart: the fourth turn reuses everything before it. Every turn's output
    equals the same prompts run through one engine that never restarted (greedy, fp32)."""
    store = getattr(request.config, "cache", None)
    cache = store.mkdir("leyline_xla") if store is not None else tmp_path / "xla"
    snaps = tmp_path / "snapshots"
    history = [{"role": "system", "content": SYSTEM}]
    log = []  # (prompt, output) of each turn as served

    def ask(srv, text):
        history.append({"role": "user", "content": text})
        r, prompt, out = srv.turn(history)
        history.append({"role": "assistant", "content": r.choices[0].message.content})
        log.append((prompt, out))
        return r

    srv = Process(ckpt_dir, snaps, cache)
    ask(srv, "First: " + "alpha " * 30)
    with urllib.request.urlopen(urllib.request.Request(srv.url + "/v1/snapshot", data=b"",
                                                       method="POST")) as resp:  # fmt: skip
        assert json.loads(resp.read())["sessions"] == 1
    ask(srv, "Second: " + "beta " * 20)
    srv.stop(signal.SIGKILL)  # a crash: the requested snapshot is the last one

    srv = Process(ckpt_dir, snaps, cache)
    history[-2:] = []  # the second turn is lost with the crash: the harness sends it again
    log.pop()
    r = ask(srv, "Second: " + "beta " * 20)
    (p1, o1), (p2, _) = log[0], log[1]
    assert p2[: len(p1) + len(o1)] == p1 + o1
    assert r.usage.model_extra["reused_tokens"] == len(p1) + len(o1) - 1  # restored KV
    ask(srv, "Third.")
    out = srv.stop(signal.SIGTERM)
    assert srv.proc.returncode == 0 and "saved 1 sessions" in out, out

    srv = Process(ckpt_dir, snaps, cache)
    r = ask(srv, "Fourth.")
    (p3, o3), (p4, _) = log[2], log[3]
    assert p4[: len(p3) + len(o3)] == p3 + o3
    assert r.usage.model_extra["reused_tokens"] == len(p3) + len(o3) - 1
    assert r.usage.model_extra["prefilled_tokens"] == len(p4) - (len(p3) + len(o3) - 1)
    srv.stop(signal.SIGTERM)

    engine = Engine(model, num_pages=64, page_size=16, max_seqs=4, kv_dtype=jnp.float32)
    sid = engine.open_session()
    sp = SamplingParams(max_new_tokens=4, stop_tokens=(1,))
    for k, (prompt, output) in enumerate(log):
        assert engine.submit_prompt(sid, prompt, sampling=sp).result() == output, k


def test_lineage_holds_over_http(server, client):
    """A session splices (AMORTIZE) an edit of its history; a request without a session
    sending the edited history then gets from the radix cache exactly the clean pages before
    the edit, never the session's spliced KV after it."""
    wait_idle(server)
    body = {"leyline": {"return_token_ids": True}}
    kw = dict(model=MODEL, max_tokens=2, temperature=0, extra_body=body)
    history = [
        {"role": "system", "content": SYSTEM + " (lineage) " * 4},
        {"role": "tool", "content": "row " * 80},
        {"role": "user", "content": "Now answer. " * 20},
    ]
    h = {"X-Session-Id": "lineage"}
    r1 = client.chat.completions.create(messages=history, extra_headers=h, **kw)
    edited = [history[0], {"role": "tool", "content": "[evicted]"}, history[2]]
    r2 = client.chat.completions.create(messages=edited, extra_headers=h, **kw)
    assert r2.usage.model_extra["spliced_tokens"] > 0
    p1, p2 = ids(r1)["prompt_token_ids"], ids(r2)["prompt_token_ids"]
    edit = next(i for i, (a, b) in enumerate(zip(p1, p2, strict=False)) if a != b)
    wait_idle(server)
    alone = client.chat.completions.create(messages=edited, **kw)
    assert ids(alone)["prompt_token_ids"] == p2
    assert alone.usage.model_extra["spliced_tokens"] == 0
    assert edit >= 16 and alone.usage.prompt_tokens_details.cached_tokens == edit // 16 * 16
