"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API (what the
`anthropic` SDK, Claude Code and the Claude Agent SDK call), on the chat path: the request
becomes a chat request (`serve.http.messages_input`), the turn runs as a chat turn (sessions,
the edit channel, tools, forced tool calls' grammar, `context_management`, tenants and limits
as there), and the answer is a `message`, or Anthropic's stream of events (`message_start`;
per content block `content_block_start`, `content_block_delta` with a `text_delta` or an
`input_json_delta`, `content_block_stop`; `message_delta`; `message_stop`); past a
`compact_20260112` trigger a `compaction` block opens the content (`serve.http.compaction`:
the summary written and spliced in first). Errors are in
Anthropic's shape (`serve.http.errors`). The session: the `X-Session-Id` header, else
`X-Claude-Code-Session-Id`, else `metadata.user_id` (`messages_input.session_name`).
`max_tokens` past the context left is cut to it, and a reply the context ends stops with
"model_context_window_exceeded" (Claude Code asks 32,000 of a model it does not know).

Usage in Anthropic's terms, which add up to the prompt: `cache_read_input_tokens`, the tokens
whose KV was reused or spliced (the session's, or the radix cache's); `input_tokens`, the rest
(prefilled this turn); `cache_creation_input_tokens` 0: Anthropic counts there only what a
`cache_control` breakpoint writes, and the server caches every prompt token unasked. So a prompt
nothing was cached for has `input_tokens` equal to `count_tokens`' (rendered without the
session: a re-sent reply counts as its text's tokens). A stream's `message_start` counts the
whole prompt as `input_tokens` (the split is known at the end); its `message_delta` gives it.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated

from fastapi import Header, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from serve.http import body, compaction, formats
from serve.http.body import Received
from serve.http.chat_completions import ChatReply, context_mode, render
from serve.http.errors import APIError, anthropic_event
from serve.http.extensions import SESSION_ID
from serve.http.messages_input import (
    MessagesPrompt,
    MessagesRequest,
    chat_request,
    renamed,
    session_name,
)
from serve.http.reply import Outcome, data, usage
from serve.http.text import OutputText, tool_markers
from serve.http.turn import SessionHeader, Turns, session_headers

# Claude Code's X-Claude-Code-Session-Id header: the session when X-Session-Id names none
ClaudeSessionHeader = Annotated[str | None, Header(**SESSION_ID)]
_STOPS = {"tool_calls": "tool_use", "length": "max_tokens"}  # chat's finish reasons


def tool_input(arguments: str) -> dict | None:
    """A tool call's arguments as a `tool_use` block's `input` (None: not a JSON object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


_ITERATION = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
              "cache_read_input_tokens")  # fmt: skip


def anthropic_usage(out: Outcome) -> dict:
    """A turn's usage in Anthropic's terms, with ours (`reused_tokens`, `spliced_tokens`;
    `recomputed_tokens`, of the spliced ones run again: `leyline.recompute`)."""
    u = usage(out.stats, len(out.output))
    read = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"] - read,
        "output_tokens": u["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": read,
        **{k: u[k] for k in ("reused_tokens", "spliced_tokens", "recomputed_tokens")},
    }


def salt_named(e: APIError, source: str) -> APIError:
    """`e` naming, for chat's `cache_salt` (the session was opened by another API's request
    with another salt), the Messages field `source` that named the session."""
    if e.param == "cache_salt":
        why = "names a session opened with another cache_salt (by another API's request)"
        e.param, e.message = source, f"{source}: {why}"
    return e


class MessagesReply(ChatReply):
    """A turn's answer as a `message`, or its events."""

    prefix = "msg"

    def __init__(self, req, caller, turn, text, backend):
        super().__init__(req, caller, turn, text, backend)
        self.head["id"] = f"msg_{uuid.uuid4().hex}"
        self.texting = False  # a stream's text block (index `first`) is open
        self.cut = False  # the budget is the context left, less than `max_tokens` asked
        self.source = "x-session-id"  # the field that named the session (`salt_named`)
        self.compaction: dict | None = None  # the `compaction` block the content opens with
        self.compaction_usage: dict | None = None  # ... and its turn's usage (an iteration)

    @property
    def first(self) -> int:
        """The index of the first block the turn writes (after a `compaction` block)."""
        return int(self.compaction is not None)

    @staticmethod
    def _event(kind: str, **fields) -> dict:
        return {"event": kind, **data({"type": kind, **fields})}

    def _message(self, content: list, stop: dict, use: dict) -> dict:
        return {
            "id": self.head["id"],
            "type": "message",
            "role": "assistant",
            "model": self.head["model"],
            "content": content,
            **stop,
            "usage": use,
        }

    def _usage(self, out: Outcome) -> dict:
        """The turn's usage; after a compaction, its `iterations` too: the compaction's, then
        this turn's (Anthropic's: the top-level fields are the last iteration's alone)."""
        use = anthropic_usage(out)
        if self.compaction_usage is not None:
            last = {k: v for k, v in use.items() if k in _ITERATION}
            use["iterations"] = [self.compaction_usage, {"type": "message", **last}]
        return use

    def _content(self, out: Outcome) -> tuple[str, list[dict], dict]:
        """(the text, the `tool_use` blocks, the extras every answer ends with), the reply
        remembered (`ChatReply._finish`). A call whose arguments are no JSON object leaves the
        whole reply text."""
        content, calls, extra = self._finish(out)
        uses = []
        for c in calls:
            args = tool_input(c["function"]["arguments"])
            if args is None:
                return self.text.text, [], extra
            uid = "toolu_" + c["id"].removeprefix("call_")
            uses.append({"type": "tool_use", "id": uid, "name": c["function"]["name"],
                         "input": args})  # fmt: skip
        return content, uses, extra

    def _stop(self, out: Outcome, uses: list) -> dict:
        fin = self.finish_reason(out.output, uses)
        reason = _STOPS.get(fin, "stop_sequence" if self.text.stopped else "end_turn")
        if reason == "max_tokens" and self.cut:
            reason = "model_context_window_exceeded"
        seq = self.text.stop if reason == "stop_sequence" else None
        return {"stop_reason": reason, "stop_sequence": seq}

    def body(self, out: Outcome) -> dict:
        self.text.update(out.output, final=True)
        text, uses, extra = self._content(out)
        blocks = ([{"type": "text", "text": text}] if text else []) + uses
        if self.compaction is not None:
            blocks.insert(0, self.compaction)
        return self._message(blocks, self._stop(out, uses), self._usage(out)) | extra

    def _compaction_events(self) -> list[dict]:
        """The `compaction` block as Anthropic streams it: opened with null content, the
        summary in one `compaction_delta`, closed."""
        opened = {"type": "compaction", "content": None}
        delta = {"type": "compaction_delta", "content": self.compaction["content"]}
        return [
            self._event("content_block_start", index=0, content_block=opened),
            self._event("content_block_delta", index=0, delta=delta),
            self._event("content_block_stop", index=0),
        ]

    def paused(self) -> dict:
        """The answer of a compaction paused after its block (`pause_after_compaction`): the
        block alone, stop_reason "compaction", the compaction's usage (the only iteration)."""
        stop = {"stop_reason": "compaction", "stop_sequence": None}
        use = {k: v for k, v in self.compaction_usage.items() if k != "type"}
        use["iterations"] = [self.compaction_usage]
        extra = {"leyline": self.leyline(self.turn.final, [], self.turn.directives)}
        if self.turn.applied_edits is not None:
            extra["context_management"] = {"applied_edits": self.turn.applied_edits}
        return self._message([self.compaction], stop, use) | extra

    def paused_events(self) -> list[dict]:
        """`paused` as Anthropic's stream of events."""
        whole = self.paused()
        extra = {k: whole[k] for k in ("leyline", "context_management") if k in whole}
        stop = {k: whole[k] for k in ("stop_reason", "stop_sequence")}
        return [
            *self.opening(),
            self._event("message_delta", delta=stop, usage=whole["usage"], **extra),
            self._event("message_stop"),
        ]

    def opening(self) -> list[dict]:
        use = {"input_tokens": len(self.turn.final), "output_tokens": 0,
               "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip
        first = self._message([], {"stop_reason": None, "stop_sequence": None}, use)
        if self.turn.applied_edits is not None:
            first["context_management"] = {"applied_edits": self.turn.applied_edits}
        events = [self._event("message_start", message=first)]
        return events + (self._compaction_events() if self.compaction is not None else [])

    def deltas(self, text: str, out: Outcome | None = None) -> list[dict]:
        events = []
        if not self.texting:  # a text block opens with the first text
            self.texting = True
            block = {"type": "text", "text": ""}
            events.append(self._event("content_block_start", index=self.first,
                                      content_block=block))  # fmt: skip
        delta = {"type": "text_delta", "text": text}
        return [*events, self._event("content_block_delta", index=self.first, delta=delta)]

    def closing(self, out: Outcome) -> list[dict]:
        text = self.text
        tail = text.update(out.output, final=True)
        content, uses, extra = self._content(out)
        if not uses:  # held back at a tool-call marker, but no call: text
            tail += text.text[text.sent :]
        events = self.deltas(tail) if tail else []
        if self.texting:
            events.append(self._event("content_block_stop", index=self.first))
        for k, u in enumerate(uses, start=self.first + int(self.texting)):
            args = {"type": "input_json_delta", "partial_json": json.dumps(u["input"])}
            events += [
                self._event("content_block_start", index=k, content_block=u | {"input": {}}),
                self._event("content_block_delta", index=k, delta=args),
                self._event("content_block_stop", index=k),
            ]
        stop, use = self._stop(out, uses), self._usage(out)
        events.append(self._event("message_delta", delta=stop, usage=use, **extra))
        return [*events, self._event("message_stop")]

    def error(self, e: APIError) -> dict:
        return anthropic_event(salt_named(e, self.source))

    def end(self) -> list[dict]:  # Anthropic's stream ends at message_stop
        return []


def add_routes(app, turns: Turns) -> None:
    backend = turns.backend

    def rendered(req, key):
        try:
            return render(req, key, backend.tokenizer, backend.sessions, backend.max_seq_len)
        except APIError as e:
            raise renamed(e) from None

    def budgeted(req, turn, asked: int, grammar=None):
        """The turn's sampling, its budget `asked` cut to the context left (as Anthropic's
        newer models take it: the reply ends there as "model_context_window_exceeded")."""
        room = max(backend.max_seq_len - len(turn.final), 1)  # < 1: a 400 naming `messages`
        try:
            budget = min(asked, room)
            return turns.sampling(req, len(turn.final), budget, "max_tokens", grammar=grammar)
        except APIError as e:
            raise renamed(e) from None

    def prepare(received: Received, header: str | None, claude: str | None, tenant: str):
        """(its chat request, its caller, its turn, its sampling, the compaction due or None):
        the body parsed, the conversation rendered, the grammar compiled; past a compaction's
        trigger, the summary's turn too. The work that grows with the body, for a worker
        thread (`serve.http.body`)."""
        mreq = received.parse(MessagesRequest, joins_text=True)
        name = session_name(header, claude, mreq)
        req = chat_request(mreq, name)
        caller = turns.session(req, None, tenant)
        turn = rendered(req, caller.key)
        try:
            grammar = formats.grammar(req, backend)
        except APIError as e:
            raise renamed(e) from None
        sampling = budgeted(req, turn, mreq.max_tokens, grammar)
        edit = mreq.context_management and mreq.context_management.compact
        plan = None
        if edit and len(turn.final) > compaction.trigger(edit, backend.max_seq_len):
            sreq = chat_request(compaction.summary_request(mreq, edit), name)
            sturn = rendered(sreq, caller.key)
            plan = compaction.Plan(edit, sreq, sturn, budgeted(sreq, sturn, mreq.max_tokens))
        return req, caller, turn, sampling, plan

    def count(received: Received, tenant: str) -> JSONResponse:
        req = chat_request(received.parse(MessagesPrompt, joins_text=True), None)
        turns.session(req, None, tenant)  # the model served
        return JSONResponse({"input_tokens": len(rendered(req, None).final)})

    @app.post("/v1/messages", openapi_extra=body.documented(app, MessagesRequest))
    async def messages(
        request: Request,
        x_session_id: SessionHeader = None,
        x_claude_code_session_id: ClaudeSessionHeader = None,
    ):
        received, tenant = await body.received(request), request.state.tenant
        # off the event loop: a long conversation delays no other request
        req, caller, turn, sampling, plan = await body.in_thread(
            prepare, received, x_session_id, x_claude_code_session_id, tenant
        )
        source = ("x-session-id" if x_session_id is not None else "x-claude-code-session-id"
                  if x_claude_code_session_id is not None else "metadata.user_id")  # fmt: skip
        try:
            return await answer(request, req, caller, turn, sampling, plan, source)
        except APIError as e:
            raise salt_named(e, source) from None

    async def answer(request, req, caller, turn, sampling, plan, source):
        """The turn run and answered (after the compaction's summary, where one is due)."""
        tok = backend.tokenizer
        block = None
        if plan is not None:  # the summary first, then the reply over it (or the block alone)
            summary, sout = await compaction.summarize(turns, request, plan, caller)
            block = compaction.block(summary)
            use = {"type": "compaction", **{k: v for k, v in anthropic_usage(sout).items()
                                            if k in _ITERATION}}  # fmt: skip
            if plan.edit.pause_after_compaction:
                text = OutputText(tok, tok.stop_tokens, (), ())
                paused = MessagesReply(req, caller, plan.turn, text, backend)
                paused.compaction, paused.compaction_usage = block, use
                headers = session_headers(caller.name)
                if req.stream:
                    return EventSourceResponse(iter(paused.paused_events()), headers=headers)
                return JSONResponse(paused.paused(), headers=headers)
            if summary:
                mode = context_mode(req, backend.sessions)
                turn = await body.in_thread(compaction.reply_turn, plan, summary, caller.key,
                                            tok, backend.sessions, mode)  # fmt: skip
                sampling = budgeted(req, turn, req.max_tokens, sampling.grammar)
        job = turns.start(turn.prompt, sampling, req, caller, turn.directives)
        markers = tool_markers(tok) if turn.use_tools else ()
        text = OutputText(tok, tok.stop_tokens, req.stops, markers)
        reply = MessagesReply(req, caller, turn, text, backend)
        reply.cut = sampling.max_new_tokens < req.max_tokens
        reply.source = source
        if block is not None:
            reply.compaction, reply.compaction_usage = block, use
        return await turns.respond(job, request, reply)

    @app.post("/v1/messages/count_tokens", openapi_extra=body.documented(app, MessagesPrompt))
    async def count_tokens(request: Request):
        return await body.in_thread(count, await body.received(request), request.state.tenant)
