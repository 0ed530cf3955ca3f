"""The conversation side of the HTTP server, host-only and testable without one: the token ids
a chat request becomes and the text its output becomes.

- `ModVocabTokenizer`: a tokenizer's ids folded into a smaller model vocabulary.
- `parse_tool_calls`, `tool_markers`, `OutputText`: tool calls in a reply (DeepSeek V3 / V3.1
  layouts, Hermes blocks) and the text a stream may send so far (stop strings and markers held
  back).
- `ReplyMemory`: each session's replies' sampled ids, so a re-sent reply renders as sampled.
- `edit_messages`, `token_directives`: explicit message-granular directives
  (`serve.openai_api.MessageDirective`) as an edited history and as token directives.
- `ContextEditor`: Anthropic-style `clear_tool_uses_20250919` over a session's record.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import uuid
from collections.abc import Sequence

from serve import chat

__all__ = [
    "ContextEditor",
    "ModVocabTokenizer",
    "OutputText",
    "ReplyMemory",
    "edit_messages",
    "parse_tool_calls",
    "token_directives",
    "tool_markers",
]


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

    def substitute(self, session: str | None, messages: list[dict], rendered) -> chat.Rendered:
        """`rendered` with remembered replies' ids in their messages' content spans, and every
        span (and the tools' span) moved to where it now lies."""
        replies = self._by_session.get(session) if session is not None else None
        if not replies:
            return rendered
        found = {}  # span index -> the ids its content becomes
        j = 0
        for span in sorted(rendered.spans, key=lambda sp: sp.content_start):
            m = messages[span.index]
            if span.role != "assistant" or m.get("tool_calls"):
                continue
            text = m.get("content") or ""
            k = next((k for k in range(j, len(replies)) if replies[k][0] == text), None)
            if k is not None:
                found[span.index] = replies[k][1]
                j = k + 1
        if not found:
            return rendered
        toks, spans, shift, cursor = [], [], 0, 0
        for span in sorted(rendered.spans, key=lambda sp: sp.start):
            ids = found.get(span.index)
            if ids is None:
                spans.append(dataclasses.replace(
                    span, start=span.start + shift, end=span.end + shift,
                    content_start=span.content_start + shift, content_end=span.content_end + shift,
                ))  # fmt: skip
                continue
            toks += rendered.tokens[cursor : span.content_start] + list(ids)
            cursor = span.content_end
            grow = len(ids) - (span.content_end - span.content_start)
            spans.append(dataclasses.replace(
                span, start=span.start + shift, end=span.end + shift + grow,
                content_start=span.content_start + shift,
                content_end=span.content_start + shift + len(ids),
            ))  # fmt: skip
            shift += grow
        toks += rendered.tokens[cursor:]
        tools = rendered.tools  # the tool schemas come before every assistant message
        return chat.Rendered(toks, sorted(spans, key=lambda sp: sp.index), tools)


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


def token_directives(prompt: chat.Rendered, edited: chat.Rendered, directives, default_mode):
    """The token-level directives (in `prompt`'s coordinates) that turn the rendered history
    `prompt` into the rendered edited history `edited` (both as the engine gets them: replies'
    sampled ids in place, spans where they lie): one per message directive, replacing its
    messages' tokens by the edited message's, less the tokens they begin and end with alike
    (role markup, shared text), in its mode (`default_mode`, a `Mode`, when it names none).
    When the layout renders more than those messages differently (a chat format that groups
    neighbouring messages, say), the two renders are diffed instead
    (`serve.edits.detect_edits`) and each edit takes the strongest mode of the directives it
    touches."""
    from leyline_jax.directives import Directive, Mode, apply_to_list
    from serve.edits import detect_edits, strongest

    by_index = {sp.index: sp for sp in prompt.spans}
    new_index = {sp.index: sp for sp in edited.spans}
    p_toks, e_toks = list(prompt.tokens), list(edited.tokens)
    out, regions, removed = [], [], 0
    for d in sorted(directives, key=lambda d: d.messages):
        i, j = d.messages
        a, b = by_index[i].start, by_index[j].end
        e = new_index[i - removed]
        repl = e_toks[e.start : e.end]
        removed += j - i
        while a < b and repl and p_toks[a] == repl[0]:
            a, repl = a + 1, repl[1:]
        while a < b and repl and p_toks[b - 1] == repl[-1]:
            b, repl = b - 1, repl[:-1]
        mode = Mode[d.mode.upper()] if d.mode else default_mode
        regions.append((by_index[i].start, by_index[j].end, mode))
        if a < b or repl:
            out.append(Directive(a, b, tuple(repl), mode))
    if apply_to_list(p_toks, out) == e_toks:
        return out
    ds, tail = detect_edits(p_toks, e_toks)
    if tail:  # an edit reaching the end of the history: one directive to the end
        if ds and ds[-1].end == len(p_toks):
            last = ds.pop()
            ds.append(Directive(last.start, last.end, last.replacement + tuple(tail)))
        else:
            ds.append(Directive(len(p_toks), len(p_toks), tuple(tail)))
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
        name = key if key is not None else f"request-{uuid.uuid4().hex}"
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
            cleared={name: self.cleared.setdefault(name, set()) if key else set()},
        )
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
