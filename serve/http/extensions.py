"""Our own request fields beside OpenAI's: the edit channel (`leyline`: `LeylineOptions`, with
message-granular `MessageDirective`s) and Anthropic's server-side context editing
(`context_management.edits` with `clear_tool_uses_20250919`: `ContextManagement`; the Messages
API also takes `clear_thinking_20251015`, `ClearThinkingEdit`). An unknown field in these
objects is a mistake, reported by name (400)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from serve.engine.caches import OWN_LINEAGE

# a session id: 1 to 256 visible ASCII characters (the server echoes it in the X-Session-Id
# response header, which carries nothing else)
SESSION_ID = dict(min_length=1, max_length=256, pattern=r"^[!-~]+$")


class Closed(BaseModel):
    """Our own objects: an unknown field is a mistake, reported by name."""

    model_config = ConfigDict(extra="forbid", strict=True)


class MessageDirective(Closed):
    """An explicit edit of the history the request sends, in messages (clients do not know
    token ids): messages `messages[0]` to `messages[1]` (inclusive indices into the request's
    `messages`) become one message, the first's role, whose content is `replacement` (its tool
    calls, if any, are dropped; the others are removed). The model runs the edited history,
    and the session's KV is spliced (`mode`, default the request's `leyline.mode`) instead of
    prefilled from the edit on. A client mirrors the edit in its own history
    (`m[i]["content"] = replacement; del m[i + 1 : j + 1]`) so that its next request extends
    the session."""

    messages: list[int] = Field(min_length=2, max_length=2)  # [first, last]
    replacement: str = Field("", max_length=1_000_000)
    mode: Literal["amortize", "forget"] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _pair(cls, v):  # a tuple from Python code is a pair too (JSON has none)
        return list(v) if isinstance(v, tuple) else v

    @field_validator("messages")
    @classmethod
    def _range(cls, v):
        i, j = v
        if i < 0 or j < i:
            raise ValueError("need 0 <= first <= last (message indices, inclusive)")
        return tuple(v)


class LeylineOptions(Closed):
    """`leyline`: `mode`, "amortize" (default) or "forget", for the edit the server finds by
    diffing the re-sent history against the session; `directives`, explicit message-granular
    edits; `return_token_ids`, also return the prompt's and the completion's token ids;
    `move` and `lineage`, MOVE for this request and whose cached KV it may move;
    `recompute`, the fraction of each AMORTIZE splice's downstream run through the model again
    (`leyline_jax.Directive.recompute`; default the server's `--recompute`): between AMORTIZE
    (0) and FORGET's KV (1), not a redaction."""

    mode: Literal["amortize", "forget"] = "amortize"
    directives: list[MessageDirective] = Field(default_factory=list, max_length=256)
    return_token_ids: bool = False
    # MOVE: runs of at least a page the session, or its lineage's cache, holds at another
    # position are moved and rotated instead of prefilled (the KV then differs from a fresh
    # prefill's: BENCHMARKS.md measures the drift)
    move: bool = False
    # the lineage a new session joins (like vLLM's cache_salt: only sessions of one lineage
    # MOVE each other's KV); default: its own
    lineage: str | None = Field(None, min_length=1, max_length=256)
    recompute: float | None = Field(None, ge=0.0, le=1.0)

    @field_validator("lineage")
    @classmethod
    def _not_own(cls, v):
        if v is not None and v.startswith(OWN_LINEAGE):
            raise ValueError(f"names starting with {OWN_LINEAGE!r} are the engine's own")
        return v

    @field_validator("directives")
    @classmethod
    def _apart(cls, v):
        spans = sorted(d.messages for d in v)
        for (_, a), (b, _) in zip(spans, spans[1:], strict=False):
            if b <= a:
                raise ValueError("directives' message ranges overlap")
        return v


# ---- Anthropic's context editing ------------------------------------------------------------
class _Count(Closed):
    value: int = Field(ge=0, le=2**31)


class InputTokens(_Count):
    type: Literal["input_tokens"]


class ToolUses(_Count):
    type: Literal["tool_uses"]


class ClearToolUsesEdit(Closed):
    """`clear_tool_uses_20250919`, with Anthropic's defaults: when the rendered prompt exceeds
    `trigger` (100,000 input tokens), the oldest tool results but the `keep` most recent (3)
    are replaced by a stub, unless that would clear fewer than `clear_at_least` input tokens;
    tools named in `exclude_tools` are never cleared; `clear_tool_inputs` also blanks the
    calls' arguments (true: every cleared call; a list: those tools' calls). What is cleared
    stays cleared in the session's later requests."""

    type: Literal["clear_tool_uses_20250919"]
    trigger: InputTokens | ToolUses = Field(
        default_factory=lambda: InputTokens(type="input_tokens", value=100_000)
    )
    keep: ToolUses = Field(default_factory=lambda: ToolUses(type="tool_uses", value=3))
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] = False


class ContextManagement(Closed):
    edits: list[ClearToolUsesEdit] = Field(max_length=1)


class ThinkingTurns(_Count):
    type: Literal["thinking_turns"]


class AllThinkingTurns(Closed):
    type: Literal["all"]


class ClearThinkingEdit(Closed):
    """`clear_thinking_20251015` (the Messages API's): thinking blocks of all assistant turns
    but the `keep` most recent (1) are cleared. The prompt a model runs here holds no thinking
    (the Messages API drops thinking blocks from it), so the edit clears nothing."""

    type: Literal["clear_thinking_20251015"]
    keep: ThinkingTurns | AllThinkingTurns | Literal["all"] = Field(
        default_factory=lambda: ThinkingTurns(type="thinking_turns", value=1)
    )
