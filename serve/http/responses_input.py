"""The Responses API's request (`ResponsesRequest`), its input items as chat messages
(`messages_of`), the chat request a response runs as (`chat_request`), and the stored
conversations `previous_response_id` continues (`Store`). The route: `serve.http.responses`."""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Literal

from pydantic import Field, ValidationError

from serve.http import errors
from serve.http.errors import APIError, validation_param
from serve.http.extensions import SESSION_ID, LeylineOptions
from serve.http.schema import ChatCompletionRequest, Open
from serve.sampling import MAX_LOGPROBS

MAX_STORED = 10_000  # per tenant
LOGPROBS = "message.output_text.logprobs"  # in `include`: each output text part's logprobs


class TextOptions(Open):
    format: dict[str, Any] | None = None  # a `response_format`, flat


class ResponsesRequest(Open):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    text: TextOptions | None = None
    include: list[str] | None = None  # "message.output_text.logprobs": the tokens' logprobs
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives each comes with
    session_id: str | None = Field(None, **SESSION_ID)
    leyline: LeylineOptions | None = None


@dataclasses.dataclass
class Stored:
    tenant: str
    session: str
    messages: list[dict]  # the conversation through the response, as chat messages


class Store:
    """Stored responses, `limit` per tenant (the oldest dropped first): one tenant's traffic
    never evicts another's."""

    def __init__(self, limit: int = MAX_STORED):
        self.tenants: dict[str, collections.OrderedDict[str, Stored]] = {}
        self.limit, self.lock = limit, threading.Lock()

    def get(self, tenant: str, rid: str) -> Stored:
        with self.lock:
            s = self.tenants.get(tenant, {}).get(rid)
        if s is None:
            why = f"no response {rid!r}"
            raise APIError(404, why, "previous_response_id", "not_found_error", "not_found")
        return s

    def put(self, rid: str, item: Stored) -> None:
        with self.lock:
            items = self.tenants.setdefault(item.tenant, collections.OrderedDict())
            items[rid] = item
            while len(items) > self.limit:
                items.popitem(last=False)


def _text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = [p.get("text") for p in content]
        kinds = [p.get("type") for p in content]
        if all(k in ("input_text", "output_text", "text") for k in kinds):
            if all(isinstance(t, str) for t in texts):
                return "".join(texts)
    raise APIError(400, f"{param}: only text content is supported", param)


def messages_of(items) -> list[dict]:
    """Chat messages of Responses input items (400 naming the item that cannot be one)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for k, it in enumerate(items):
        kind, param = it.get("type", "message"), f"input.{k}"
        if kind == "message" and it.get("role") in ("user", "system", "developer", "assistant"):
            out.append({"role": it["role"], "content": _text(it.get("content"), param)})
        elif kind == "function_call":
            call = {"id": it.get("call_id"), "type": "function"}
            call["function"] = {"name": it.get("name"), "arguments": it.get("arguments", "{}")}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": it.get("call_id"),
                    "content": _text(it.get("output"), param),
                }
            )
        else:
            raise APIError(400, f"{param}: items of type {kind!r} are not supported", param)
    return out


def chat_request(req: ResponsesRequest, messages: list[dict], session: str | None):
    """The chat request the response runs as (400 naming the Responses field at fault)."""
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in req.tools
        ]
    if isinstance(req.tool_choice, dict):
        body["tool_choice"] = {
            "type": "function",
            "function": {"name": req.tool_choice.get("name")},
        }
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = None if req.text is None else req.text.format
    if fmt is not None:
        body["response_format"] = (
            fmt
            if fmt.get("type") != "json_schema"
            else {
                "type": "json_schema",
                "json_schema": {k: v for k, v in fmt.items() if k != "type"},
            }
        )
    for src, dst in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    if LOGPROBS in (req.include or ()):
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if req.leyline is not None:
        body["leyline"] = req.leyline  # validated already
    body["session_id"] = session
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        param = validation_param(e.errors()[0]["loc"])
        raise renamed(APIError(400, f"{param}: {e.errors()[0]['msg']}", param)) from e


_NAMES = {  # a chat field: the Responses field it came from
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
}


def renamed(e: APIError) -> APIError:
    """`e` naming the Responses field where the chat request it was raised for names its own
    (a message's index is the conversation's: the field named is `input`, whole)."""
    return errors.renamed(e, _NAMES, whole=("input",))
