"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis): requests
generated to fit the schema and to break it, against a live server on the tiny default model.
No request may get a 5xx; every 4xx is OpenAI's error JSON naming the offending field in
`param` and starting its message with it (on Anthropic's routes, `/v1/messages...`, its error
JSON, the message starting with the field and a colon). At least 1000 requests in all.

`LEYLINE_FUZZ_MESSAGES=N` also runs `/v1/messages` alone at N examples a generation mode (500:
over 1,000 requests; about five minutes on this 2-core machine, so not in make test: its
run is recorded in docs/testing.md)."""

from __future__ import annotations

import collections
import os

import jax.numpy as jnp
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

import leyline_jax as ll  # noqa: E402
from checkpoints.tiny import ensure_default_checkpoints  # noqa: E402
from serve import chat  # noqa: E402
from serve.engine import Engine  # noqa: E402
from serve.http.backend import Backend  # noqa: E402
from serve.http.errors import anthropic_route  # noqa: E402
from serve.http.messages_input import MessagesRequest  # noqa: E402
from serve.http.server import ServerThread  # noqa: E402

EXAMPLES = 170  # per operation and generation mode (those with few distinct inputs run fewer)
# ... but those taking an id alone, or a snapshot: one field each, fewer
FEWER = {"/v1/models/{model_id}": 60, "/v1/sessions/{session_id}": 60, "/v1/sessions/import": 60}
MINIMUM = 1000
PARTS = ("body", "path", "method", "header", "query")  # a request's parts an error may name
# refused unless neutral, or (top_logprobs) unless another field is set
REFUSED = ("top_logprobs", "logit_bias", "response_format", "tool_choice")
# ... on /v1/messages (a grammar the tiny model cannot have; top k; servers)
REFUSED_MESSAGES = ("tool_choice", "output_config", "top_k", "mcp_servers", "container")


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    model = ll.load_model(
        ensure_default_checkpoints(tmp_path_factory.mktemp("ckpt"))["deepseek_v3"]
    )
    engine = Engine(
        model, num_pages=48, page_size=16, max_seqs=4, max_seq_len=128, kv_dtype=jnp.float32
    )
    backend = Backend.for_engine(
        engine, chat.ChatTokenizer(), "tiny", default_max_tokens=4, request_timeout_s=60
    )
    with ServerThread(backend) as srv:
        yield srv


def operations(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    return [r.ok() for r in schema.get_all_operations()]


def check(case, server, gen, counts: collections.Counter) -> None:
    if gen is schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict):
        # let valid bodies reach the engine: the one model served, and what the schema cannot
        # say (only an assistant message may lack `content`; the `REFUSED` fields), so that
        # the share reaching it does not hang on which constants Hypothesis harvested from the
        # modules this process imported (it draws dict keys and strings from them)
        case.body["model"] = "tiny"
        anthropic = anthropic_route(case.operation.path)
        for field in REFUSED_MESSAGES if anthropic else REFUSED:
            case.body.pop(field, None)
        if anthropic and "max_tokens" in case.body:
            case.body["max_tokens"] = 2  # within the context
        for m in case.body.get("messages") or []:
            if isinstance(m, dict) and m.get("content") is None and m.get("role") != "assistant":
                m["content"] = "x"
    response = case.call(base_url=server.url, timeout=120)
    status = response.status_code
    counts[case.operation.label, f"{status // 100}xx"] += 1
    assert status < 500, (status, case.as_curl_command(), response.text[:2000])
    if 400 <= status < 500 and anthropic_route(case.operation.path):
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"], body
        # the message starts with the field: a path (whose keys the client chose, any text)
        # from a field of the body or a part of the request, then ": "
        message, sent = body["error"]["message"], case.body if isinstance(case.body, dict) else {}
        headers = {h.name.lower() for h in case.operation.iter_parameters()}
        names = {*sent, *MessagesRequest.model_fields, *headers, *PARTS}
        assert any(message.startswith(n) for n in names if n), (case.as_curl_command(), body)
        assert ": " in message, body
    elif 400 <= status < 500:
        err = response.json()["error"]
        assert err["param"], (status, case.as_curl_command(), err)
        assert err["message"].startswith(err["param"]), err
        assert err["type"] and err["message"]


def fuzz(op, gen, server, counts, examples: int = EXAMPLES) -> None:
    """`examples` requests of `op` in generation mode `gen` (derandomized)."""

    @given(case=op.as_strategy(generation_mode=gen))
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        check(case, server, gen, counts)

    try:
        run()
    except Unsatisfiable:  # nothing to break: an operation without parameters or body
        assert (
            gen is schemathesis.GenerationMode.NEGATIVE
            and not op.body
            and not any(True for _ in op.iter_parameters())
        ), op.label


def test_no_5xx_and_every_4xx_names_its_field(fuzz_server):
    """Each operation's strategy (schemathesis' generation from the schema, driven by
    hypothesis here: its pytest plugin does not run on this pytest), fitting the schema and
    breaking it; then the count reached."""
    counts: collections.Counter = collections.Counter()
    for gen in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        for op in operations(fuzz_server):
            fuzz(op, gen, fuzz_server, counts, FEWER.get(op.path, EXAMPLES))
    print(dict(counts))
    assert sum(counts.values()) >= MINIMUM, dict(counts)
    # the generated requests reach the engine, and are refused, on both generating endpoints
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        assert counts[f"POST {path}", "2xx"] and counts[f"POST {path}", "4xx"], dict(counts)


@pytest.mark.skipif(
    not os.environ.get("LEYLINE_FUZZ_MESSAGES"), reason="LEYLINE_FUZZ_MESSAGES=N runs it"
)
def test_messages_at_length(fuzz_server):
    """`/v1/messages` alone, `LEYLINE_FUZZ_MESSAGES` examples a generation mode: no 5xx, every
    4xx in Anthropic's shape naming its field; the count reached."""
    examples = int(os.environ["LEYLINE_FUZZ_MESSAGES"])
    counts: collections.Counter = collections.Counter()
    (op,) = [op for op in operations(fuzz_server) if op.label == "POST /v1/messages"]
    for gen in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        fuzz(op, gen, fuzz_server, counts, examples)
    print(dict(counts))
    assert sum(counts.values()) >= 2 * examples, dict(counts)
    assert counts["POST /v1/messages", "2xx"] and counts["POST /v1/messages", "4xx"]
