"""Anthropic's compaction (`compact_20260112`) on `POST /v1/messages`, done by the server as a
splice of the session's KV.

A request whose prompt (its input tokens, as the model runs it) exceeds the edit's `trigger`
is compacted in two turns on its session:

1. The summary (`plan`, `summarize`): the conversation with one more user message, the edit's
   `instructions` (else `INSTRUCTIONS`), which extends the session's tokens (nothing before it
   is prefilled again); the model's reply is the summary, remembered as a reply of the
   session (so a `compaction` block sent back renders as its sampled ids).
2. The reply (`reply_turn`): the summary turn's conversation with the summary as an assistant
   message, which extends the session again, and one directive deleting every message but
   the leading system ones up to the summary (AMORTIZE, or FORGET per
   `chat_completions.context_mode`): the model answers over system + summary alone, and the
   session's KV is that, then the reply. A request that sends the `compaction` block back
   (`messages_input.chat_messages` drops what precedes it) renders to an extension of it.

With `pause_after_compaction` the answer is the `compaction` block alone (stop_reason
"compaction"); the KV keeps the summary turn, and the next request's prompt (system, the
summary, what the client adds) is spliced by the session's diff, in that request's mode.
An empty summary is a failed compaction (the block's `content` null, nothing spliced, the
reply generated over the whole conversation), as Anthropic's null content.
"""

from __future__ import annotations

import dataclasses

from leyline_jax.directives import Directive, Mode, apply_to_list
from serve import chat
from serve.edits import detect_edits
from serve.http.chat_completions import Turn
from serve.http.errors import APIError
from serve.http.messages_input import CompactEdit, InputMessage, MessagesRequest, TextBlock
from serve.http.reply import Outcome
from serve.http.text import OutputText

DEFAULT_TRIGGER = 150_000  # Anthropic's default, in input tokens
INSTRUCTIONS = (
    "Summarize the conversation so far so that it can be continued from the summary alone: "
    "the user's requests and intent, what has been done and found (tool results included), "
    "the decisions made, the state of the work in progress and what remains to do. "
    "Write only the summary."
)


def trigger(edit: CompactEdit, context: int) -> int:
    """The input tokens past which the request is compacted: the edit's `trigger`, else
    Anthropic's default (150,000) or three quarters of the model's context, the lesser."""
    if edit.trigger is not None:
        return edit.trigger.value
    return min(DEFAULT_TRIGGER, context * 3 // 4)


def summary_request(mreq: MessagesRequest, edit: CompactEdit) -> MessagesRequest:
    """The request the summary is written for: the conversation, then the instructions as a
    user message (an empty or blank `instructions` is absent)."""
    asked = (edit.instructions or "").strip() and edit.instructions
    ask = InputMessage(role="user", content=[TextBlock(type="text", text=asked or INSTRUCTIONS)])
    return mreq.model_copy(update={"messages": [*mreq.messages, ask]})


@dataclasses.dataclass
class Plan:
    """A compaction due: the edit, and the summary turn (its chat request, turn, sampling)."""

    edit: CompactEdit
    req: object  # the summary's ChatCompletionRequest
    turn: Turn
    sampling: object  # SamplingParams


class _Collected:
    """What `Turns.deltas` needs of a reply to collect a turn's output."""

    field = "messages"

    def __init__(self, text: OutputText):
        self.text = text


async def summarize(turns, request, plan: Plan, caller) -> tuple[str, Outcome]:
    """Run the summary turn to its end: (the summary's text, "" when the model wrote none; the
    turn's outcome). The summary is remembered as the session's reply (its sampled ids), and
    the session's record of cleared tool results reset (`history.ContextEditor`)."""
    backend = turns.backend
    tok = backend.tokenizer
    job = turns.start(plan.turn.prompt, plan.sampling, plan.req, caller, plan.turn.directives)
    text, out = OutputText(tok, tok.stop_tokens, (), ()), Outcome()
    async for _ in turns.deltas(job, request, _Collected(text), out):
        pass
    if out.gone:
        raise APIError(499, "the client went away", None, code="cancelled")
    text.update(out.output, final=True)
    ids = out.output[:-1] if out.output and out.output[-1] in tok.stop_tokens else out.output
    summary = text.text.strip() and text.text
    if summary and caller.name is not None:
        backend.sessions.remember(caller.name, summary, list(ids))
        backend.sessions.context.forget(caller.name)  # its next messages begin at the block
    return summary, out


def reply_turn(plan: Plan, summary: str, key, tok, sessions, mode: Mode) -> Turn:
    """The reply's turn after the summary: the prompt is the summary turn's conversation with
    the summary as an assistant message (the session's tokens, extended), and one directive in
    `mode` deletes everything between the leading system messages and the summary, so the
    model runs system + summary (the history a `compaction` block sent back renders to).
    When the layout renders the shortened history otherwise than the deletion gives, the two
    renders are diffed (`serve.edits.detect_edits`)."""
    tools = [t.model_dump(exclude_none=True) for t in plan.req.tools] if plan.req.tools else None
    said = {"role": "assistant", "content": summary}
    history = [*plan.turn.messages, said]
    lead = next((i for i, m in enumerate(history) if m["role"] != "system"), len(history) - 1)
    kept = [*history[:lead], said]
    prompt = sessions.substitute(key, history, chat.render(tok, history, tools))
    target = sessions.substitute(key, kept, chat.render(tok, kept, tools))
    spans = {sp.index: sp for sp in prompt.spans}
    ds = [Directive(spans[lead].start, spans[len(history) - 1].start, (), mode)]
    if apply_to_list(prompt.tokens, ds) != target.tokens:
        ds, tail = detect_edits(list(prompt.tokens), list(target.tokens), mode=mode)
        if tail:  # an edit reaching the end: one directive to the end
            end = len(prompt.tokens)
            last = ds.pop() if ds and ds[-1].end == end else Directive(end, end, (), mode)
            ds.append(Directive(last.start, end, last.replacement + tuple(tail), mode))
    if key is not None and mode is Mode.FORGET:
        sessions.keep_replies(key, kept)  # the replies it evicts are remembered no more
    return Turn(prompt.tokens, ds, plan.turn.use_tools, plan.turn.applied_edits, kept)


def block(summary: str | None) -> dict:
    """The `compaction` content block (null content: the compaction failed)."""
    return {"type": "compaction", "content": summary or None}
