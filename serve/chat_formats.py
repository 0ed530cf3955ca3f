"""Chat layouts: how a conversation becomes pieces (special tokens, text, a message's own
content, the tool schemas) that `serve.chat.render` encodes one by one; each layout also says
the token that ends a reply and what follows it. Two, each a model's own:

DeepSeek (`DEEPSEEK`): DeepSeek-V3's special tokens. Departure from its published template, for
prefix stability: every tool result is wrapped in its own `<｜tool▁outputs▁begin｜>` ...
`<｜tool▁outputs▁end｜>` pair, instead of one pair around a run of consecutive results. Tool
schemas (`tools=`, OpenAI format) are rendered the way DeepSeek-V3.1's template does: a
`## Tools` section with one `### name` / description / JSON parameters entry per tool and the
call-format instructions, appended to the system prompt (after the leading system messages, or
right after the BOS token when there are none): a span of its own between messages.

ChatML (`CHATML`, SmolLM2's template): `<|im_start|>{role}\\n{content}<|im_end|>\\n` per
message, no BOS, generation prompt `<|im_start|>assistant\\n`. As the GGUF's template does, a
conversation whose first message is not a system message starts with the default system
message `<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging
Face<|im_end|>\\n` (it is no message of the list: no span). SmolLM2's template knows no tools;
chosen here: tool results are messages of role `tool` (`<|im_start|>tool\\n...<|im_end|>\\n`);
an assistant's `tool_calls` follow its content as text, Hermes-style, one
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block per call (a newline
before each block unless it opens the message; `<tool_call>` is plain text in SmolLM2's
vocabulary); tool schemas are a `## Tools` section (DeepSeek's per-tool entries, then how to
call a tool in the `<tool_call>` form) appended to the content of the last leading system
message (or of the default one), inside that message's span, after its content.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Piece kinds: a special token, plain text, the message's own content, the tool schemas, a
# re-sent reasoning block.
SPECIAL, TEXT, CONTENT, TOOLS, REASONING = "s", "t", "c", "T", "r"


@dataclasses.dataclass(frozen=True)
class Block:
    """A run of pieces: one message's (`index` its position, `role` its role), or none's
    (`index` None: BOS, a tools section, a default system message, the generation prompt)."""

    index: int | None
    role: str | None
    pieces: list[tuple[str, str]]  # (special token or text, kind)


def _content(m) -> str:
    content = m.get("content") or ""
    if not isinstance(content, str):  # OpenAI content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def _leading_system(messages) -> int:
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    return n


def _arguments(call) -> tuple[str, object]:
    fn = call.get("function", call)
    return fn["name"], fn.get("arguments", "{}")


TOOLS_HEAD = "\n\n## Tools\nYou have access to the following tools:\n"
TOOLS_FORMAT = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{TOOL_SEP}tool_call_arguments{CALL_END}"
    f"{{{{additional_tool_calls}}}}{CALLS_END}\n\n"
    "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters "
    "Schema\n- For multiple tool calls, chain them directly without separators or spaces\n"
)


class ChatFormat:
    """A chat layout: how a conversation becomes pieces (`blocks`), the `## Tools` text (its
    call-format instructions: `tools_format`), and the special token that ends an assistant
    reply (`stop`). `render` does the encoding."""

    name: str
    stop: str
    tools_format: str
    roles = ("system", "user", "assistant", "tool")

    def blocks(self, messages, tools, add_generation_prompt: bool) -> Iterator[Block]:
        raise NotImplementedError

    def tools_text(self, tools) -> str:
        """The `## Tools` section: one `### name` / description / JSON parameters entry per
        OpenAI-format tool schema, then how to call a tool."""
        parts = [TOOLS_HEAD]
        for t in tools:
            fn = t.get("function", t)
            params = json.dumps(fn.get("parameters", {}), ensure_ascii=False)
            parts.append(
                f"\n### {fn['name']}\nDescription: {fn.get('description', '')}\n\n"
                f"Parameters: {params}\n"
            )
        return "".join(parts) + self.tools_format

    def close_reply(self) -> list[tuple[str, str]]:
        """Pieces that follow an assistant reply's `stop` token before the next message."""
        return []

    def reply_head(self) -> list[tuple[str, str]]:
        """An assistant message's head: what the generation prompt places, too."""
        raise NotImplementedError

    def reply_body(self, m) -> list[tuple[str, str]]:
        """An assistant message's pieces after its head: content, tool calls, stop token and
        `close_reply`'s pieces."""
        raise NotImplementedError

    def reasoning_pieces(self, reasoning: str) -> list[tuple[str, str]]:
        """A reasoning block, as the model writes it before its reply's content."""
        return [(f"{THINK_OPEN}\n", TEXT), (reasoning, TEXT), (f"\n{THINK_CLOSE}\n\n", TEXT)]

    def _check_role(self, i: int, role) -> None:
        if role not in self.roles:
            raise ValueError(f"message {i}: unknown role {role!r}")

    def __repr__(self) -> str:
        return f"<chat format {self.name}>"


class DeepSeekFormat(ChatFormat):
    """DeepSeek-V3's layout (see the module docstring)."""

    name, stop, tools_format = "deepseek", EOS, TOOLS_FORMAT

    def reply_head(self):
        return [(ASSISTANT, SPECIAL)]

    def reply_body(self, m):
        calls = self._tool_calls(m["tool_calls"]) if m.get("tool_calls") else []
        return [(_content(m), CONTENT), *calls, (EOS, SPECIAL), *self.close_reply()]

    def blocks(self, messages, tools, add_generation_prompt):
        yield Block(None, None, [(BOS, SPECIAL)])
        n_system = _leading_system(messages)
        tools_block = Block(None, None, [(self.tools_text(tools), TOOLS)]) if tools else None
        for i, m in enumerate(messages):
            if i == n_system and tools_block:
                yield tools_block
            role = m.get("role")
            self._check_role(i, role)
            if role == "assistant":
                yield Block(i, role, [*self.reply_head(), *self.reply_body(m)])
                continue
            if role == "system":
                head, tail = [], []
            elif role == "user":
                head, tail = [(USER, SPECIAL)], []
            else:  # tool
                head = [(OUTPUTS_BEGIN, SPECIAL), (OUTPUT_BEGIN, SPECIAL)]
                tail = [(OUTPUT_END, SPECIAL), (OUTPUTS_END, SPECIAL)]
            yield Block(i, role, [*head, (_content(m), CONTENT), *tail])
        if tools_block and n_system == len(messages):  # only system messages (or none)
            yield tools_block
        if add_generation_prompt:
            yield Block(None, None, self.reply_head())

    @staticmethod
    def _tool_calls(calls) -> list[tuple[str, str]]:
        out = [(CALLS_BEGIN, SPECIAL)]
        for call in calls:
            name, args = _arguments(call)
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            out += [
                (CALL_BEGIN, SPECIAL),
                ("function", TEXT),
                (TOOL_SEP, SPECIAL),
                (f"{name}\n```json\n{args}\n```", TEXT),
                (CALL_END, SPECIAL),
            ]
        out.append((CALLS_END, SPECIAL))
        return out


class ChatMLFormat(ChatFormat):
    """ChatML as SmolLM2's template writes it, with tools added (see the module docstring)."""

    name, stop = "chatml", IM_END
    tools_format = (
        "\nTo call a tool, answer with one block per call:\n"
        '<tool_call>\n{"name": "tool_name", "arguments": {...}}\n</tool_call>\n'
        "where `tool_name` is one of the tools above and `arguments` is JSON that follows its "
        "Parameters schema. Each call's result comes back in a `tool` message.\n"
    )

    def __init__(self, default_system: str | None = SMOLLM2_SYSTEM):
        self.default_system = default_system

    def close_reply(self):
        return [("\n", TEXT)]

    def reply_head(self):
        return self._head("assistant")

    def reply_body(self, m):
        calls = self._tool_calls(m) if m.get("tool_calls") else []
        return self._body(_content(m), calls, [])

    def blocks(self, messages, tools, add_generation_prompt):
        n_system = _leading_system(messages)
        schemas = [(self.tools_text(tools), TOOLS)] if tools else []
        if n_system == 0 and (tools or (messages and self.default_system is not None)):
            system = self.default_system or ""
            yield Block(None, "system", [*self._head("system"), *self._body(system, [], schemas)])
        for i, m in enumerate(messages):
            role = m.get("role")
            self._check_role(i, role)
            if role == "assistant":
                yield Block(i, role, [*self.reply_head(), *self.reply_body(m)])
                continue
            after = schemas if i == n_system - 1 else []
            yield Block(i, role, [*self._head(role), *self._body(_content(m), [], after)])
        if add_generation_prompt:
            yield Block(None, None, self.reply_head())

    @staticmethod
    def _head(role):
        return [(IM_START, SPECIAL), (f"{role}\n", TEXT)]

    def _body(self, content, calls, after):
        return [(content, CONTENT), *calls, *after, (IM_END, SPECIAL), *self.close_reply()]

    @staticmethod
    def _tool_calls(m) -> list[tuple[str, str]]:
        blocks = []
        for k, call in enumerate(m["tool_calls"]):
            name, args = _arguments(call)
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass  # not JSON: kept as a string
            body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            sep = "\n" if (k or _content(m)) else ""
            blocks.append(f"{sep}<tool_call>\n{body}\n</tool_call>")
        return [("".join(blocks), TEXT)]


DEEPSEEK = DeepSeekFormat()
CHATML = ChatMLFormat()
