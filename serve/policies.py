"""Policies: what to edit in a conversation. A policy only edits the message list the harness
sends (it never touches a cache); the engine turns the edit into directives (`serve.edits`).

- `Truncate(keep=2)`: the reference rule — tool outputs older than the `keep` most recent tool
  turns are replaced by a short stub.
- `ClearToolUses(...)`: the parameters agent harnesses already expose for the same job: a
  trigger (input tokens, or tool uses), `keep` (most recent tool uses left alone),
  `clear_at_least` (an activation must clear at least this many tokens, or it does not happen),
  `exclude_tools` (never cleared), `clear_tool_inputs` (also blank the call's arguments: True
  for every cleared call, or a tuple of the tool names whose calls are blanked).

Policies are stateful per session: what was cleared stays cleared at later steps (as a harness
that edits its own history would keep it), so edits only ever grow (pins aside, below).

Pinned messages (PIN): a message with `"pinned": True` is never edited by either policy. Pinned
tool messages are left out of clearing as `exclude_tools` leaves its tools out: never a
candidate, never counted as cleared, while `keep` still counts every tool turn (a pinned one
among the most recent `keep` uses up a place); a pinned assistant message keeps its calls'
arguments under `clear_tool_inputs`. A message cleared before it was pinned is shown
whole while pinned (it stays in the session's record, so it is cleared again once unpinned).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

STUB = "[evicted: older tool output]"
INPUT_STUB = "{}"


def _tool_turns(messages) -> list[int]:
    return [i for i, m in enumerate(messages) if m.get("role") == "tool"]


def pinned(message: dict) -> bool:
    """Whether a policy must leave this message as it is."""
    return message.get("pinned") is True


def call_of(messages, i: int):
    """(assistant message index, tool call) that produced tool message i, if found."""
    call_id = messages[i].get("tool_call_id")
    for j in range(i - 1, -1, -1):
        for call in messages[j].get("tool_calls") or []:
            if call_id is None or call.get("id") == call_id:
                return j, call
    return None, None


@dataclasses.dataclass
class Truncate:
    keep: int = 2
    stub: str = STUB

    def __post_init__(self):
        if self.keep < 0:
            raise ValueError("keep must be >= 0")

    def apply(self, session: str, messages: list[dict]) -> list[dict]:
        del session  # stateless: "older than keep turns" only ever grows
        out = copy.deepcopy(messages)
        tools = _tool_turns(out)
        for i in tools[: max(len(tools) - self.keep, 0)]:
            if not pinned(out[i]):
                out[i]["content"] = self.stub
        return out


@dataclasses.dataclass
class ClearToolUses:
    trigger_input_tokens: int | None = 30_000
    trigger_tool_uses: int | None = None
    keep: int = 3
    clear_at_least: int = 0
    exclude_tools: tuple[str, ...] = ()
    clear_tool_inputs: bool | tuple[str, ...] = False
    stub: str = STUB
    count_tokens: object = None  # callable str -> int; default: ~4 characters per token
    # per session, the tool messages (indices) cleared so far: they stay cleared (a caller
    # that keeps its sessions' records elsewhere passes its store)
    cleared: dict[str, set[int]] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.trigger_input_tokens is None and self.trigger_tool_uses is None:
            raise ValueError("set trigger_input_tokens or trigger_tool_uses")
        if self.keep < 0 or self.clear_at_least < 0:
            raise ValueError("keep and clear_at_least must be >= 0")

    def _tokens(self, text: str) -> int:
        return self.count_tokens(text) if self.count_tokens else math.ceil(len(text) / 4)

    def _size(self, messages) -> int:
        return sum(
            self._tokens(m.get("content") or "")
            + sum(self._tokens(json.dumps(c)) for c in m.get("tool_calls") or [])
            for m in messages
        )

    def clears_input(self, call) -> bool:
        """Whether clearing a tool use blanks this call's arguments."""
        if isinstance(self.clear_tool_inputs, bool):
            return self.clear_tool_inputs
        return (call.get("function") or {}).get("name") in self.clear_tool_inputs

    def _blanked_call(self, messages, i: int):
        """The call whose arguments clearing tool message i blanks, if any (never a call in a
        pinned assistant message)."""
        j, call = call_of(messages, i)
        if call is None or pinned(messages[j]) or not self.clears_input(call):
            return None
        return call

    def _clear(self, out, i: int) -> None:
        out[i]["content"] = self.stub
        call = self._blanked_call(out, i)
        if call is not None:
            call.setdefault("function", {})["arguments"] = INPUT_STUB

    def applied(self, session: str, messages: list[dict]) -> tuple[int, int]:
        """What `apply` clears in `messages` (the history before it): (tool uses cleared,
        input tokens that removes: each cleared output's tokens less the stub's, and each
        blanked call's arguments less the input stub's)."""
        uses = tokens = 0
        for i in sorted(self.cleared.get(session, ())):
            if i >= len(messages) or messages[i].get("role") != "tool" or pinned(messages[i]):
                continue
            uses += 1
            tokens += self._tokens(messages[i].get("content") or "") - self._tokens(self.stub)
            call = self._blanked_call(messages, i)
            if call is not None:
                args = (call.get("function") or {}).get("arguments") or ""
                args = args if isinstance(args, str) else json.dumps(args)
                tokens += self._tokens(args) - self._tokens(INPUT_STUB)
        return uses, max(tokens, 0)

    def apply(self, session: str, messages: list[dict]) -> list[dict]:
        out = copy.deepcopy(messages)
        cleared = self.cleared.setdefault(session, set())
        for i in sorted(cleared):
            # (a history that moved on; a message pinned since)
            if i < len(out) and out[i].get("role") == "tool" and not pinned(out[i]):
                self._clear(out, i)
        tools = _tool_turns(out)
        fired = (
            self.trigger_input_tokens is not None and self._size(out) >= self.trigger_input_tokens
        ) or (self.trigger_tool_uses is not None and len(tools) >= self.trigger_tool_uses)
        if not fired:
            return out
        name = {
            i: out[i].get("name") or (call_of(out, i)[1] or {}).get("function", {}).get("name")
            for i in tools
        }
        candidates = [
            i
            for i in tools[: max(len(tools) - self.keep, 0)]
            if i not in cleared and name[i] not in self.exclude_tools and not pinned(out[i])
        ]
        gain = sum(
            self._tokens(out[i].get("content") or "") - self._tokens(self.stub) for i in candidates
        )
        if not candidates or gain < self.clear_at_least:
            return out
        for i in candidates:
            self._clear(out, i)
            cleared.add(i)
        return out


def make(name: str, **kw):
    """A policy by command-line name: 'truncate' or 'clear_tool_uses'."""
    kinds = {"truncate": Truncate, "clear_tool_uses": ClearToolUses}
    if name not in kinds:
        raise ValueError(f"unknown policy {name!r}: {', '.join(kinds)}")
    return kinds[name](**kw)
