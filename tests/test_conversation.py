"""The HTTP server's conversation side, host-only (no server, no model): replies rendered with
their sampled ids, message-granular directives as token directives, server-side context
editing over a session's record."""

from __future__ import annotations

import pytest

from leyline_jax.directives import Mode, apply_to_list
from serve import chat
from serve.http.extensions import ClearToolUsesEdit, MessageDirective
from serve.http.history import ContextEditor, ReplyMemory, edit_messages, token_directives
from serve.policies import STUB


@pytest.fixture(scope="module")
def tok():
    return chat.ChatTokenizer()


def agent_history():
    """user, a text reply, user, a tool call, its result, user: the usual agent shape."""
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    return [
        {"role": "user", "content": "List the files, then summarise."},
        {"role": "assistant", "content": "Sure, listing them now."},
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py c.py " * 20},
        {"role": "user", "content": "Thanks."},
    ]


def test_a_substituted_reply_moves_every_span_after_it(tok):
    msgs = agent_history()
    r = chat.render(tok, msgs)
    replies = ReplyMemory()
    sampled = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # longer than the re-encoded text
    replies.remember("s", msgs[1]["content"], sampled)
    out = replies.substitute("s", msgs, r)
    grow = len(sampled) - (r.spans[1].content_end - r.spans[1].content_start)
    assert grow > 0
    assert out.tokens[out.spans[1].content_start : out.spans[1].content_end] == sampled
    for before, after in zip(r.spans[2:], out.spans[2:], strict=True):
        assert after.start == before.start + grow and after.end == before.end + grow
        assert out.tokens[after.start : after.end] == r.tokens[before.start : before.end]
    assert out.tokens[out.spans[-1].end :] == r.tokens[r.spans[-1].end :]  # generation prompt
    # another session, or none: unchanged
    assert replies.substitute("t", msgs, r) is r and replies.substitute(None, msgs, r) is r


@pytest.mark.parametrize("sampled_len", [3, 30])
def test_directives_after_a_substituted_reply_are_exact(tok, sampled_len):
    """A directive on the tool result after a remembered reply whose sampled ids are shorter
    or longer than its re-encoded text: one token directive per message directive, in its
    own mode, turning the substituted render into the substituted edited render."""
    msgs = agent_history()
    replies = ReplyMemory()
    replies.remember("s", msgs[1]["content"], list(range(100, 100 + sampled_len)))
    ds_msg = [
        MessageDirective(messages=(0, 0), replacement="List the files."),
        MessageDirective(messages=(4, 4), replacement="[evicted]", mode="forget"),
    ]
    edited = edit_messages(msgs, ds_msg)
    prompt = replies.substitute("s", msgs, chat.render(tok, msgs))
    target = replies.substitute("s", edited, chat.render(tok, edited))
    ds = token_directives(prompt, target, ds_msg, Mode.AMORTIZE)
    assert [d.mode for d in ds] == [Mode.AMORTIZE, Mode.FORGET]
    assert apply_to_list(prompt.tokens, ds) == target.tokens
    tool = prompt.spans[4]  # the FORGET lies inside the tool message
    assert tool.start <= ds[1].start and ds[1].end <= tool.end
    # the spans before substitution would be wrong: they point elsewhere
    stale = chat.render(tok, msgs).spans[4]
    assert (stale.start, stale.end) != (tool.start, tool.end)


def test_edit_messages_merges_a_range_into_its_first_message():
    msgs = agent_history()
    out = edit_messages(msgs, [MessageDirective(messages=(3, 4), replacement="(ls ran)")])
    assert len(out) == len(msgs) - 1 and out[3] == {"role": "assistant", "content": "(ls ran)"}
    assert out[4] == msgs[5] and msgs[3].get("tool_calls")  # the input is not changed


def test_context_editing_is_sticky_and_touches_tool_results_only(tok):
    edit = ClearToolUsesEdit(
        type="clear_tool_uses_20250919",
        trigger={"type": "tool_uses", "value": 0},  # fires past it: one tool use
        keep={"type": "tool_uses", "value": 0},
    )
    ctx = ContextEditor(lambda text: len(tok.encode(text)))
    msgs = agent_history()
    out, report = ctx.apply("s", msgs, edit)
    assert out[4]["content"] == STUB and msgs[4]["content"] != STUB
    assert report["cleared_tool_uses"] == 1
    assert report["cleared_input_tokens"] == len(tok.encode(msgs[4]["content"])) - len(
        tok.encode(STUB)
    )
    # a later request in the same session keeps it cleared (even with keep raised)
    kept = ClearToolUsesEdit.model_validate(
        {**edit.model_dump(), "keep": {"type": "tool_uses", "value": 5}}
    )
    assert ctx.apply("s", msgs, kept)[0][4]["content"] == STUB
    # the session's history moved on (the old index is a user message now): never stubbed
    other = [{"role": "user", "content": f"message {i}"} for i in range(6)]
    out, report = ctx.apply("s", other, kept)
    assert out == other and report["cleared_tool_uses"] == 0
    # a closed session's record goes with it; a request without a session keeps none
    ctx.forget("s")
    assert ctx.apply("s", msgs, kept)[0][4]["content"] == msgs[4]["content"]
    ctx.apply(None, msgs, edit)
    assert ctx.apply(None, msgs, kept)[0][4]["content"] == msgs[4]["content"]
