"""`POST /v1/chat/completions`: a chat turn, with the edit channel.

The harness re-sends the whole history as usual; the server renders it (`serve.chat.render`,
`tools` in the model's chat layout) with the session's remembered replies' sampled ids in
place, and the engine diffs it against the session's tokens (`Engine.submit_prompt`): an
unmodified harness that edits its own history gets a splice instead of a re-prefill (AMORTIZE
by default, FORGET with `"leyline": {"mode": "forget"}`). Explicit message-granular directives
(`leyline.directives`) become token directives in the rendered history's coordinates, each in
its own mode; `context_management` (Anthropic's `clear_tool_uses_20250919`,
`serve.http.history.ContextEditor`) is applied by the server, what it clears now spliced as
token directives (AMORTIZE unless the request or `--context-edit-mode` says FORGET), and
reported in `context_management.applied_edits`. Tool calls in the output are parsed back into
`tool_calls`.
"""

from __future__ import annotations

import dataclasses

from fastapi import Request

from leyline_jax.directives import Mode, apply_to_list
from serve import chat
from serve.http import body, formats, logprobs
from serve.http.auth import Caller
from serve.http.body import Received
from serve.http.errors import APIError
from serve.http.history import clear_directives, edit_messages, token_directives
from serve.http.reply import Outcome, Reply, data, usage
from serve.http.schema import ChatCompletionRequest
from serve.http.text import OutputText, parse_tool_calls, tool_markers
from serve.http.turn import SessionHeader, Turns


@dataclasses.dataclass
class Turn:
    """A chat request as the engine runs it."""

    prompt: list[int]  # the rendered history as sent (replies' sampled ids in place)
    directives: list  # explicit edits, token directives in `prompt`'s coordinates
    use_tools: bool
    applied_edits: list[dict] | None  # context_management's report (None: not asked)
    messages: list[dict]  # the history the model runs, every edit applied

    @property
    def final(self) -> list[int]:
        """The prompt the model runs: `prompt` with the directives applied."""
        return apply_to_list(self.prompt, self.directives)


def context_mode(req: ChatCompletionRequest, sessions) -> Mode:
    """The mode context editing's clears are spliced in: the request's `leyline.mode` when it
    names one, else the server's (`ContextEditor.mode`: `--context-edit-mode`)."""
    named = req.leyline is not None and "mode" in req.leyline.model_fields_set
    return Mode[(req.options.mode if named else sessions.context.mode).upper()]


def render(req: ChatCompletionRequest, key: str | None, tok, sessions, context: int) -> Turn:
    """The request's history as the engine gets it: the rendered history and its edits as token
    directives in its coordinates. Server-side context editing (`context_management`) first:
    the prompt is the history with the session's earlier clears (`ContextEditor`'s record),
    and what the edit clears now is one token directive per message it changes
    (`clear_directives`), in `context_mode`; so a session whose history grew is spliced
    exactly there. With explicit directives (`leyline.directives`) too, the prompt is the
    history with every clear, which the session's diff finds, and the explicit directives are
    token directives in its coordinates. A history whose tokens outside assistant messages
    fill the `context` is refused (400 naming the prompt's field) as soon as they are counted,
    before their ids are made (`serve.chat.render`'s `limit`): what the prompt runs keeps
    every one of them (the replies the server remembers are put in place of assistant messages
    alone), unless directives cut it."""
    messages = [m.as_chat_dict() for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    mds = req.options.directives
    for k, d in enumerate(mds):
        if d.messages[1] >= len(messages):
            param = f"leyline.directives.{k}.messages"
            why = f"{param}: {list(d.messages)} is out of range for {len(messages)} messages"
            raise APIError(400, why, param)
    applied, before = None, messages  # before: the history with the earlier clears only
    try:
        if req.context_management is not None:
            applied = []

            def count(history: list[dict]) -> int:  # its input tokens, as count_tokens counts
                return len(chat.render(tok, history, tools).tokens)

            for edit in req.context_management.edits:
                done = sessions.clear_tool_uses(key, messages, edit, count)
                before = done.before if before is messages else before
                messages = done.after
                if done.report["cleared_tool_uses"]:
                    applied.append(done.report)
        splice = before is not messages and not mds  # clears to splice as directives
        if mds or not splice:
            before = messages
        cut = bool(mds) or splice  # directives may shorten the prompt: limit what runs
        r = chat.render(tok, before, tools, limit=None if cut else context - 1)
        edited = edit_messages(messages, mds) if mds else messages
        final = chat.render(tok, edited, tools, limit=context - 1) if cut else r
    except chat.TooLong as e:
        why = f"the prompt is at least {e.tokens} tokens; this model's context is {context}"
        raise APIError(400, why, req.prompt_field, code="context_length_exceeded") from None
    except (KeyError, ValueError, TypeError) as e:
        raise APIError(400, f"messages: cannot render: {e}", "messages") from e
    forgets = "forget" in {req.options.mode, *(d.mode for d in mds)}
    if key is not None and (forgets or splice and context_mode(req, sessions) is Mode.FORGET):
        sessions.keep_replies(key, edited)  # a reply it evicts is remembered no more
    prompt = sessions.substitute(key, before, r)
    ds = []
    if mds:
        target = sessions.substitute(key, edited, final)
        ds = token_directives(prompt, target, mds, Mode[req.options.mode.upper()])
    elif splice:
        target = sessions.substitute(key, edited, final)
        ds = clear_directives(prompt, target, context_mode(req, sessions))
    use_tools = bool(req.tools) and req.tool_choice != "none"
    return Turn(prompt.tokens, ds, use_tools, applied, edited)


class ChatReply(Reply):
    """A chat turn's answer: `chat.completion`, or `chat.completion.chunk` events."""

    prefix, kind = "chatcmpl", "chat.completion.chunk"

    def __init__(self, req, caller: Caller, turn: Turn, text: OutputText, backend):
        super().__init__(req, caller, text, backend.model_name)
        self.turn, self.backend = turn, backend

    def finish_reason(self, output: list[int], calls=()) -> str:
        """ "tool_calls" for a reply that made calls and ended; "length" when the budget cut it
        (its complete calls kept, as `parse_tool_calls` reads them)."""
        fin = super().finish_reason(output)
        return "tool_calls" if calls and fin == "stop" else fin

    def _chunk(self, delta, finish=None, usage_=None, choices=True, lps=None) -> dict:
        c = dict(self.head)
        one = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
        c["choices"] = [one] if choices else []
        if usage_ is not None:
            c["usage"] = usage_
        return c

    def _finish(self, out: Outcome) -> tuple[str, list[dict], dict]:
        """(content, tool calls, the extras every answer ends with), the reply remembered."""
        text, tok = self.text, self.backend.tokenizer
        parsed = parse_tool_calls(text.text) if self.turn.use_tools else (text.text, [])
        content, calls = parsed
        if self.key is not None and not calls and not text.stopped:
            # a reply cut by a stop string or carrying tool calls is re-sent otherwise
            out_ids = out.output
            ids = out_ids[:-1] if out_ids and out_ids[-1] in tok.stop_tokens else out_ids
            self.backend.sessions.remember(self.caller.key, text.text, list(ids))
        extra = {"leyline": self.leyline(self.turn.final, out.output, self.turn.directives)}
        if self.turn.applied_edits is not None:
            extra["context_management"] = {"applied_edits": self.turn.applied_edits}
        return content, calls, extra

    def _logprobs(self, out: Outcome) -> dict | None:
        """The choice's `logprobs` for the tokens not yet reported (None: not asked)."""
        if self.req.logprobs_k is None:
            return None
        return {"content": logprobs.chat_content(self.text.tok, *out.fresh_logprobs())}

    def opening(self) -> list[dict]:
        return [data(self._chunk({"role": "assistant", "content": ""}))]

    def delta(self, text: str, out: Outcome | None = None) -> dict:
        return data(self._chunk({"content": text}, lps=out and self._logprobs(out)))

    def closing(self, out: Outcome) -> list[dict]:
        text, events, lps = self.text, [], self._logprobs(out)
        delta = text.update(out.output, final=True)
        if delta:
            events.append(self._chunk({"content": delta}))
        content, calls, extra = self._finish(out)
        if calls:
            events.append(
                self._chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]})
            )
        elif self.turn.use_tools and len(text.text) > text.sent:  # held back at a marker,
            events.append(self._chunk({"content": text.text[text.sent :]}))  # but no call
        fin = self.finish_reason(out.output, calls)
        use = usage(out.stats, len(out.output))
        opts = self.req.stream_options
        events.append(self._chunk({}, fin))
        events[0]["choices"][0]["logprobs"] = lps  # the tokens' not yet reported
        if opts is not None and opts.include_usage:  # usage only when asked, as OpenAI
            events.append(self._chunk({}, usage_=use, choices=False))
        events[-1].update(extra)
        return [data(e) for e in events]

    def body(self, out: Outcome) -> dict:
        self.text.update(out.output, final=True)
        content, calls, extra = self._finish(out)
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        fin = self.finish_reason(out.output, calls)
        lps = self._logprobs(out)
        choice = {"index": 0, "message": message, "logprobs": lps, "finish_reason": fin}
        body = dict(self.head, object="chat.completion", choices=[choice])
        body["usage"] = usage(out.stats, len(out.output))
        body["session_id"] = self.key
        return body | extra


def add_route(app, turns: Turns) -> None:
    backend = turns.backend

    def prepare(received: Received, header: str | None, tenant: str):
        """(the request, its caller, its turn, its sampling): the body parsed, the history
        rendered and tokenized, the grammar compiled. The work that grows with the body, for a
        worker thread (`serve.http.body`)."""
        req = received.parse(ChatCompletionRequest, joins_text=True)
        caller = turns.session(req, header, tenant)
        turn = render(req, caller.key, backend.tokenizer, backend.sessions, backend.max_seq_len)
        grammar = formats.grammar(req, backend)
        sampling = turns.sampling(req, len(turn.final), *req.max_new, grammar=grammar)
        return req, caller, turn, sampling

    @app.post("/v1/chat/completions", openapi_extra=body.documented(app, ChatCompletionRequest))
    async def chat_completions(request: Request, x_session_id: SessionHeader = None):
        received, tenant = await body.received(request), request.state.tenant
        # off the event loop: a long history delays no other request
        req, caller, turn, sampling = await body.in_thread(prepare, received, x_session_id, tenant)
        job = turns.start(turn.prompt, sampling, req, caller, turn.directives)
        tok = backend.tokenizer
        markers = tool_markers(tok) if turn.use_tools else ()
        text = OutputText(tok, tok.stop_tokens, req.stops, markers)
        reply = ChatReply(req, caller, turn, text, backend)
        return await turns.respond(job, request, reply)
