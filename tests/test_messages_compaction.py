"""Compaction on `POST /v1/messages` (`compact_20260112`, `serve.http.compaction`), against a live
server on the tiny default model (fp32 KV, greedy; what it writes does not matter):

- Past the trigger the answer opens with a `compaction` block (the summary), then the reply
  generated over system + summary, the summary's span put in place by one deletion directive
  (AMORTIZE, FORGET when asked); `usage.iterations` has the compaction's, then the reply's.
- `pause_after_compaction`: the block alone, stop_reason "compaction".
- The block sent back in the session's next request: the summary, the reply and everything
  before them read from the KV (counters), only the new message prefilled.
- A block sent back drops everything before it (the prompt counts as the one rendered from the
  block onward); a request at the trigger is not compacted; bad parameters are refused by name.
- Streamed, the block is Anthropic's events (`content_block_start`, one `compaction_delta`,
  `content_block_stop`), the reply's blocks after it, and the answer equals the whole one.
"""

from __future__ import annotations

import json

import httpx
import jax.numpy as jnp
import pytest

pytest.importorskip("fastapi")

import leyline_jax as ll  # noqa: E402
from checkpoints.tiny import ensure_default_checkpoints  # noqa: E402
from serve import chat  # noqa: E402
from serve.engine import Engine  # noqa: E402
from serve.http.backend import Backend  # noqa: E402
from serve.http.server import ServerThread  # noqa: E402

MODEL = "tiny"
ENGINE = dict(num_pages=128, page_size=16, max_seqs=2, kv_dtype=jnp.float32)
SYSTEM = "You are a careful assistant."
HISTORY = [
    {"role": "user", "content": "alpha beta gamma delta epsilon zeta eta theta"},
    {"role": "assistant", "content": "iota kappa lambda mu"},
    {"role": "user", "content": "nu xi omicron pi rho sigma tau upsilon phi chi psi omega"},
]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = ll.load_model(ensure_default_checkpoints(root)["deepseek_v3"])
    backend = Backend.for_engine(Engine(model, **ENGINE), chat.ChatTokenizer(), MODEL)
    with ServerThread(backend) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def body(messages, compact=None, **extra) -> dict:
    b = {"model": MODEL, "system": SYSTEM, "messages": messages, "max_tokens": 6,
         "temperature": 0, **extra}  # fmt: skip
    if compact is not None:
        b["context_management"] = {"edits": [{"type": "compact_20260112", **compact}]}
    return b


def count(http, b: dict) -> int:
    keep = ("model", "system", "messages", "tools")
    r = http.post("/v1/messages/count_tokens", json={k: b[k] for k in keep if k in b})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def post(http, b: dict, session: str | None = None) -> dict:
    headers = {"X-Session-Id": session} if session else {}
    r = http.post("/v1/messages", json=b, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def prompt_of(u: dict) -> int:
    return u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]


def trigger(http, messages, **compact) -> dict:
    """A compaction whose trigger the prompt of `messages` exceeds by one token."""
    n = count(http, body(messages))
    return {"trigger": {"type": "input_tokens", "value": n - 1}, **compact}


def test_a_compaction_then_the_reply_over_the_summary_and_its_round_trip(http):
    r = post(http, body(HISTORY, trigger(http, HISTORY)), "c1")
    first, reply = r["content"][0], r["content"][1:]
    assert first["type"] == "compaction" and first["content"]
    assert [b["type"] for b in reply] == ["text"] and r["stop_reason"] == "max_tokens"
    u = r["usage"]
    summary, message = u["iterations"]
    assert summary["type"] == "compaction" and message["type"] == "message"
    # the summary's prompt: the conversation, then the instructions
    assert prompt_of(summary) > count(http, body(HISTORY))
    assert message == {"type": "message", **{k: u[k] for k in summary if k != "type"}}
    (d,) = r["leyline"]["directives"]  # the history deleted: system + summary run
    assert d["mode"] == "amortize" and d["replacement_tokens"] == 0
    # everything before the compacted span reused, the summary's KV spliced (moved), not
    # prefilled; what is prefilled is the summary's last token and the reply's opening
    assert u["reused_tokens"] == d["start"] and u["spliced_tokens"] == summary["output_tokens"]
    assert u["input_tokens"] <= 3
    # the block sent back: the summary, the reply and all before them read from the KV; only
    # the reply's last token (sampled, never run) and the new message prefilled
    nxt = [{"role": "assistant", "content": r["content"]}, {"role": "user", "content": "next"}]
    r2 = post(http, body(HISTORY + nxt), "c1")
    u2 = r2["usage"]
    assert "iterations" not in u2 and r2["content"][0]["type"] == "text"
    assert u2["cache_read_input_tokens"] == prompt_of(u) + u["output_tokens"] - 1
    assert u2["reused_tokens"] == u2["cache_read_input_tokens"]
    assert u2["input_tokens"] < u2["cache_read_input_tokens"]


def test_forget_re_prefills_from_the_compacted_span(http):
    b = body(HISTORY, trigger(http, HISTORY), leyline={"mode": "forget"})
    r = post(http, b, "c2")
    (d,) = r["leyline"]["directives"]
    u = r["usage"]
    assert d["mode"] == "forget" and u["spliced_tokens"] == 0
    assert u["reused_tokens"] == d["start"] and u["input_tokens"] == prompt_of(u) - d["start"]


def test_pause_after_compaction_answers_the_block_alone_and_the_next_turn_follows_it(http):
    r = post(http, body(HISTORY, trigger(http, HISTORY, pause_after_compaction=True)), "c3")
    assert r["stop_reason"] == "compaction"
    assert [b["type"] for b in r["content"]] == ["compaction"] and r["content"][0]["content"]
    (it,) = r["usage"]["iterations"]
    assert it["type"] == "compaction" and it["output_tokens"] == r["usage"]["output_tokens"]
    # continued: the block as the last message; the reply follows the summary, whose KV the
    # session's diff splices into place (system reused, the summary moved)
    back = [{"role": "assistant", "content": r["content"]}]
    r2 = post(http, body(HISTORY + back), "c3")
    u2 = r2["usage"]
    assert r2["content"][0]["type"] == "text"
    assert u2["spliced_tokens"] == it["output_tokens"] and u2["input_tokens"] <= 3
    unpaused = post(http, body(HISTORY, trigger(http, HISTORY)), "c3b")  # the same, not paused
    assert u2["reused_tokens"] == unpaused["leyline"]["directives"][0]["start"]


def test_a_block_sent_back_drops_what_precedes_it(http):
    block = {"type": "compaction", "content": "We talked about Greek letters."}
    tail = [{"role": "assistant", "content": [block, {"type": "text", "text": "Indeed."}]},
            {"role": "user", "content": "And then?"}]  # fmt: skip
    before = [
        *HISTORY,
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}, *tail[0]["content"]]},
    ]  # noqa: E501
    n = count(http, body(tail))
    assert count(http, body([*before, tail[1]])) == n
    plain = [*HISTORY, {"role": "assistant", "content": "ok"}, *tail]  # no block: all kept
    plain[-2] = {"role": "assistant", "content": [{"type": "text", "text": "Indeed."}]}
    assert count(http, body(plain)) > n
    failed = {"type": "compaction", "content": None}  # a failed compaction: a no-op
    kept = [*HISTORY, {"role": "assistant", "content": [failed, {"type": "text", "text": "x"}]}]
    assert count(http, body([*kept, tail[1]])) > n
    r = post(http, body([*before, tail[1]]))  # served, without the edit configured
    assert prompt_of(r["usage"]) == n and r["content"][0]["type"] == "text"


def test_a_prompt_at_the_trigger_is_not_compacted(http):
    n = count(http, body(HISTORY))
    r = post(http, body(HISTORY, {"trigger": {"type": "input_tokens", "value": n}}), "c4")
    assert r["content"][0]["type"] == "text" and "iterations" not in r["usage"]
    assert "directives" not in r["leyline"]


def test_streamed_the_block_is_anthropics_events_and_equals_the_whole_answer(http):
    b = body(HISTORY, trigger(http, HISTORY))
    whole = post(http, b, "c5")
    events = []
    with http.stream("POST", "/v1/messages", json=b | {"stream": True},
                     headers={"X-Session-Id": "c6"}) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["message_start", "content_block_start", "content_block_delta",
                         "content_block_stop"]  # fmt: skip
    assert events[1]["content_block"] == {"type": "compaction", "content": None}
    assert events[2]["delta"] == {
        "type": "compaction_delta",
        "content": whole["content"][0]["content"],
    }  # noqa: E501
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")  # fmt: skip
    assert {e["index"] for e in events[4:] if "index" in e} == {1}
    assert text == whole["content"][1]["text"]
    end = next(e for e in events if e["type"] == "message_delta")
    assert end["delta"]["stop_reason"] == whole["stop_reason"]
    assert end["usage"]["iterations"] == whole["usage"]["iterations"]
    paused = b["context_management"]["edits"][0] | {"pause_after_compaction": True}
    with http.stream("POST", "/v1/messages", json=b | {"stream": True, "context_management": {
            "edits": [paused]}}) as r:  # fmt: skip
        kinds = [json.loads(x[5:])["type"] for x in r.iter_lines() if x.startswith("data:")]
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip


def _edit(**kw) -> dict:
    return body(HISTORY, None, context_management={"edits": [{"type": "compact_20260112", **kw}]})


BAD = [
    (_edit(trigger={"type": "tool_uses", "value": 3}),
     "context_management.edits.0.trigger.type"),
    (_edit(trigger={"type": "input_tokens", "value": -1}),
     "context_management.edits.0.trigger.value"),
    (_edit(pause_after_compaction="yes"), "context_management.edits.0.pause_after_compaction"),
    (_edit(instructions=3), "context_management.edits.0.instructions"),
    (_edit(keep=3), "context_management.edits.0.keep"),
    (body([{"role": "assistant", "content": [{"type": "compaction", "content": ""}]}]),
     "messages.0.content.0.content"),
    (body([{"role": "user", "content": [{"type": "compaction", "content": "s"}]}]),
     "messages.0.content.0.type"),
]  # fmt: skip


@pytest.mark.parametrize("b, field", BAD, ids=[f for _, f in BAD])
def test_bad_compaction_parameters_are_refused_by_name(http, b, field):
    r = http.post("/v1/messages", json=b)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith(field + ":")
