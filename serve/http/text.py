"""The text side of a turn, host-only: the ids a model with a small vocabulary sees
(`ModVocabTokenizer`), tool calls in a reply (`parse_tool_calls`, `tool_markers`: DeepSeek
V3 / V3.1 layouts, Hermes blocks) and the text a stream may send so far (`OutputText`: stop
strings and markers held back)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence

from serve.chat_formats import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP


# ---- tokenizers ---------------------------------------------------------------------------
class ModVocabTokenizer:
    """A `serve.chat.ChatTokenizer` for a model with a smaller vocabulary: every id it makes
    (text and special tokens) is taken modulo `vocab`; decoding reads ids as the base
    tokenizer's own. Duck-types what `serve.chat.render` uses (`format`, `encode`, `special`)."""

    def __init__(self, base, vocab: int):
        self.base, self.format, self.vocab_size = base, base.format, int(vocab)

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        return [i % self.vocab_size for i in self.base.encode(text, limit)]

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
    return (HERMES_BEGIN,) if tokenizer.format.name == "chatml" else (CALLS_BEGIN,)


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
    content, with no calls, except a last Hermes block the budget cut (no closing tag) after
    complete ones: it is dropped and the complete calls kept (the finish reason says "length")."""
    calls: list[dict] = []
    if CALLS_BEGIN in text:
        content, rest = text.split(CALLS_BEGIN, 1)
        rest = rest.split(CALLS_END, 1)[0]
        for body in rest.split(CALL_BEGIN)[1:]:
            body = body.split(CALL_END, 1)[0]
            if TOOL_SEP not in body:
                return text, []
            left, right = body.split(TOOL_SEP, 1)
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
        blocks = re.findall(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", text, re.S)
        for body, closed in blocks:
            try:
                obj = json.loads(body)
                calls.append(_call(obj["name"], obj.get("arguments", {})))
            except (ValueError, KeyError, TypeError, AttributeError):
                if closed or not calls:
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
        self.stop: str | None = None  # ... the one that cut the text
        self.text = ""

    def update(self, ids: Sequence[int], final: bool = False) -> str:
        """The new content to send after the output became `ids` (end-of-turn tokens are not
        text: `ignore_eos` generates through them)."""
        text = self.tok.decode([i for i in ids if i not in self.stop_ids])
        if not final:
            text = text.rstrip("\ufffd")  # a multi-byte character may still be arriving
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            cut, self.stop = min(found)
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
