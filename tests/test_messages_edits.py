"""Context editing on `POST /v1/messages` (`clear_tool_uses_20250919`), against a live server on
the tiny default model (fp32 KV, greedy):

- `applied_edits` equals a client-side model of Anthropic's documented rules (written here in
  plain Python over the Messages request, its token counts from the server's
  `/v1/messages/count_tokens`), over generated histories (hypothesis: tool uses of varying
  counts and sizes, triggers by input tokens and by tool uses, `keep`, `clear_at_least`,
  `exclude_tools`, `clear_tool_inputs`) through the function the route computes its turn with
  (`serve.http.chat_completions.render`), and over HTTP for a few of them.
- A session's edited request is a splice: its counters say the history before the first
  cleared result was reused and what follows the clears spliced, not prefilled; `leyline`
  lists the clears as directives, in the mode asked.
- Its next-token log-probabilities (the engine's, read in-process: the Messages API has none)
  equal the library's AMORTIZE of the same directives (`leyline_jax.apply_directives`), and
  with FORGET (the request's `leyline.mode`, or the server's `--context-edit-mode`) a fresh
  prefill of the edited prompt; AMORTIZE's and FORGET's differ (the control).
"""

from __future__ import annotations

import copy
import dataclasses

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("fastapi")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import leyline_jax as ll  # noqa: E402
from checkpoints.tiny import ensure_default_checkpoints  # noqa: E402
from leyline_jax.directives import Mode, apply_to_list  # noqa: E402
from serve import chat  # noqa: E402
from serve.engine import Engine  # noqa: E402
from serve.http import turn as turn_module  # noqa: E402
from serve.http.backend import Backend  # noqa: E402
from serve.http.chat_completions import render  # noqa: E402
from serve.http.messages_input import MessagesRequest, chat_request  # noqa: E402
from serve.http.server import ServerThread, parser  # noqa: E402

MODEL = "tiny"
ENGINE = dict(num_pages=192, page_size=16, max_seqs=4, kv_dtype=jnp.float32)
PLACEHOLDER = "[evicted: older tool output]"  # what a cleared tool result reads (docs/http.md)
NAMES = ("read_file", "grep", "run")
TOOLS = [
    {"name": n, "description": f"The {n} tool.",
     "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}}}
    for n in NAMES
]  # fmt: skip
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
EXAMPLES = 60
TOL = 2e-4  # fp32 log-probabilities: the same computation, batched differently


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return ll.load_model(ensure_default_checkpoints(root)["deepseek_v3"])


@pytest.fixture(scope="module")
def server(model):
    backend = Backend.for_engine(Engine(model, **ENGINE), chat.ChatTokenizer(), MODEL)
    with ServerThread(backend) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


# ---- the client side: Anthropic's rules over the request, in plain Python ---------------------
def text(k: int, n: int) -> str:
    return " ".join(WORDS[(k + i) % len(WORDS)] for i in range(n))


def history(rounds) -> list[dict]:
    """A Messages history: a question, then per round an assistant's tool uses (`rounds`: per
    round, (tool, input words, result words, is_error) per use) and the user's results, then a
    last question."""
    msgs = [{"role": "user", "content": "Look into the repository, then report."}]
    for r, uses in enumerate(rounds):
        calls, results = [], []
        for u, (tool, n_in, n_out, err) in enumerate(uses):
            uid = f"toolu_{r}_{u}"
            calls.append({"type": "tool_use", "id": uid, "name": NAMES[tool],
                          "input": {"arg": text(r + u, n_in)}})  # fmt: skip
            results.append({"type": "tool_result", "tool_use_id": uid,
                            "content": text(3 * r + u, n_out), "is_error": err})  # fmt: skip
        msgs += [{"role": "assistant", "content": [{"type": "text", "text": "Checking."}, *calls]},
                 {"role": "user", "content": results}]  # fmt: skip
    msgs.append({"role": "user", "content": "What did you find?"})
    return msgs


def body(msgs, edit=None, **extra) -> dict:
    b = {"model": MODEL, "messages": msgs, "tools": TOOLS, **extra}
    if edit is not None:
        b["context_management"] = {"edits": [edit]}
    return b


def count_tokens(http, b: dict) -> int:
    """The request's input tokens, as the server counts them (`/v1/messages/count_tokens`)."""
    keep = ("model", "messages", "tools", "system")
    r = http.post("/v1/messages/count_tokens", json={k: v for k, v in b.items() if k in keep})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def expected_edits(b: dict, count) -> list[dict]:
    """What `clear_tool_uses_20250919` does to the request `b`, by Anthropic's documented rules:
    it activates once the prompt exceeds `trigger` (its input tokens, or its tool uses); it then
    clears the oldest tool results, keeping the `keep` most recent tool uses (every tool use
    counts towards `keep`) and never clearing a tool of `exclude_tools`; a cleared result
    becomes the placeholder text, and with `clear_tool_inputs` (true, or the tool named) its
    tool use's input becomes {}; when that would clear fewer input tokens than `clear_at_least`,
    nothing is applied. Applied, it is reported as the tool uses cleared and the input tokens
    the prompt lost (`count`: a request's input tokens)."""
    edit = b["context_management"]["edits"][0]
    plain = {k: v for k, v in b.items() if k != "context_management"}
    uses = [  # (message, block) of each tool result, oldest first, with its tool's name
        (i, j, next(u["name"] for u in b["messages"][i - 1]["content"]
                    if u["type"] == "tool_use" and u["id"] == blk["tool_use_id"]))
        for i, m in enumerate(b["messages"]) if isinstance(m["content"], list)
        for j, blk in enumerate(m["content"]) if blk["type"] == "tool_result"
    ]  # fmt: skip
    trigger = edit.get("trigger", {"type": "input_tokens", "value": 100_000})
    before = count(plain)
    size = before if trigger["type"] == "input_tokens" else len(uses)
    if size <= trigger["value"]:
        return []
    keep = edit.get("keep", {"value": 3})["value"]
    excluded = set(edit.get("exclude_tools") or ())
    cleared = [u for u in uses[: max(len(uses) - keep, 0)] if u[2] not in excluded]
    if not cleared:
        return []
    after = copy.deepcopy(plain)
    inputs = edit.get("clear_tool_inputs", False)
    for i, j, name in cleared:
        result = after["messages"][i]["content"][j]
        result["content"], result["is_error"] = PLACEHOLDER, False
        if inputs is True or (isinstance(inputs, list) and name in inputs):
            for u in after["messages"][i - 1]["content"]:
                if u.get("id") == result["tool_use_id"]:
                    u["input"] = {}
    tokens = max(before - count(after), 0)
    least = (edit.get("clear_at_least") or {}).get("value", 0)
    if tokens < least:
        return []
    return [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": len(cleared),
             "cleared_input_tokens": tokens}]  # fmt: skip


def served_edits(server, b: dict) -> list[dict]:
    """`applied_edits` as the route computes it for `b` without a session (its turn:
    `serve.http.chat_completions.render` over the chat request the message runs as)."""
    backend = server.backend
    req = chat_request(MessagesRequest.model_validate(b | {"max_tokens": 1}), None)
    turn = render(req, None, backend.tokenizer, backend.sessions, backend.max_seq_len)
    return turn.applied_edits


# ---- generated histories -------------------------------------------------------------------
USE = st.tuples(
    st.integers(0, len(NAMES) - 1), st.integers(1, 12), st.integers(0, 60), st.booleans()
)


@st.composite
def cases(draw):
    rounds = draw(st.lists(st.lists(USE, min_size=1, max_size=2), min_size=0, max_size=6))
    n_uses = sum(map(len, rounds))
    edit: dict = {"type": "clear_tool_uses_20250919"}
    if draw(st.booleans()):
        edit["trigger"] = {"type": "tool_uses", "value": draw(st.integers(0, n_uses + 1))}
    else:  # a fraction of a history's likely size, so both sides of the trigger come up
        edit["trigger"] = {"type": "input_tokens", "value": draw(st.integers(0, 120 * n_uses))}
    if draw(st.booleans()):
        edit["keep"] = {"type": "tool_uses", "value": draw(st.integers(0, 4))}
    if draw(st.booleans()):
        edit["clear_at_least"] = {"type": "input_tokens", "value": draw(st.integers(0, 300))}
    if draw(st.booleans()):
        edit["exclude_tools"] = draw(st.lists(st.sampled_from(NAMES), max_size=2, unique=True))
    inputs = draw(st.sampled_from([None, True, False, "list"]))
    if inputs == "list":
        edit["clear_tool_inputs"] = draw(st.lists(st.sampled_from(NAMES), max_size=2, unique=True))
    elif inputs is not None:
        edit["clear_tool_inputs"] = inputs
    return body(history(rounds), edit)


def test_applied_edits_equal_anthropics_rules(server, http):
    """Over generated histories, the route's `applied_edits` is the client-side model's; both
    sides of every parameter come up (edits applied and not, `clear_at_least` refusing)."""
    seen: dict[str, int] = {"applied": 0, "none": 0, "refused by clear_at_least": 0, "all": 0}

    @given(b=cases())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def run(b):
        want = expected_edits(b, lambda x: count_tokens(http, x))
        assert served_edits(server, b) == want, b
        seen["all"] += 1
        seen["applied" if want else "none"] += 1
        if not want and b["context_management"]["edits"][0].get("clear_at_least"):
            loose = copy.deepcopy(b)
            del loose["context_management"]["edits"][0]["clear_at_least"]
            seen["refused by clear_at_least"] += bool(
                expected_edits(loose, lambda x: count_tokens(http, x))
            )

    run()
    assert seen["all"] >= 50 and seen["applied"] >= 10 and seen["none"] >= 10, seen
    assert seen["refused by clear_at_least"] >= 1, seen


HTTP_CASES = [
    body(history([[(0, 4, 40, False)], [(1, 6, 50, True), (2, 3, 20, False)], [(0, 2, 30, False)]]),
         {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
          "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["run"],
          "clear_tool_inputs": True}),
    body(history([[(0, 4, 40, False)], [(1, 6, 5, False)], [(2, 2, 30, False)]]),
         {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
          "keep": {"type": "tool_uses", "value": 1}, "clear_at_least":
          {"type": "input_tokens", "value": 5000}}),
    body(history([[(1, 8, 45, False), (0, 3, 25, False)], [(2, 5, 35, False)]]),
         {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
          "keep": {"type": "tool_uses", "value": 0}, "clear_tool_inputs": ["grep"]}),
]  # fmt: skip


@pytest.mark.parametrize("k", range(len(HTTP_CASES)))
def test_the_route_reports_the_same(server, http, k):
    """Over HTTP (one token each), `context_management.applied_edits` is the model's."""
    b = HTTP_CASES[k] | {"max_tokens": 1, "temperature": 0}
    r = http.post("/v1/messages", json=b)
    assert r.status_code == 200, r.text
    got = r.json()["context_management"]["applied_edits"]
    assert got == expected_edits(b, lambda x: count_tokens(http, x)) == served_edits(server, b)
    assert bool(got) == (k != 1)  # the second: refused by clear_at_least


# ---- the splice and its log-probabilities ---------------------------------------------------
EDIT = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
        "keep": {"type": "tool_uses", "value": 1}}  # fmt: skip
ROUNDS = [[(0, 5, 50, False)], [(1, 6, 45, False)], [(2, 4, 40, False)]]


@dataclasses.dataclass
class Served:
    old: list[int]  # the session's tokens after turn 1 (its prompt and output)
    final: list[int]  # turn 2's prompt (edited)
    directives: list[ll.Directive]  # turn 2's clears, in its unedited prompt's coordinates
    usage: dict
    logprobs: tuple  # turn 2's first token: ((id, log-probability) of the 20 most likely)
    applied: list[dict]


@pytest.fixture
def logged(monkeypatch):
    """Every turn's engine request, its first token's 20 most likely alternatives asked."""
    jobs = []
    sampling, start = turn_module.Turns.sampling, turn_module.Turns.start

    def asking(self, *a, **kw):
        return dataclasses.replace(sampling(self, *a, **kw), logprobs=20)

    def keeping(self, *a, **kw):
        jobs.append(start(self, *a, **kw))
        return jobs[-1]

    monkeypatch.setattr(turn_module.Turns, "sampling", asking)
    monkeypatch.setattr(turn_module.Turns, "start", keeping)
    return jobs


def two_turns(http, jobs, session: str, leyline: dict | None = None) -> Served:
    """Turn 1: a tool-using history, no edit; turn 2: it, the reply and a question, with
    `EDIT` (the two older tool results cleared), in the session."""
    hdr = {"X-Session-Id": session}
    opts = {"return_token_ids": True}
    first = body(history(ROUNDS), max_tokens=2, temperature=0, leyline=opts)
    r1 = http.post("/v1/messages", json=first, headers=hdr).json()
    said = [b for b in r1["content"] if b["type"] == "text"]
    assert said and r1["stop_reason"] == "max_tokens", r1  # a reply to send back, as sampled
    old = r1["leyline"]["prompt_token_ids"] + r1["leyline"]["output_token_ids"]
    msgs = [*first["messages"], {"role": "assistant", "content": said},
            {"role": "user", "content": "Go on."}]  # fmt: skip
    second = body(msgs, EDIT, max_tokens=1, temperature=0, leyline=opts | (leyline or {}))
    r2 = http.post("/v1/messages", json=second, headers=hdr)
    assert r2.status_code == 200, r2.text
    r2 = r2.json()
    final = r2["leyline"]["prompt_token_ids"]
    ds, shift = [], 0  # each directive's replacement read off the edited prompt
    for d in r2["leyline"]["directives"]:
        at = d["start"] + shift
        repl = final[at : at + d["replacement_tokens"]]
        ds.append(ll.Directive(d["start"], d["end"], repl, Mode[d["mode"].upper()]))
        shift += d["replacement_tokens"] - (d["end"] - d["start"])
    applied = r2["context_management"]["applied_edits"]
    assert applied == expected_edits(second, lambda x: count_tokens(http, x))
    job = jobs[-1]
    return Served(old, final, ds, r2["usage"], job.request.logprobs[0][1], applied)


def splice_holds(s: Served, tok, mode: Mode) -> None:
    """The clears are directives in `mode` over the session's tokens: the tokens before the
    first reused, the rest spliced (AMORTIZE) or prefilled again (FORGET); each replacement is
    the placeholder's tokens (less what the cleared text shares at its ends)."""
    assert [a["cleared_tool_uses"] for a in s.applied] == [2]
    assert len(s.directives) == 2 and all(d.mode is mode for d in s.directives)
    stub = tok.encode(PLACEHOLDER)
    for d in s.directives:
        r = list(d.replacement)
        assert r and any(stub[i : i + len(r)] == r for i in range(len(stub))), d
    assert s.directives[-1].end < len(s.old) - 1  # both inside what the session holds
    kept = apply_to_list(s.old, s.directives)
    assert s.final[: len(kept)] == kept  # turn 2 is the session, edited, then the new turn
    u, cached = s.usage, len(s.old) - 1  # the last sampled token was never fed
    first = s.directives[0].start
    spliced = cached - first - sum(d.end - d.start for d in s.directives)
    assert u["reused_tokens"] == first
    assert u["spliced_tokens"] == (spliced if mode is Mode.AMORTIZE else 0)
    assert u["cache_read_input_tokens"] == u["reused_tokens"] + u["spliced_tokens"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == len(s.final)


def log_softmax(logits) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)))


def reference(model, s: Served, recompute=0) -> tuple[np.ndarray, np.ndarray]:
    """(the library's AMORTIZE of the served directives over the session's KV, each with the
    `recompute` budget, then the rest of the prompt; a fresh prefill of the edited prompt):
    next-token log-probabilities."""
    state = ll.init_state(model.config, num_pages=96, page_size=16, max_seqs=2,
                          kv_dtype=jnp.float32)  # fmt: skip
    state, _ = ll.prefill(model, state, 0, s.old[:-1])
    ds = [dataclasses.replace(d, mode=Mode.AMORTIZE, recompute=recompute) for d in s.directives]
    state = ll.apply_directives(model, state, 0, ds)
    have = len(apply_to_list(s.old[:-1], ds))
    assert s.final[:have] == ll.tokens(state, 0)
    state, amortized = ll.prefill(model, state, 0, s.final[have:])
    state, fresh = ll.prefill(model, state, 1, s.final)
    return log_softmax(amortized), log_softmax(fresh)


def gap(top, ref: np.ndarray) -> float:
    """The largest difference between served log-probabilities and `ref`'s, at the served ids."""
    return max(abs(lp - float(ref[i])) for i, lp in top)


def test_cleared_results_are_spliced_and_equal_the_library(server, http, model, logged):
    """AMORTIZE (the default), FORGET asked by the request, FORGET as the server's default:
    each a splice with its counters, next-token log-probabilities equal to the library's
    AMORTIZE and to a fresh prefill of the edited prompt, and the two different."""
    tok = server.backend.tokenizer
    amortize = two_turns(http, logged, "edits-amortize")
    splice_holds(amortize, tok, Mode.AMORTIZE)
    forget = two_turns(http, logged, "edits-forget", {"mode": "forget"})
    splice_holds(forget, tok, Mode.FORGET)
    context = server.backend.sessions.context
    context.mode = "forget"  # what --context-edit-mode forget sets
    try:
        default = two_turns(http, logged, "edits-default")
        explicit = two_turns(http, logged, "edits-explicit", {"mode": "amortize"})
    finally:
        context.mode = "amortize"
    splice_holds(default, tok, Mode.FORGET)
    splice_holds(explicit, tok, Mode.AMORTIZE)  # a mode the request names wins

    # one history, so one reference: the same session tokens, directives and edited prompt
    assert amortize.old == forget.old == default.old and amortize.final == forget.final
    assert [(d.start, d.end, d.replacement) for d in amortize.directives] == [
        (d.start, d.end, d.replacement) for d in forget.directives
    ]
    ref_amortize, ref_fresh = reference(model, amortize)
    assert gap(amortize.logprobs, ref_amortize) < TOL
    assert gap(forget.logprobs, ref_fresh) < TOL
    assert gap(default.logprobs, ref_fresh) < TOL
    # the control: AMORTIZE keeps the cleared results' influence downstream, FORGET does not
    assert gap(amortize.logprobs, ref_fresh) > 50 * TOL
    assert gap(forget.logprobs, ref_amortize) > 50 * TOL


def test_a_recompute_budget_equals_the_library(server, http, model, logged):
    """`leyline.recompute` (and the server's `--recompute` when a request names none): the
    clears' splices recompute that fraction of their downstream, the next-token
    log-probabilities equal the library's AMORTIZE with the same budget, and differ from the
    plain splice's (the control)."""
    tok = server.backend.tokenizer
    asked = two_turns(http, logged, "edits-recompute", {"recompute": 0.4})
    splice_holds(asked, tok, Mode.AMORTIZE)
    ref, _ = reference(model, asked, 0.4)
    assert gap(asked.logprobs, ref) < TOL and asked.usage["recomputed_tokens"] > 0
    assert gap(asked.logprobs, reference(model, asked)[0]) > 50 * TOL
    scheduler = server.backend.worker.engine.scheduler
    config = scheduler.config
    scheduler.config = dataclasses.replace(config, recompute=0.4)  # what --recompute 0.4 sets
    try:
        default = two_turns(http, logged, "edits-recompute-default")
    finally:
        scheduler.config = config
    assert gap(default.logprobs, ref) < TOL
    assert default.usage["recomputed_tokens"] == asked.usage["recomputed_tokens"]
    bad = body(history(ROUNDS), max_tokens=1, leyline={"recompute": 1.5})
    r = http.post("/v1/messages", json=bad)
    assert r.status_code == 400 and "leyline.recompute" in r.json()["error"]["message"], r.text
    assert parser().parse_args(["--recompute", "0.4"]).recompute == 0.4
    assert parser().parse_args(["--recompute", "600"]).recompute == 600
    with pytest.raises(SystemExit):
        parser().parse_args(["--recompute", "1.5"])


def test_the_server_default_is_a_flag():
    """`--context-edit-mode` (default amortize) is what a backend's context editor uses."""
    assert parser().parse_args([]).context_edit_mode == "amortize"
    assert parser().parse_args(["--context-edit-mode", "forget"]).context_edit_mode == "forget"
    with pytest.raises(SystemExit):
        parser().parse_args(["--context-edit-mode", "later"])
