"""Anthropic's Messages API request (`MessagesRequest`; `MessagesPrompt`, what `count_tokens`
takes), its messages as chat messages (`chat_messages`), the chat request a message runs as
(`chat_request`) and the session a request names (`session_name`). The route:
`serve.http.messages`.

Validated strictly, as Anthropic does: an unknown top-level field is refused ("Extra inputs are
not permitted"), and so is one in a message, `metadata`, `tool_choice`, `output_config` or
`context_management`. Content blocks and tools take the fields Anthropic's betas add to them
(`cache_control`, `citations`, `caller`, `defer_loading`...), ignored. `system` and a message's
`content` may be a string (one text block); a message's text blocks are concatenated, as chat
content parts are. A message of role `system` (text only; Claude Code sends its environment so)
is a system message where it stands. Thinking blocks in assistant turns are dropped (the model
did not write them); `thinking`, `output_config.effort`, `service_tier` and `cache_control` are
accepted and ignored. A `compaction` block sent back drops everything before it, as Anthropic's
does (`chat_messages`); `compact_20260112` is `CompactEdit`, served by `serve.http.compaction`.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, field_validator

from serve.http import errors
from serve.http.errors import APIError, validation_param
from serve.http.extensions import (
    ClearThinkingEdit,
    ClearToolUsesEdit,
    Closed,
    InputTokens,
    LeylineOptions,
)
from serve.http.schema import ChatCompletionRequest, Open, refused


def _one_of(*models: type[BaseModel], what: str):
    """A union of `models` told apart by their `type` (a Literal each); a value of another type
    is refused naming the kinds taken. Tagged by class name, which an error's field path leaves
    out (`serve.http.errors.validation_param`)."""
    tags = {get_args(m.model_fields["type"].annotation)[0]: m.__name__ for m in models}

    def tag(v):
        t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
        return tags.get(t) if isinstance(t, str) else None

    kinds = ", ".join(map(repr, tags))
    return Annotated[
        Union[tuple(Annotated[m, Tag(m.__name__)] for m in models)],  # noqa: UP007
        Discriminator(tag, custom_error_type="unknown_type",
                      custom_error_message=f"{what} type must be one of {kinds}"),
    ]  # fmt: skip


def _blocks(cls, v):
    """A string is one text block (Anthropic's shorthand); for a `mode="before"` validator."""
    return [{"type": "text", "text": v}] if isinstance(v, str) else v


# ---- content blocks --------------------------------------------------------------------------
class TextBlock(Open):
    type: Literal["text"]
    text: str


class ToolUseBlock(Open):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(Open):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: list[TextBlock] = Field(default_factory=list)  # text only
    is_error: bool = False

    _text = field_validator("content", mode="before")(classmethod(_blocks))


class ThinkingBlock(Open):
    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(Open):
    type: Literal["redacted_thinking"]
    data: str


class CompactionBlock(Open):
    """A `compaction` block sent back (Anthropic's round trip): the summary the server wrote in
    place of everything before it; null content (a failed compaction) is a no-op."""

    type: Literal["compaction"]
    content: str | None = Field(min_length=1)


Block = _one_of(
    TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock,
    CompactionBlock, what="content block",
)  # fmt: skip


class InputMessage(Closed):
    role: Literal["user", "assistant", "system"]  # system: text only (Claude Code sends it)
    content: list[Block] = Field(min_length=1)

    _text = field_validator("content", mode="before")(classmethod(_blocks))


# ---- tools -----------------------------------------------------------------------------------
class ToolDefinition(Open):
    type: Literal["custom"] | None = None  # Anthropic's server tools are not served
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("input_schema")
    @classmethod
    def _object(cls, v):
        if v.get("type") != "object":
            raise ValueError("the schema's `type` must be 'object'")
        return v


class ToolChoiceAuto(Closed):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Closed):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Closed):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Closed):
    type: Literal["none"]


ToolChoice = _one_of(
    ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone, what="tool_choice"
)
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # chat's tool_choice


# ---- the rest of the request -----------------------------------------------------------------
class JsonOutputFormat(Closed):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Closed):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # ignored
    format: JsonOutputFormat | None = None  # enforced, as chat's `response_format`
    task_budget: dict[str, Any] | None = None  # ignored


class CompactEdit(Closed):
    """`compact_20260112`: past `trigger` (the prompt's input tokens, strictly; None: the
    server's default, `serve.http.compaction.trigger`) the server has the model summarize the
    conversation (`instructions`, empty or blank as absent, replace the default prompt) and
    answers a `compaction` block first (`serve.http.compaction`)."""

    type: Literal["compact_20260112"]
    trigger: InputTokens | None = None
    pause_after_compaction: bool = False
    instructions: str | None = None


Edit = _one_of(ClearToolUsesEdit, ClearThinkingEdit, CompactEdit, what="edit")


class ContextEdits(Closed):
    edits: list[Edit] = Field(default_factory=list, max_length=3)

    @field_validator("edits", mode="before")
    @classmethod
    def _served(cls, v):
        kinds = [e.get("type") for e in v if isinstance(e, dict)] if isinstance(v, list) else []
        if len(set(kinds)) < len(kinds):
            raise ValueError("at most one edit of each type")
        return v

    @property
    def compact(self) -> CompactEdit | None:
        return next((e for e in self.edits if e.type == "compact_20260112"), None)


class Metadata(Closed):
    user_id: str | None = Field(None, max_length=256)


class MessagesPrompt(Closed):
    """What a message is asked about: `POST /v1/messages/count_tokens`'s body."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1, max_length=100_000)
    system: list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    context_management: ContextEdits | None = None
    output_config: OutputConfig | None = None
    thinking: dict[str, Any] | None = None  # ignored: the model does not think
    cache_control: dict[str, Any] | None = None  # ignored: every prefix is cached
    mcp_servers: list[dict[str, Any]] | None = None  # refused
    container: str | dict[str, Any] | None = None  # refused
    leyline: LeylineOptions | None = None

    _text = field_validator("system", mode="before")(classmethod(_blocks))
    _no_servers = field_validator("mcp_servers", "container")(classmethod(refused))


class MessagesRequest(MessagesPrompt):
    """`POST /v1/messages`'s body."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1)
    metadata: Metadata | None = None
    stream: bool = False
    service_tier: Literal["auto", "standard_only"] | None = None  # ignored


def _joined(blocks) -> str:
    return "".join(b.text for b in blocks)


def chat_messages(req: MessagesPrompt) -> list[dict]:
    """The chat messages of the request: `system` first, an assistant's `tool_use` blocks its
    tool calls, each `tool_result` a tool message (its content prefixed "Error: " when
    `is_error`), a user's text blocks between them a user message, a `system` message (Claude
    Code's mid-conversation instructions) a system message there. A `compaction` block with a
    summary (an assistant's) drops everything before it (`compacted_from`; `system` stays) and
    is an assistant message whose content is the summary, the rest of its message another.
    400 naming the block at fault: a block of the other role's (a system message takes text
    only), a `tool_result` whose `tool_use_id` is no `tool_use` of the message before, a last
    message of the assistant (prefill is not served) unless it ends with a `compaction` block
    (the turn after a paused compaction: the reply follows the summary)."""
    out = [] if req.system is None else [{"role": "system", "content": _joined(req.system)}]
    asked: set[str] = set()  # the tool uses of the message before
    first, skip = compacted_from(req)
    for i, m in enumerate(req.messages[first:], start=first):
        texts: list[TextBlock] = []
        calls, uses, summarized = [], set(), False
        for k, b in enumerate(m.content):
            at = f"messages.{i}.content.{k}"
            if i == first and k < skip:
                continue  # before the compaction block: dropped
            if m.role == "user" and b.type == "tool_result":
                if b.tool_use_id not in asked:
                    why = f"no tool_use {b.tool_use_id!r} in the message before"
                    raise APIError(400, why, f"{at}.tool_use_id")
                if texts:
                    out.append({"role": "user", "content": _joined(texts)})
                    texts = []
                text = ("Error: " if b.is_error else "") + _joined(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
            elif b.type == "text":
                texts.append(b)
            elif m.role == "assistant" and b.type == "tool_use":
                fn = {"name": b.name, "arguments": b.input}
                calls.append({"id": b.id, "type": "function", "function": fn})
                uses.add(b.id)
            elif m.role == "assistant" and b.type in ("thinking", "redacted_thinking"):
                continue  # dropped: the model here wrote no thinking
            elif m.role == "assistant" and b.type == "compaction":
                if b.content is not None:  # the summary: an assistant message of its own
                    out.append({"role": "assistant", "content": b.content})
                    summarized = True
            else:
                why = f"{b.type} blocks are not taken in {m.role} messages"
                raise APIError(400, why, f"{at}.type")
        if m.role == "system":  # text blocks only: a system message where it stands
            out.append({"role": "system", "content": _joined(texts)})
            continue  # not a turn: the tool uses it follows are still the ones answered
        if m.role == "assistant" and (texts or calls or not summarized):
            said: dict = {"role": "assistant", "content": _joined(texts) or None}
            if calls:
                said["tool_calls"] = calls
            else:
                said["content"] = said["content"] or ""
            out.append(said)
        elif texts:
            out.append({"role": "user", "content": _joined(texts)})
        asked = uses
    last = req.messages[-1]
    if last.role == "assistant" and last.content[-1].type != "compaction":
        n = len(req.messages) - 1
        why = "a last assistant message (prefill) is not supported"
        raise APIError(400, why, f"messages.{n}.role")
    return out


def compacted_from(req: MessagesPrompt) -> tuple[int, int]:
    """(message, block) of the last `compaction` block with a summary, in an assistant message:
    where the conversation the model runs begins (Anthropic's rule: everything before the
    block is dropped); (0, 0) when there is none."""
    for i in range(len(req.messages) - 1, -1, -1):
        m = req.messages[i]
        for k in range(len(m.content) - 1, -1, -1):
            b = m.content[k]
            if m.role == "assistant" and b.type == "compaction" and b.content is not None:
                return i, k
    return 0, 0


def chat_request(req: MessagesPrompt, session: str | None) -> ChatCompletionRequest:
    """The chat request the message runs as (400 naming the Messages field at fault)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "parameters": t.input_schema}}
            | ({} if t.description is None else {"description": t.description})
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        named = {"type": "function", "function": {"name": getattr(choice, "name", "")}}
        body["tool_choice"] = _CHOICES.get(choice.type, named)
        if getattr(choice, "disable_parallel_tool_use", False):
            body["parallel_tool_calls"] = False
    if req.output_config is not None and req.output_config.format is not None:
        schema = req.output_config.format.schema_
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        }
    if req.context_management is not None:  # clear_thinking: nothing to clear
        edits = req.context_management.edits
        body["context_management"] = {
            "edits": [e for e in edits if e.type == "clear_tool_uses_20250919"]
        }
    if req.leyline is not None:
        body["leyline"] = req.leyline  # validated already
    if isinstance(req, MessagesRequest):
        body |= {"max_tokens": req.max_tokens, "stream": req.stream}
        for src, dst in (("stop_sequences", "stop"), ("temperature", "temperature"),
                         ("top_p", "top_p")):  # fmt: skip
            if getattr(req, src) is not None:
                body[dst] = getattr(req, src)
        if req.top_k == 1:
            body["temperature"] = 0.0  # the most likely token: greedy
        elif req.top_k is not None and req.temperature != 0:
            why = "sampling from the top k is not supported: send 1 (greedy) or temperature 0"
            raise APIError(400, why, "top_k")
    body["session_id"] = session
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        param = validation_param(e.errors()[0]["loc"])
        why = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise renamed(APIError(400, f"{param}: {why}", param)) from e


def session_name(header: str | None, claude: str | None, req: MessagesRequest) -> str | None:
    """The session a request names: the `X-Session-Id` header, else Claude Code's
    `X-Claude-Code-Session-Id`, else `metadata.user_id` (as `user-` and the first 32 hex digits
    of its SHA-256: any string Anthropic takes names a session), else none."""
    if header is not None:
        return header
    if claude is not None:
        return claude
    user = None if req.metadata is None else req.metadata.user_id
    return None if user is None else "user-" + hashlib.sha256(user.encode()).hexdigest()[:32]


_NAMES = {  # a chat field: the Messages field it came from
    "messages": "messages",
    "stop": "stop_sequences",
    "response_format.json_schema": "output_config.format",
    "response_format": "output_config.format",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}


def renamed(e: APIError) -> APIError:
    """`e` naming the Messages field where the chat request it was raised for names its own
    (a chat message's index is not the request's: the field named is `messages`, whole)."""
    return errors.renamed(e, _NAMES, whole=("messages",))
