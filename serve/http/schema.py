"""The OpenAI-compatible request bodies `serve.http` accepts.

Bodies are pydantic models in strict mode (nothing coerced: `"4"` or `4.0` is not an integer,
`"false"` not a boolean): a field that fails validation becomes a 400 whose error names it
(`error.param`, a dotted path such as `messages.1.role`). Fields of the OpenAI API the server
does not need (`user`, `metadata`, `parallel_tool_calls`, ...) are accepted and ignored, as
OpenAI-compatible servers do; fields whose meaning it cannot honour (`n` > 1, `echo`,
`logit_bias`, non-text content parts) are refused by name. The penalties (presence, frequency,
vLLM's repetition) are applied as vLLM does (`serve.sampling.penalties`).
`logprobs` (chat: with `top_logprobs`; completions: the number of alternatives) reports the
model's own log-probabilities (`serve.http.logprobs`). `response_format` (`json_object`,
`json_schema`) and `tool_choice` ("required", a named function) are enforced by
`serve.http.formats`.

Beside OpenAI's fields: `session_id` (also the `X-Session-Id` header) names the conversation
the request continues; `leyline` (the edit channel) and `context_management` (Anthropic's
context editing) are `serve.http.extensions`'; vLLM's `ignore_eos` generates through the
end-of-turn token.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve.http.extensions import SESSION_ID, ContextManagement, LeylineOptions
from serve.sampling import MAX_LOGPROBS

MAX_STOP = 4  # as OpenAI


class Open(BaseModel):
    """OpenAI's objects: unknown fields are accepted (and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)


class FunctionCall(Open):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(Open):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported (text only)")
        if self.text is None:
            raise ValueError("a text content part needs `text`")
        return self


class Message(Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs `content`")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry `tool_calls`")
        return self

    def as_chat_dict(self) -> dict:
        """The dict `serve.chat.render` reads (role "developer" is a system message)."""
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content)
        d["content"] = content or ""
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class FunctionDef(Open):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Open):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Open):
    name: str = Field(min_length=1)


class NamedToolChoice(Open):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Open):
    include_usage: bool = False


def text_only(v: str) -> str:
    """`v` if it is text: JSON can carry lone surrogates, which no tokenizer takes."""
    if not v.isascii():
        try:
            v.encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not text: {e.reason} at {e.start}") from e
    return v


def refused(cls, v, info):
    """A field the server cannot honour: refused by name when set."""
    if v:
        raise ValueError(f"{info.field_name} is not supported")
    return v


def _stops(v):
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else list(v)
    if len(stops) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences")
    if any(s == "" for s in stops):
        raise ValueError("stop sequences must not be empty")
    return stops


class JsonSchemaFormat(Open):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs `json_schema`")
        return self


# fields of the OpenAI API (and vLLM's) the sampling step does not implement: refused by name
# unless they ask for what the server does anyway (the value here)
class _Sampling(Open):
    model: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**32)
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # vLLM's
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    session_id: str | None = Field(None, **SESSION_ID)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # as vLLM's
    leyline: LeylineOptions | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        _stops(v)
        return v

    _no_logit_bias = field_validator("logit_bias")(classmethod(refused))

    @property
    def stops(self) -> list[str]:
        return _stops(self.stop)

    @property
    def options(self) -> LeylineOptions:
        return self.leyline or LeylineOptions()


class ChatCompletionRequest(_Sampling):
    prompt_field: ClassVar[str] = "messages"  # the field a prompt too long for the context is
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    context_management: ContextManagement | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def logprobs_k(self) -> int | None:
        """`SamplingParams.logprobs`: None (not asked), else how many alternatives a token
        comes with."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new(self) -> tuple[int | None, str]:
        """(the token budget asked for, the field that asked)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_Sampling):
    prompt_field: ClassVar[str] = "prompt"
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives a token comes with

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and not isinstance(v[0], int):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported: send one prompt")
            v = v[0]
        if len(v) == 0:
            raise ValueError("the prompt is empty")
        if isinstance(v, str):
            text_only(v)
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    _unsupported = field_validator("echo", "suffix")(classmethod(refused))
