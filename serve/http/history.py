"""A session's history as the server keeps it, host-only: its replies' sampled ids
(`ReplyMemory`, so a re-sent reply renders as sampled), explicit message-granular directives
as an edited history and as token directives (`edit_messages`, `token_directives`), and
Anthropic's `clear_tool_uses_20250919` over the session's record (`ContextEditor`), spliced as
token directives (`clear_directives`)."""

from __future__ import annotations

import array
import collections
import copy
import dataclasses
import json
from collections.abc import Sequence

from leyline_jax.directives import Directive, Mode, apply_to_list
from serve import chat
from serve.edits import detect_edits, strongest
from serve.policies import INPUT_STUB, STUB, call_of, pinned


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
        self._by_session = collections.OrderedDict()  # name -> [(text, ids)], oldest first

    def remember(self, session: str, text: str, ids: Sequence[int]) -> None:
        replies = self._by_session.setdefault(session, [])
        self._by_session.move_to_end(session)
        replies.append((text, array.array("i", ids)))  # 4 bytes an id
        del replies[: max(0, len(replies) - self.per_session)]
        while len(self._by_session) > self.max_sessions:
            self._by_session.popitem(last=False)

    def forget(self, session: str) -> None:
        self._by_session.pop(session, None)

    def keep(self, session: str, texts: set[str]) -> None:
        """Forget the session's replies whose text is not in `texts` (after a FORGET)."""
        if session in self._by_session:
            self._by_session[session] = [r for r in self._by_session[session] if r[0] in texts]

    def export(self) -> dict[str, list[tuple[str, list[int]]]]:
        """Everything remembered (a snapshot's part), oldest session first."""
        return {k: [(t, list(i)) for t, i in v] for k, v in self._by_session.items()}

    def load(self, data: dict, names=None) -> None:
        """Take an `export` back whole, or (`names`) add those sessions' replies alone."""
        taken = collections.OrderedDict(
            (str(k), [(str(t), array.array("i", [int(x) for x in i])) for t, i in v])
            for k, v in data.items()
            if names is None or str(k) in names
        )
        self._by_session = taken if names is None else self._by_session | taken

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
            ids, grow = found.get(span.index), 0
            if ids is not None:
                toks += rendered.tokens[cursor : span.content_start] + list(ids)
                cursor = span.content_end
                grow = len(ids) - (span.content_end - span.content_start)
            spans.append(dataclasses.replace(
                span, start=span.start + shift, end=span.end + shift + grow,
                content_start=span.content_start + shift,
                content_end=span.content_end + shift + grow,
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


@dataclasses.dataclass
class Cleared:
    """What `clear_tool_uses_20250919` makes of a request's history (`ContextEditor.edit`)."""

    before: list[dict]  # the history with the session's earlier clears only (its record)
    after: list[dict]  # the history the model runs: every clear applied
    report: dict  # the `applied_edits` entry (what `after` clears of the history as sent)
    new: set[int]  # the tool results (indices) cleared now, for the session's record


class ContextEditor:
    """Anthropic's context editing (`clear_tool_uses_20250919`) applied by the server, over the
    session's own record of what it cleared. Anthropic's rules, with the prompt's input tokens
    counted as `count` counts a history (the server: the rendered prompt, as `count_tokens`):

    - `trigger`: the edit fires when the history as sent exceeds it (input tokens: the prompt's;
      tool uses: its tool results), strictly.
    - Firing clears every tool result but the `keep` most recent (every tool result counts
      towards `keep`, excluded ones too), less those of `exclude_tools` and pinned ones: the
      result's content becomes `serve.policies.STUB`, and under `clear_tool_inputs` (true, or
      the call's tool named) its call's input becomes `{}`.
    - `clear_at_least`: when the prompt's input tokens would shrink by fewer, nothing new is
      cleared.
    - `applied_edits`: `cleared_tool_uses`, the tool results cleared in the history the model
      runs; `cleared_input_tokens`, how much that shrinks the prompt (never below 0).

    A session's record keeps what was cleared cleared in its later requests, whatever they ask
    (so its KV keeps matching); a history only grows under fixed parameters, so this clears what
    Anthropic's stateless rule clears. `mode`: the directive a newly cleared result is spliced
    as when the request names none ("amortize" or "forget": `serve.http.server`'s
    `--context-edit-mode`). `edit` is pure (a long history is counted outside any lock);
    `apply` and `HttpSessions.clear_tool_uses` keep the record."""

    def __init__(self, count_tokens, mode: str = "amortize"):
        self.count = count_tokens
        self.mode = mode
        self.cleared: dict[str, set[int]] = {}

    def _size(self, messages: list[dict]) -> int:
        """The history's tokens, message by message (without a renderer: contents and calls)."""
        return sum(
            self.count(m.get("content") or "")
            + sum(self.count(json.dumps(c)) for c in m.get("tool_calls") or [])
            for m in messages
        )

    @staticmethod
    def _name(messages: list[dict], i: int) -> str | None:
        m = messages[i]
        return m.get("name") or ((call_of(messages, i)[1] or {}).get("function") or {}).get("name")

    @staticmethod
    def _blanks(edit, call) -> bool:
        """Whether clearing the result of `call` clears its input too."""
        inputs = edit.clear_tool_inputs
        if isinstance(inputs, bool):
            return inputs
        return ((call or {}).get("function") or {}).get("name") in inputs

    def _cleared(self, messages: list[dict], which, edit) -> list[dict]:
        """`messages` with the tool results `which` (indices) cleared."""
        out = copy.deepcopy(messages)
        for i in sorted(which):
            out[i]["content"] = STUB
            j, call = call_of(out, i)
            if call is not None and not pinned(out[j]) and self._blanks(edit, call):
                call.setdefault("function", {})["arguments"] = INPUT_STUB
        return out

    def edit(self, record: set[int], messages: list[dict], edit, count=None) -> Cleared:
        """The request's history before and after the edit, and its report, given the session's
        record (the indices it cleared before; not changed: `Cleared.new` says what to add).
        `count`: a history's input tokens (default: its contents' and calls' tokens)."""
        count = count or self._size
        tools = [i for i, m in enumerate(messages) if m.get("role") == "tool"]
        clearable = {i for i in tools if not pinned(messages[i])}
        prior = set(record) & clearable
        before = self._cleared(messages, prior, edit) if prior else messages
        sent = None  # the history's input tokens as sent, once counted
        trig = edit.trigger
        if trig.type == "tool_uses":
            fired = len(tools) > trig.value
        else:
            sent = count(messages)
            fired = sent > trig.value
        excluded = set(edit.exclude_tools or ())
        old = tools[: max(len(tools) - edit.keep.value, 0)] if fired else []
        new = {i for i in old if i in clearable and self._name(messages, i) not in excluded}
        new -= prior
        after = before
        if new:
            after = self._cleared(messages, prior | new, edit)
            sent = count(messages) if sent is None else sent
            least = edit.clear_at_least.value if edit.clear_at_least else 0
            if max(sent - count(after), 0) < least:
                after, new = before, set()
        shown = prior | new
        if shown and sent is None:
            sent = count(messages)
        report = {
            "type": "clear_tool_uses_20250919",
            "cleared_tool_uses": len(shown),
            "cleared_input_tokens": max(sent - count(after), 0) if shown else 0,
        }
        return Cleared(before, after, report, new)

    def apply(self, key: str | None, messages: list[dict], edit, count=None):
        """(the history the model runs, the `applied_edits` entry), the session `key`'s record
        kept (None: no record)."""
        record = self.cleared.setdefault(key, set()) if key is not None else set()
        e = self.edit(record, messages, edit, count)
        record |= e.new
        return e.after, e.report

    def forget(self, key: str) -> None:
        self.cleared.pop(key, None)


def clear_directives(prompt: chat.Rendered, target: chat.Rendered, mode: Mode) -> list:
    """Token directives, in `mode`, turning the rendered history `prompt` into `target`, the same
    messages with some contents (and calls' inputs) changed: per message that differs, its
    tokens replaced by the target's, less the tokens they begin and end with alike. When that
    does not give `target` (a layout that renders neighbours differently), the two renders are
    diffed (`serve.edits.detect_edits`)."""
    p_toks, e_toks = list(prompt.tokens), list(target.tokens)
    new_span = {sp.index: sp for sp in target.spans}
    out = []
    for sp in sorted(prompt.spans, key=lambda sp: sp.start):
        a, b = sp.start, sp.end
        e = new_span.get(sp.index)
        if e is None:
            break
        repl = e_toks[e.start : e.end]
        if p_toks[a:b] == repl:
            continue
        while a < b and repl and p_toks[a] == repl[0]:
            a, repl = a + 1, repl[1:]
        while a < b and repl and p_toks[b - 1] == repl[-1]:
            b, repl = b - 1, repl[:-1]
        out.append(Directive(a, b, tuple(repl), mode))
    if apply_to_list(p_toks, out) == e_toks:
        return out
    ds, tail = detect_edits(p_toks, e_toks, mode=mode)
    if tail:
        if ds and ds[-1].end == len(p_toks):
            last = ds.pop()
            ds.append(Directive(last.start, last.end, last.replacement + tuple(tail), mode))
        else:
            ds.append(Directive(len(p_toks), len(p_toks), tuple(tail), mode))
    return ds
