"""An OpenAI-compatible HTTP server over the engine, with the edit channel.

    python -m serve.http --model PATH|tiny|smollm2 [--port 8000] [--host 127.0.0.1]
                         [--num-pages 512] [--page-size 16] [--max-seqs 16] [--kv-dtype bf16]
                         [--max-queue 64] [--warmup] [--compile-cache DIR|off]
                         [--snapshot-dir DIR]

Endpoints: `POST /v1/chat/completions` (SSE streaming or not; `tools` rendered in the model's
chat layout by `serve.chat.render`, tool calls in the output parsed back into `tool_calls`),
`POST /v1/completions` (text or token ids), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus text), `DELETE /v1/sessions/{id}`, `POST /v1/snapshot`.

Threads. The engine runs on one thread that owns the device (`EngineWorker`): requests reach it
through a queue of commands (submit, cancel, close); after every engine step it hands each
request's newly sampled tokens to that request's asyncio queue, so streaming is real (a token
leaves as soon as the step that sampled it ends). The HTTP side (FastAPI on uvicorn's event
loop) never touches the engine.

Sessions and the edit channel. A request names its conversation with `session_id` in the body
or an `X-Session-Id` header (the response repeats it in both places). The harness re-sends the
whole history as usual; the server renders it and the engine diffs it against the session's
tokens (`Engine.submit_prompt`, `serve.edits`): an unmodified harness that edits its own
history (clears a tool output, say) gets a splice instead of a re-prefill from the edit on:
AMORTIZE by default, FORGET with `"leyline": {"mode": "forget"}`. A request without a session
runs in a session of its own, closed when it ends: it gets the radix cache's clean prefixes
(what a fresh prefill would give) and never another session's spliced KV (the engine's lineage
rule, `serve.lineage`, unchanged over HTTP).

Usage, in every response (streams: the chunk that finishes, or the extra chunk
`stream_options.include_usage` asks for): `prompt_tokens`, `completion_tokens`,
`prompt_tokens_details.cached_tokens` (reused + spliced), and ours: `reused_tokens`,
`spliced_tokens`, `prefilled_tokens` (cached + prefilled = prompt).

Bad input: OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`) with the
offending field in `param`: 400 for an invalid body, an unknown model, a prompt over the
context limit, token ids outside the vocabulary; 429 with `Retry-After` when the engine's queue
is full, 503 with `Retry-After` while the engine is not running. A client that disconnects
mid-stream (or before a non-streaming answer) cancels its turn: the engine stops working on it
at the next step and a session of its own is closed (its pages go back to the pool).

Tokenizers. A checkpoint gets `serve.chat.tokenizer_for(path)` (a GGUF file: its own tokenizer
and ChatML; anything else: DeepSeek's tokenizer and layout). A model whose vocabulary is smaller
than its tokenizer's, such as the embedded tiny default (256 ids) with DeepSeek's tokenizer
(129,280), gets `ModVocabTokenizer`: every id the tokenizer makes is taken modulo the model's
vocabulary. The chat layout and its exact per-message spans are kept (DeepSeek's BOS and EOS,
ids 0 and 1, are the tiny model's own); text decodes through the tokenizer's first ids (bytes
and a few specials). Good for exercising the server; the text itself is of course noise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import os
import queue
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Header, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve import chat
from serve.engine import TurnCancelled
from serve.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_param,
)

log = logging.getLogger("serve.http")

__all__ = [
    "APIError",
    "Backend",
    "EngineWorker",
    "ModVocabTokenizer",
    "ServerThread",
    "build_app",
    "free_port",
    "load_backend",
    "main",
    "parse_tool_calls",
]

DEFAULT_MAX_TOKENS = 256  # chat completions without max_tokens: this, within the context
# the X-Session-Id header: names the conversation, like the body's `session_id`
SessionHeader = Annotated[str | None, Header(min_length=1, max_length=256)]


# ---- tokenizers ---------------------------------------------------------------------------
class ModVocabTokenizer:
    """A `serve.chat.ChatTokenizer` for a model with a smaller vocabulary: every id it makes
    (text and special tokens) is taken modulo `vocab`; decoding reads ids as the base
    tokenizer's own. Duck-types what `serve.chat.render` uses (`format`, `encode`, `special`)."""

    def __init__(self, base, vocab: int):
        self.base, self.format, self.vocab_size = base, base.format, int(vocab)

    def encode(self, text: str) -> list[int]:
        return [i % self.vocab_size for i in self.base.encode(text)]

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self.base.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special(self, token: str) -> int:
        return self.base.special(token) % self.vocab_size

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        return (self.special(self.format.stop),)


# ---- tool calls in the output -------------------------------------------------------------
HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"


def tool_markers(tokenizer) -> tuple[str, ...]:
    """The text that opens a tool call in the tokenizer's chat format."""
    return (HERMES_BEGIN,) if tokenizer.format.name == "chatml" else (chat.CALLS_BEGIN,)


def _fenced(text: str) -> str:
    m = re.fullmatch(r"\s*```(?:json)?\s*\n?(.*?)\n?```\s*", text, re.S)
    return (m.group(1) if m else text).strip()


def _call(name: str, args) -> dict:
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name.strip(), "arguments": args},
    }


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content, tool_calls) of a generated reply. Understands DeepSeek's layout, V3's
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{args}\\n```<｜tool▁call▁end｜>`
    and V3.1's `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{args}<｜tool▁call▁end｜>` inside
    `<｜tool▁calls▁begin｜>` ... (end optional: a reply cut by its budget), and the Hermes
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks of the ChatML layout.
    Content is the text before the first call; a reply whose calls do not parse is all
    content, with no calls."""
    calls: list[dict] = []
    if chat.CALLS_BEGIN in text:
        content, rest = text.split(chat.CALLS_BEGIN, 1)
        rest = rest.split(chat.CALLS_END, 1)[0]
        for body in rest.split(chat.CALL_BEGIN)[1:]:
            body = body.split(chat.CALL_END, 1)[0]
            if chat.TOOL_SEP not in body:
                return text, []
            left, right = body.split(chat.TOOL_SEP, 1)
            if left.strip() in ("function", ""):  # V3: type, then "name\n```json ...```"
                name, _, args = right.partition("\n")
            else:  # V3.1: name, then the arguments
                name, args = left, right
            args = _fenced(args)
            if not name.strip():
                return text, []
            calls.append(_call(name, args))
        return (content, calls) if calls else (text, [])
    if HERMES_BEGIN in text:
        content = text.split(HERMES_BEGIN, 1)[0]
        for body in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
            try:
                obj = json.loads(body)
                calls.append(_call(obj["name"], obj.get("arguments", {})))
            except (ValueError, KeyError, TypeError, AttributeError):
                return text, []
        return (content, calls) if calls else (text, [])
    return text, []


class OutputText:
    """Text of a turn's output as it grows: the deltas safe to send (a multi-byte character
    is complete, no stop string or tool-call marker may be starting), where a stop string cut
    it, and the text before the first tool-call marker (what streams as content)."""

    def __init__(
        self, tokenizer, stop_ids: Sequence[int], stops: Sequence[str], markers: Sequence[str]
    ):
        self.tok, self.stop_ids = tokenizer, set(stop_ids)
        self.stops, self.markers = list(stops), list(markers)
        self.sent = 0  # characters of content sent
        self.stopped = False  # a stop string was found
        self.text = ""

    def update(self, ids: Sequence[int], final: bool = False) -> str:
        """The new content to send after the output became `ids`."""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.tok.decode(ids)
        if not final:
            text = text.rstrip("\ufffd")  # a multi-byte character may still be arriving
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped, final = text[:cut], True, True
        self.text = text
        visible = text
        m = min((i for i in (text.find(s) for s in self.markers) if i >= 0), default=-1)
        if m >= 0:
            visible = text[:m]
        elif not final:  # hold back what may be the start of a stop string or a marker
            hold = 0
            for s in self.stops + self.markers:
                for k in range(min(len(s) - 1, len(visible)), hold, -1):
                    if visible.endswith(s[:k]):
                        hold = k
                        break
            visible = visible[: len(visible) - hold]
        delta = visible[self.sent :]
        self.sent = max(self.sent, len(visible))
        return delta


class ReplyMemory:
    """The token ids of each session's replies, in order, with the text the server returned
    for them. A harness re-sends a reply as text; re-encoding text need not give back the ids
    the model sampled (and never does for `ModVocabTokenizer`), which would make the session's
    diff see an edit at every reply. Rendering a re-sent assistant message whose content is a
    remembered reply (and that carries no tool calls) uses the sampled ids instead, so an
    unedited history is a pure extension of the session. Re-sent replies are matched to the
    remembered ones in order (two replies with the same text may have different ids), skipping
    any the harness dropped. Event-loop thread only."""

    def __init__(self, per_session: int = 512, sessions: int = 4096):
        self.per_session, self.max_sessions = per_session, sessions
        self._by_session: collections.OrderedDict[str, list[tuple[str, list[int]]]] = (
            collections.OrderedDict()
        )

    def remember(self, session: str, text: str, ids: Sequence[int]) -> None:
        replies = self._by_session.setdefault(session, [])
        self._by_session.move_to_end(session)
        replies.append((text, list(ids)))
        del replies[: max(0, len(replies) - self.per_session)]
        while len(self._by_session) > self.max_sessions:
            self._by_session.popitem(last=False)

    def forget(self, session: str) -> None:
        self._by_session.pop(session, None)

    def export(self) -> dict[str, list[tuple[str, list[int]]]]:
        """Everything remembered (a snapshot's part), oldest session first."""
        return {k: [(t, list(i)) for t, i in v] for k, v in self._by_session.items()}

    def load(self, data: dict) -> None:
        self._by_session = collections.OrderedDict(
            (str(k), [(str(t), [int(x) for x in i]) for t, i in v]) for k, v in data.items()
        )

    def substitute(self, session: str | None, messages: list[dict], rendered) -> list[int]:
        """`rendered.tokens` with remembered replies' ids in their messages' content spans."""
        replies = self._by_session.get(session) if session is not None else None
        if not replies:
            return list(rendered.tokens)
        found = []  # (span, ids), in message order
        j = 0
        for span in sorted(rendered.spans, key=lambda sp: sp.content_start):
            m = messages[span.index]
            if span.role != "assistant" or m.get("tool_calls"):
                continue
            text = m.get("content") or ""
            k = next((k for k in range(j, len(replies)) if replies[k][0] == text), None)
            if k is not None:
                found.append((span, replies[k][1]))
                j = k + 1
        toks = list(rendered.tokens)
        for span, ids in reversed(found):
            toks[span.content_start : span.content_end] = ids
        return toks


# ---- explicit directives and server-side context editing -----------------------------------
def edit_messages(messages: list[dict], directives) -> list[dict]:
    """The history with each `MessageDirective` applied: messages i..j become message i, its
    content the replacement, without tool calls (see `serve.openai_api.MessageDirective`)."""
    out = [dict(m) for m in messages]
    for d in sorted(directives, key=lambda d: d.messages, reverse=True):
        i, j = d.messages
        m = out[i]
        m["content"] = d.replacement
        m.pop("tool_calls", None)
        del out[i + 1 : j + 1]
    return out


def token_directives(prompt, edited, spans, edited_spans, directives, default_mode) -> list:
    """The token-level directives (in `prompt`'s coordinates) that turn the rendered history
    `prompt` into the rendered edited history `edited` (`spans`, `edited_spans`: their
    message spans): one per message directive, replacing its messages' tokens by the edited
    message's, less the tokens they begin and end with alike (role markup, shared text), in
    its mode. When the layout renders more than those messages differently (a chat format
    that groups neighbouring messages, say), the two renders are diffed instead
    (`serve.edits.detect_edits`) and each edit takes the strongest mode of the directives it
    touches."""
    from leyline_jax.directives import Directive, Mode, apply_to_list
    from serve.edits import detect_edits, strongest

    modes = {"amortize": Mode.AMORTIZE, "forget": Mode.FORGET}
    by_index = {sp.index: sp for sp in spans}
    new_index = {sp.index: sp for sp in edited_spans}
    out, regions, removed = [], [], 0
    for d in sorted(directives, key=lambda d: d.messages):
        i, j = d.messages
        a, b = by_index[i].start, by_index[j].end
        e = new_index[i - removed]
        repl = list(edited[e.start : e.end])
        removed += j - i
        while a < b and repl and prompt[a] == repl[0]:
            a, repl = a + 1, repl[1:]
        while a < b and repl and prompt[b - 1] == repl[-1]:
            b, repl = b - 1, repl[:-1]
        mode = modes[d.mode or default_mode]
        regions.append((by_index[i].start, by_index[j].end, mode))
        if a < b or repl:
            out.append(Directive(a, b, tuple(repl), mode))
    if apply_to_list(prompt, out) == list(edited):
        return out
    ds, tail = detect_edits(prompt, edited)
    if tail:  # an edit reaching the end of the history: one directive to the end
        if ds and ds[-1].end == len(prompt):
            last = ds.pop()
            ds.append(Directive(last.start, last.end, last.replacement + tuple(tail)))
        else:
            ds.append(Directive(len(prompt), len(prompt), tuple(tail)))
    out = []
    for d in ds:
        hit = [m for a, b, m in regions if d.start < b and a < max(d.end, d.start + 1)]
        mode = strongest(hit or [m for _, _, m in regions])
        out.append(Directive(d.start, d.end, d.replacement, mode))
    return out


class ContextEditor:
    """Anthropic-style context editing (`clear_tool_uses_20250919`) applied by the server:
    `serve.policies.ClearToolUses` with the request's parameters, over the session's own
    record of what it cleared (so what was cleared stays cleared, and the session's cache
    keeps hitting after the edit). Tokens are the server's tokenizer's. Event-loop thread
    only."""

    def __init__(self, count_tokens):
        self.count = count_tokens
        self.cleared: dict[str, set[int]] = {}

    def apply(self, key: str | None, messages: list[dict], edit) -> tuple[list[dict], dict]:
        """(the edited history, the `applied_edits` entry: tool uses cleared in the history
        the model runs, and the input tokens that removed)."""
        from serve.policies import ClearToolUses

        trig = edit.trigger
        policy = ClearToolUses(
            trigger_input_tokens=trig.value if trig.type == "input_tokens" else None,
            trigger_tool_uses=trig.value if trig.type == "tool_uses" else None,
            keep=edit.keep.value,
            clear_at_least=edit.clear_at_least.value if edit.clear_at_least else 0,
            exclude_tools=tuple(edit.exclude_tools or ()),
            clear_tool_inputs=(
                edit.clear_tool_inputs
                if isinstance(edit.clear_tool_inputs, bool)
                else tuple(edit.clear_tool_inputs)
            ),
            count_tokens=self.count,
        )
        name = key if key is not None else f"request-{uuid.uuid4().hex}"
        policy.cleared = {name: self.cleared.setdefault(name, set()) if key else set()}
        out = policy.apply(name, messages)
        uses, tokens = policy.applied(name, messages)
        report = {
            "type": "clear_tool_uses_20250919",
            "cleared_tool_uses": uses,
            "cleared_input_tokens": tokens,
        }
        return out, report

    def forget(self, key: str) -> None:
        self.cleared.pop(key, None)


# ---- the engine thread ----------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request's turn, as the engine thread tracks it."""

    prompt: list[int]
    sampling: object  # SamplingParams
    mode: object  # Mode
    session_key: str | None  # None: a session of its own, closed when the turn ends
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    directives: list = dataclasses.field(default_factory=list)  # in `prompt`'s coordinates
    incremental: bool = True  # tokens as each step samples them (else once, at the end)
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    request: object = None  # the engine's Request, once submitted
    sid: int | None = None
    sent: int = 0
    cancelled: bool = False
    done: bool = False

    def post(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


class QueueFull(RuntimeError):
    pass


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "leyline_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.turns = Counter(
            "leyline_turns", "Turns the engine ended, by outcome", ["outcome"], registry=r
        )
        self.prompt_tokens = Counter(
            "leyline_prompt_tokens",
            "Prompt tokens of finished turns, by where their KV came from",
            ["source"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "leyline_completion_tokens", "Generated tokens", registry=r
        )
        self.hit_rate = Gauge(
            "leyline_cache_hit_rate",
            "(reused + spliced) / prompt tokens over all finished turns",
            registry=r,
        )
        self.queue_depth = Gauge("leyline_queue_depth", "Turns waiting for admission", registry=r)
        self.running = Gauge("leyline_running_turns", "Turns running", registry=r)
        self.free_pages = Gauge("leyline_free_pages", "Free KV pages in the pool", registry=r)
        self.sessions = Gauge("leyline_sessions", "Open engine sessions", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram(
            "leyline_ttft_seconds", "Arrival to first token", buckets=buckets, registry=r
        )
        self.step = Histogram(
            "leyline_step_seconds", "One engine step", buckets=buckets, registry=r
        )
        self.latency = Histogram(
            "leyline_turn_seconds", "Arrival to the turn's end", buckets=buckets, registry=r
        )
        self._prompt = self._cached = 0

    def turn_done(self, job: Job) -> None:
        st = job.request.stats
        self.prompt_tokens.labels("reused").inc(st.reused_tokens)
        self.prompt_tokens.labels("spliced").inc(st.spliced_tokens)
        self.prompt_tokens.labels("prefilled").inc(st.prefilled_tokens)
        self.completion_tokens.inc(len(job.request.output))
        self._prompt += st.prompt_tokens
        self._cached += st.reused_tokens + st.spliced_tokens
        self.hit_rate.set(self._cached / self._prompt if self._prompt else 0.0)
        if st.first_token_s is not None:
            self.ttft.observe(st.first_token_s - job.arrived)
        if st.finished_s is not None:
            self.latency.observe(st.finished_s - job.arrived)


class EngineWorker:
    """The thread that owns the engine. Everything else talks to it through `commands`."""

    def __init__(self, engine, metrics: Metrics, max_queue: int = 64):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.commands: queue.Queue = queue.Queue()
        self.sessions: dict[str, int] = {}  # HTTP session id -> engine session
        self.jobs: list[Job] = []  # submitted, not yet ended (engine thread only)
        self.pending = 0  # jobs accepted and not yet ended (guarded by _lock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="leyline-engine", daemon=True)

    # -- called from the HTTP side ------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.commands.put(("wake",))
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stop.is_set()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.pending >= self.max_queue:
                raise QueueFull(f"{self.pending} requests in flight (the limit)")
            self.pending += 1
        self.commands.put(("submit", job))

    def cancel(self, job: Job) -> None:
        if not job.done:
            job.cancelled = True
            self.commands.put(("cancel", job))

    def close_session(self, key: str, loop, fut) -> None:
        self.commands.put(("close", key, loop, fut))

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                block = eng.idle() and not self.jobs
                cmd = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
                self._handle(cmd)
                while True:
                    self._handle(self.commands.get_nowait())
            except queue.Empty:
                pass
            try:
                if not eng.idle():
                    t0 = time.perf_counter()
                    eng.step()
                    self.metrics.step.observe(time.perf_counter() - t0)
                self._publish()
            except Exception as e:  # an engine bug: fail what is in flight, keep serving
                log.exception("engine step failed")
                self.error = e
                for job in list(self.jobs):
                    if job.request is not None:
                        eng.cancel(job.request)
                    self._end(job, ("error", e))
        for job in list(self.jobs):
            if job.request is not None:
                eng.cancel(job.request)
            self._end(job, ("error", RuntimeError("the server is shutting down")))

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "submit":
            self._submit(cmd[1])
        elif kind == "cancel":
            job = cmd[1]
            if job.request is not None and not job.done:
                self.engine.cancel(job.request)
        elif kind == "close":
            _, key, loop, fut = cmd
            try:
                sid = self.sessions[key]
                busy = any(j.sid == sid for j in self.jobs)
                if busy:
                    raise ValueError(f"session {key!r} has a turn in flight")
                self.engine.close_session(sid)
                del self.sessions[key]
                result = None
            except (KeyError, ValueError) as e:
                result = e
            loop.call_soon_threadsafe(fut.set_result, result)
        elif kind == "snapshot":
            _, root, extra, loop, fut = cmd
            try:
                result = self.snapshot(root, extra)
            except (OSError, ValueError) as e:
                log.exception("snapshot failed")
                result = e
            loop.call_soon_threadsafe(fut.set_result, result)

    def snapshot(self, root, extra: dict) -> Path:
        """Save the engine's sessions under `root` (`serve.snapshot.save`), with the HTTP
        sessions' names and `extra`. On the engine thread between steps, or once it stopped."""
        from serve import snapshot

        return snapshot.save(self.engine, root, {**extra, "http_sessions": dict(self.sessions)})

    def request_snapshot(self, root, extra: dict, loop, fut) -> None:
        self.commands.put(("snapshot", root, extra, loop, fut))

    def _submit(self, job: Job) -> None:
        eng = self.engine
        if job.cancelled:
            self._end(job, ("error", TurnCancelled("the turn was cancelled")), submitted=False)
            return
        try:
            if job.session_key is None:
                job.sid = eng.open_session()
            else:
                job.sid = self.sessions.get(job.session_key)
                if job.sid is None:
                    job.sid = self.sessions[job.session_key] = eng.open_session()
            job.request = eng.submit_prompt(
                job.sid, job.prompt, mode=job.mode, sampling=job.sampling, directives=job.directives
            )
        except (ValueError, KeyError) as e:
            self._end(job, ("error", e), submitted=False)
            return
        self.jobs.append(job)

    def _publish(self) -> None:
        eng = self.engine
        for job in list(self.jobs):
            r = job.request
            if len(r.output) > job.sent and (job.incremental or r.finished):
                job.post("tokens", list(r.output[job.sent :]))
                job.sent = len(r.output)
            if r.finished:
                if r.error is None:
                    self.metrics.turn_done(job)
                self._end(job, ("error", r.error) if r.error else ("done", r.stats))
        running = sum(1 for j in self.jobs if j.request.status in ("prefill", "decode"))
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(len(self.jobs) - running)
        from leyline_jax import kv_state

        self.metrics.free_pages.set(len(kv_state.free_pages(eng.state)))
        self.metrics.sessions.set(len(eng.sessions))

    def _end(self, job: Job, event, submitted: bool = True) -> None:
        if job.done:
            return
        job.done = True
        if job in self.jobs:
            self.jobs.remove(job)
        outcome = event[0] if event[0] == "done" else type(event[1]).__name__
        self.metrics.turns.labels(outcome).inc()
        if job.session_key is None and job.sid is not None:
            try:
                self.engine.close_session(job.sid)  # its pages back; clean prefix stays
            except (KeyError, ValueError):
                log.exception("closing session %s", job.sid)
        with self._lock:
            self.pending -= 1
        job.post(*event)


# ---- the backend: model, tokenizer, engine, worker --------------------------------------------
@dataclasses.dataclass
class Backend:
    """What the app serves: the engine's worker, the tokenizer, the model's public name."""

    worker: EngineWorker
    tokenizer: object
    model_name: str
    max_seq_len: int
    vocab_size: int
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    request_timeout_s: float = 600.0
    snapshot_dir: str | None = None  # durable sessions: restored at start, saved at shutdown
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def metrics(self) -> Metrics:
        return self.worker.metrics

    @classmethod
    def for_engine(cls, engine, tokenizer, model_name: str, *, max_queue: int = 64, **kw):
        vocab = engine.model.config.vocab_size
        if tokenizer.vocab_size > vocab:
            tokenizer = ModVocabTokenizer(tokenizer, vocab)
        worker = EngineWorker(engine, Metrics(), max_queue=max_queue)
        return cls(worker, tokenizer, model_name, engine.state.max_seq_len, vocab, **kw)


def load_backend(
    model: str = "tiny",
    *,
    root: str = ".checkpoints",
    name: str | None = None,
    num_pages: int = 512,
    page_size: int = 16,
    max_seqs: int = 16,
    kv_dtype: str = "bf16",
    prefill_chunk: int = 256,
    max_queue: int = 64,
    warmup: bool = False,
    **kw,
) -> Backend:
    """Load a model ("tiny": the embedded default, written under `root`; "smollm2"; a
    checkpoint directory or .gguf file), its tokenizer and an engine (not started)."""
    import jax.numpy as jnp

    import leyline_jax as ll
    from serve.engine import Engine

    if model == "tiny":
        from checkpoints.tiny import ensure_default_checkpoints

        path = str(ensure_default_checkpoints(root)["deepseek_v3"])
        tokenizer = chat.ChatTokenizer()
    else:
        path = chat.model_path(model)
        tokenizer = chat.tokenizer_for(path)
    m = ll.load_model(path)
    dtypes = {
        "bf16": jnp.bfloat16,
        "fp32": jnp.float32,
        "float32": jnp.float32,
        "bfloat16": jnp.bfloat16,
    }
    engine = Engine(
        m,
        num_pages=num_pages,
        page_size=page_size,
        max_seqs=max_seqs,
        kv_dtype=dtypes[kv_dtype],
        prefill_chunk=prefill_chunk,
    )
    if warmup:
        engine.warmup()
    served = name or (model if model in ("tiny", "smollm2") else Path(path).name)
    return Backend.for_engine(engine, tokenizer, served, max_queue=max_queue, **kw)


# ---- the app --------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers


def _usage(stats, completion: int) -> dict:
    cached = stats.reused_tokens + stats.spliced_tokens
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": stats.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "reused_tokens": stats.reused_tokens,
        "spliced_tokens": stats.spliced_tokens,
        "prefilled_tokens": stats.prefilled_tokens,
    }


class _CountRequests:
    """ASGI middleware counting requests by route and status (pure ASGI: streaming and
    disconnects pass through untouched)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 0}

        async def send_(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(path, str(status["code"])).inc()


@dataclasses.dataclass
class Turn:
    """A chat request as the engine runs it."""

    prompt: list[int]  # the rendered history as sent (replies' sampled ids in place)
    directives: list  # explicit edits, token directives in `prompt`'s coordinates
    use_tools: bool
    applied_edits: list[dict] | None  # context_management's report (None: not asked)

    @property
    def final(self) -> list[int]:
        """The prompt the model runs: `prompt` with the directives applied."""
        from leyline_jax.directives import apply_to_list

        return apply_to_list(self.prompt, self.directives)


def server_extra(app) -> dict:
    """The HTTP layer's own per-session data a snapshot keeps (event-loop thread): each
    session's replies' sampled ids and what context editing cleared."""
    return {
        "replies": app.state.replies.export(),
        "cleared": {k: sorted(v) for k, v in app.state.context.cleared.items()},
    }


def restore_sessions(app) -> int:
    """Restore the sessions of the snapshot in `backend.snapshot_dir`, if there is one, into
    the app's engine (not yet serving): engine sessions (`serve.snapshot.restore`: a snapshot
    of another model or layout is refused with ValueError), their HTTP names, replies and
    context-editing records. Engine sessions no HTTP session names (a sessionless request's,
    in flight when the snapshot was taken) are closed. Returns the sessions restored."""
    from serve import snapshot

    b = app.state.backend
    engine = b.worker.engine
    extra = snapshot.restore(engine, b.snapshot_dir)
    if extra is None:
        return 0
    names = {str(k): int(v) for k, v in extra.get("http_sessions", {}).items()}
    for sid in [sid for sid in engine.sessions if sid not in names.values()]:
        engine.close_session(sid)
    b.worker.sessions = names
    app.state.replies.load(extra.get("replies", {}))
    app.state.context.cleared = {str(k): set(v) for k, v in extra.get("cleared", {}).items()}
    log.info("restored %d sessions from %s", len(names), b.snapshot_dir)
    return len(names)


def save_at_shutdown(app) -> Path | None:
    """Snapshot the sessions once the engine worker has stopped (`ServerThread.stop`, and
    `main` after uvicorn returns, on SIGTERM or SIGINT). None without a snapshot dir."""
    b = app.state.backend
    if b.snapshot_dir is None:
        return None
    if b.worker.thread.is_alive():
        raise RuntimeError("stop the engine worker before the shutdown snapshot")
    path = b.worker.snapshot(b.snapshot_dir, server_extra(app))
    log.info("saved %d sessions to %s", len(b.worker.sessions), path)
    return path


def build_app(backend: Backend):
    """The FastAPI app serving `backend` (start its worker before serving: `ServerThread` and
    `main` do)."""
    from leyline_jax.directives import Mode
    from serve.engine import RequestError
    from serve.sampling import SamplingParams

    app = FastAPI(title="Leyline-JAX", version="0.1.0")
    app.state.backend = backend
    tok, metrics, worker = backend.tokenizer, backend.metrics, backend.worker
    replies = app.state.replies = ReplyMemory()
    context = app.state.context = ContextEditor(lambda text: len(tok.encode(text)))
    if backend.snapshot_dir is not None:
        restore_sessions(app)

    def error_response(
        status, message, param=None, type_="invalid_request_error", code=None, headers=None
    ):
        return JSONResponse(
            error_body(message, param=param, type_=type_, code=code),
            status_code=status,
            headers=headers,
        )

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.type, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": ("body",), "msg": "invalid body"}
        param = validation_param(first.get("loc", ("body",)))
        if first.get("type") == "json_invalid":  # the location is a character offset
            param = "body"
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        return error_response(400, f"{param}: {msg}{more}", param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # what the framework refused before any field was read: the path (no such
        # endpoint), the method, or the body itself (not JSON, not UTF-8)
        param = {404: "path", 405: "method"}.get(e.status_code, "body")
        return error_response(
            e.status_code, str(e.detail), param, type_, headers=getattr(e, "headers", None)
        )

    app.add_middleware(_CountRequests, metrics=metrics)

    # -- helpers ------------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != backend.model_name:
            raise APIError(
                400,
                f"model {name!r} does not exist; this server serves {backend.model_name!r}",
                "model",
                code="model_not_found",
            )

    def session_key(body_id: str | None, header_id: str | None) -> str | None:
        if body_id is not None and header_id is not None and body_id != header_id:
            raise APIError(
                400, "session_id and the X-Session-Id header name different sessions", "session_id"
            )
        return body_id if body_id is not None else header_id

    def sampling_for(req, prompt_len: int, asked: int | None, field: str) -> SamplingParams:
        room = backend.max_seq_len - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"the prompt is {prompt_len} tokens; this model's context is {backend.max_seq_len}",
                "messages" if field != "prompt" else "prompt",
                code="context_length_exceeded",
            )
        if asked is None:
            asked = min(backend.default_max_tokens, room)
        elif asked > room:
            raise APIError(
                400,
                f"{field}={asked} with a {prompt_len}-token prompt exceeds "
                f"the context of {backend.max_seq_len} tokens",
                field,
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_new_tokens=asked,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed or 0,
            stop_tokens=() if req.ignore_eos else tok.stop_tokens,
        )

    def start_job(prompt, sampling, req, key, directives=()) -> Job:
        mode = Mode.FORGET if req.options.mode == "forget" else Mode.AMORTIZE
        loop = asyncio.get_running_loop()
        job = Job(prompt, sampling, mode, key, loop, asyncio.Queue(), list(directives))
        job.incremental = req.stream or bool(req.stops)  # else nothing to do before the end
        if not worker.alive:
            raise APIError(
                503,
                "the engine is not running",
                None,
                "server_error",
                code="unavailable",
                headers={"Retry-After": "5"},
            )
        try:
            worker.submit(job)
        except QueueFull as e:
            raise APIError(
                429,
                f"the server is busy ({e}); retry later",
                None,
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from e
        return job

    def engine_error(e: BaseException, field: str) -> APIError:
        if isinstance(e, TurnCancelled):
            return APIError(499, "the request was cancelled", None, code="cancelled")
        if isinstance(e, (RequestError, ValueError, KeyError)):
            return APIError(400, str(e), field, code="invalid_request")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", None, "server_error")

    async def events(job: Job, request: Request) -> AsyncIterator[tuple]:
        """The job's events; cancels the turn when the client goes away or time runs out."""
        deadline = job.arrived + backend.request_timeout_s
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except TimeoutError:
                    if await request.is_disconnected():
                        worker.cancel(job)
                        return
                    if time.perf_counter() > deadline:
                        worker.cancel(job)
                        raise APIError(
                            504, "the request timed out", None, "server_error", code="timeout"
                        ) from None
                    continue
                yield ev
                if ev[0] in ("done", "error"):
                    return
        finally:
            if not job.done:
                worker.cancel(job)

    def render_chat(req: ChatCompletionRequest, key: str | None) -> Turn:
        """The request's history as the engine gets it: server-side context editing first
        (`context_management`), then the rendered history and the explicit directives
        (`leyline.directives`) as token directives in its coordinates."""
        messages = [m.as_chat_dict() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        applied = None
        if req.context_management is not None:
            applied = []
            for edit in req.context_management.edits:
                messages, report = context.apply(key, messages, edit)
                if report["cleared_tool_uses"]:
                    applied.append(report)
        mds = req.options.directives
        for k, d in enumerate(mds):
            if d.messages[1] >= len(messages):
                raise APIError(
                    400,
                    f"leyline.directives.{k}.messages: {list(d.messages)} is out of range for "
                    f"{len(messages)} messages",
                    f"leyline.directives.{k}.messages",
                )
        try:
            r = chat.render(tok, messages, tools)
            edited = edit_messages(messages, mds) if mds else messages
            final = chat.render(tok, edited, tools) if mds else r
        except (KeyError, ValueError, TypeError) as e:
            raise APIError(400, f"messages: cannot render: {e}", "messages") from e
        prompt = replies.substitute(key, messages, r)
        ds = []
        if mds:
            target = replies.substitute(key, edited, final)
            ds = token_directives(prompt, target, r.spans, final.spans, mds, req.options.mode)
            if not target:
                msg = "leyline.directives: they leave no prompt"
                raise APIError(400, msg, "leyline.directives")
        use_tools = bool(req.tools) and req.tool_choice != "none"
        return Turn(prompt, ds, use_tools, applied)

    def remember_reply(key, text: OutputText, output, calls) -> None:
        """Keep the reply's sampled ids for the session's next render (a reply cut by a stop
        string or carrying tool calls is re-sent otherwise: not kept)."""
        if key is None or calls or text.stopped:
            return
        ids = list(output[:-1] if output and output[-1] in tok.stop_tokens else output)
        replies.remember(key, text.text, ids)

    def leyline_extra(req, key, prompt, output, turn: Turn | None = None) -> dict:
        extra = {"session_id": key}
        if turn is not None and turn.directives:
            extra["directives"] = [
                {
                    "start": d.start,
                    "end": d.end,
                    "replacement_tokens": len(d.replacement),
                    "mode": d.mode.name.lower(),
                }
                for d in turn.directives
            ]
        if req.options.return_token_ids:
            extra["prompt_token_ids"] = list(prompt)
            extra["output_token_ids"] = list(output)
        return extra

    def session_headers(key):
        return {"X-Session-Id": key} if key is not None else {}

    # -- endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not worker.alive:
            return error_response(
                503, "the engine is not running", None, "server_error", headers={"Retry-After": "5"}
            )
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": backend.model_name,
                    "object": "model",
                    "created": backend.created,
                    "owned_by": "leyline-jax",
                    "max_model_len": backend.max_seq_len,
                }
            ],
        }

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(session_id: str = PathParam(min_length=1, max_length=256)):
        if not worker.alive:
            raise APIError(
                503,
                "the engine is not running",
                None,
                "server_error",
                code="unavailable",
                headers={"Retry-After": "5"},
            )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        worker.close_session(session_id, loop, fut)
        err = await fut
        if isinstance(err, KeyError):
            raise APIError(
                404,
                f"no session {session_id!r}",
                "session_id",
                "not_found_error",
                code="session_not_found",
            )
        if err is not None:
            raise APIError(409, str(err), "session_id", code="session_busy")
        replies.forget(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/snapshot")
    async def take_snapshot():
        """Save every session now (as at shutdown): admin."""
        if backend.snapshot_dir is None:
            raise APIError(
                409,
                "this server was started without --snapshot-dir",
                "snapshot_dir",
                code="no_snapshot_dir",
            )
        if not worker.alive:
            raise APIError(503, "the engine is not running", None, "server_error",
                           code="unavailable", headers={"Retry-After": "5"})  # fmt: skip
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        worker.request_snapshot(backend.snapshot_dir, server_extra(app), loop, fut)
        result = await fut
        if isinstance(result, BaseException):
            raise APIError(500, f"the snapshot failed: {result}", None, "server_error")
        return {"object": "snapshot", "path": str(result), "sessions": len(worker.sessions)}

    @app.post("/v1/chat/completions")
    async def chat_completions(
        req: ChatCompletionRequest,
        request: Request,
        x_session_id: SessionHeader = None,
    ):
        check_model(req.model)
        key = session_key(req.session_id, x_session_id)
        if (why := req.tool_choice_error()) is not None:
            raise APIError(400, why, "tool_choice")
        turn = render_chat(req, key)
        prompt, use_tools = turn.final, turn.use_tools
        asked, field = req.max_new
        sampling = sampling_for(req, len(prompt), asked, field)
        job = start_job(turn.prompt, sampling, req, key, turn.directives)
        text = OutputText(tok, tok.stop_tokens, req.stops, tool_markers(tok) if use_tools else ())
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": backend.model_name,
        }

        def finish_reason(output, calls) -> str:
            if calls:
                return "tool_calls"
            if text.stopped or (output and output[-1] in tok.stop_tokens):
                return "stop"
            return "length"

        if not req.stream:
            output: list[int] = []
            stats = None
            async for ev in events(job, request):
                if ev[0] == "tokens":
                    output += ev[1]
                    text.update(output)
                    if text.stopped:
                        worker.cancel(job)
                elif ev[0] == "done":
                    stats = ev[1]
                elif ev[0] == "error" and not (text.stopped and isinstance(ev[1], TurnCancelled)):
                    raise engine_error(ev[1], "messages")
            if stats is None:
                stats = job.request.stats if job.request is not None else None
            if stats is None:  # the client went away before anything ran
                raise APIError(499, "the request was cancelled", None, code="cancelled")
            text.update(output, final=True)
            content, calls = parse_tool_calls(text.text) if use_tools else (text.text, [])
            remember_reply(key, text, output, calls)
            message = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            body = {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": backend.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": finish_reason(output, calls),
                    }
                ],
                "usage": _usage(stats, len(output)),
                "session_id": key,
                "leyline": leyline_extra(req, key, prompt, output, turn),
            }
            if turn.applied_edits is not None:
                body["context_management"] = {"applied_edits": turn.applied_edits}
            return JSONResponse(body, headers=session_headers(key))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta, finish=None, usage=None, choices=True) -> dict:
            c = dict(base)
            c["choices"] = (
                [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
                if choices
                else []
            )
            if usage is not None:
                c["usage"] = usage
            return {"data": json.dumps(c, ensure_ascii=False)}

        async def stream():
            output: list[int] = []
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for ev in events(job, request):
                    if ev[0] == "tokens":
                        output.extend(ev[1])
                        delta = text.update(output)
                        if text.stopped:
                            worker.cancel(job)
                        if delta:
                            yield chunk({"content": delta})
                    elif ev[0] == "error" and not (
                        text.stopped and isinstance(ev[1], TurnCancelled)
                    ):
                        e = engine_error(ev[1], "messages")
                        yield {
                            "data": json.dumps(
                                error_body(e.message, param=e.param, type_=e.type, code=e.code)
                            )
                        }
                        yield {"data": "[DONE]"}
                        return
            except APIError as e:
                yield {
                    "data": json.dumps(
                        error_body(e.message, param=e.param, type_=e.type, code=e.code)
                    )
                }
                yield {"data": "[DONE]"}
                return
            stats = job.request.stats
            delta = text.update(output, final=True)
            if delta:
                yield chunk({"content": delta})
            calls = []
            if use_tools:
                _, calls = parse_tool_calls(text.text)
                if calls:
                    yield chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]})
            remember_reply(key, text, output, calls)
            usage = _usage(stats, len(output))
            fin = finish_reason(output, calls)
            if include_usage:
                yield chunk({}, fin)
                last = chunk({}, usage=usage, choices=False)
            else:
                last = chunk({}, fin, usage=usage)
            d = json.loads(last["data"])
            d["leyline"] = leyline_extra(req, key, prompt, output, turn)
            if turn.applied_edits is not None:
                d["context_management"] = {"applied_edits": turn.applied_edits}
            yield {"data": json.dumps(d, ensure_ascii=False)}
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), headers=session_headers(key), ping=15)

    @app.post("/v1/completions")
    async def completions(
        req: CompletionRequest,
        request: Request,
        x_session_id: SessionHeader = None,
    ):
        check_model(req.model)
        key = session_key(req.session_id, x_session_id)
        if isinstance(req.prompt, str):
            prompt = tok.encode(req.prompt)
            if not prompt:
                raise APIError(400, "prompt: the text encodes to no token", "prompt")
        else:
            prompt = list(req.prompt)
            bad = [t for t in prompt if t >= backend.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"prompt: token id {bad[0]} is outside the vocabulary "
                    f"[0, {backend.vocab_size})",
                    "prompt",
                )
        sampling = sampling_for(req, len(prompt), req.max_tokens, "max_tokens")
        job = start_job(prompt, sampling, req, key)
        text = OutputText(tok, tok.stop_tokens, req.stops, ())
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def finish_reason(output) -> str:
            if text.stopped or (output and output[-1] in tok.stop_tokens):
                return "stop"
            return "length"

        def body(choices, usage=None, extra=None) -> dict:
            b = {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": backend.model_name,
                "choices": choices,
            }
            if usage is not None:
                b["usage"] = usage
            if extra is not None:
                b["session_id"] = key
                b["leyline"] = extra
            return b

        def choice(t, finish=None):
            return {"index": 0, "text": t, "logprobs": None, "finish_reason": finish}

        if not req.stream:
            output: list[int] = []
            async for ev in events(job, request):
                if ev[0] == "tokens":
                    output += ev[1]
                    text.update(output)
                    if text.stopped:
                        worker.cancel(job)
                elif ev[0] == "error" and not (text.stopped and isinstance(ev[1], TurnCancelled)):
                    raise engine_error(ev[1], "prompt")
            if job.request is None:
                raise APIError(499, "the request was cancelled", None, code="cancelled")
            text.update(output, final=True)
            return JSONResponse(
                body(
                    [choice(text.text, finish_reason(output))],
                    _usage(job.request.stats, len(output)),
                    leyline_extra(req, key, prompt, output),
                ),
                headers=session_headers(key),
            )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream():
            output: list[int] = []
            try:
                async for ev in events(job, request):
                    if ev[0] == "tokens":
                        output.extend(ev[1])
                        delta = text.update(output)
                        if text.stopped:
                            worker.cancel(job)
                        if delta:
                            yield {"data": json.dumps(body([choice(delta)]))}
                    elif ev[0] == "error" and not (
                        text.stopped and isinstance(ev[1], TurnCancelled)
                    ):
                        raise engine_error(ev[1], "prompt")
            except APIError as e:
                yield {
                    "data": json.dumps(
                        error_body(e.message, param=e.param, type_=e.type, code=e.code)
                    )
                }
                yield {"data": "[DONE]"}
                return
            usage = _usage(job.request.stats, len(output))
            extra = leyline_extra(req, key, prompt, output)
            delta = text.update(output, final=True)
            fin = finish_reason(output)
            if include_usage:
                yield {"data": json.dumps(body([choice(delta, fin)]))}
                yield {"data": json.dumps(body([], usage, extra))}
            else:
                yield {"data": json.dumps(body([choice(delta, fin)], usage, extra))}
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), headers=session_headers(key), ping=15)

    return app


# ---- running it -----------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `backend` in a thread of this process (tests, benchmarks); the engine
    worker starts with it and stops with it."""

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        self.backend, self.host = backend, host
        self.port = port or free_port(host)
        self.app = build_app(backend)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=self.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.backend.worker.start()
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > timeout or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.backend.worker.stop()
        save_at_shutdown(self.app)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (the embedded default), smollm2, a checkpoint dir or .gguf file",
    )
    ap.add_argument("--served-model-name", default=None, help="the model's id in the API")
    ap.add_argument("--root", default=".checkpoints", help="where the tiny default lives")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument(
        "--max-queue", type=int, default=64, help="requests in flight before 429 (Retry-After)"
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="a chat completion's budget when the request sets none",
    )
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--warmup", action="store_true", help="compile every step shape first")
    ap.add_argument(
        "--snapshot-dir",
        default=None,
        help="durable sessions: restore them from DIR at start, save them there on shutdown "
        "(SIGTERM, SIGINT) and on POST /v1/snapshot",
    )
    ap.add_argument(
        "--compile-cache",
        default=None,
        help="keep compiled programs in DIR (default: serve.compile_cache's; off)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from serve import compile_cache

    compile_cache.enable(args.compile_cache)
    backend = load_backend(
        args.model,
        root=args.root,
        name=args.served_model_name,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_seqs=args.max_seqs,
        kv_dtype=args.kv_dtype,
        prefill_chunk=args.prefill_chunk,
        max_queue=args.max_queue,
        warmup=args.warmup,
        default_max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        snapshot_dir=args.snapshot_dir,
    )
    import uvicorn

    app = build_app(backend)
    backend.worker.start()
    log.info(
        "serving %s on http://%s:%d (pid %d)", backend.model_name, args.host, args.port, os.getpid()
    )
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, puts back the handlers it found and
    # raises the signal again: these handlers then let the shutdown snapshot run and the
    # process exit 0 (a signal during the snapshot itself is ignored: it completes)
    stops: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stops.append(signum))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        backend.worker.stop()
        save_at_shutdown(app)


if __name__ == "__main__":
    main()
