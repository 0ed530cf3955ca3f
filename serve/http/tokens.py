"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt (text, or chat
`messages` rendered in the model's chat layout, with `tools`) to the model's token ids, and ids
back to text. `model`, when given, must be the one served."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from serve import chat
from serve.http import body
from serve.http.body import Received
from serve.http.errors import APIError
from serve.http.schema import Message, Open, Tool, text_only


class TokenizeRequest(Open):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True

    @field_validator("prompt")
    @classmethod
    def _text(cls, v):
        return v if v is None else text_only(v)


class DetokenizeRequest(Open):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def _check_model(model: str | None, served: str) -> None:
    if model is not None and model != served:
        why = f"model {model!r} does not exist; this server serves {served!r}"
        raise APIError(400, why, "model", code="model_not_found")


def add_routes(app, backend) -> None:
    tok = backend.tokenizer

    def ids_of(req: TokenizeRequest) -> list[int]:
        if req.prompt is not None:
            return tok.encode(req.prompt)
        messages = [m.as_chat_dict() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            r = chat.render(tok, messages, tools, add_generation_prompt=req.add_generation_prompt)
        except (KeyError, ValueError, TypeError) as e:
            raise APIError(400, f"messages: cannot render: {e}", "messages") from e
        return list(r.tokens)

    # each in a worker thread, from parsing the body to rendering the answer's JSON (ids by the
    # million, text by the megabyte): nothing of it on the event loop (`serve.http.body`)
    def tokenize_now(received: Received) -> JSONResponse:
        req = received.parse(TokenizeRequest)
        _check_model(req.model, backend.model_name)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give either `prompt` or `messages`", "prompt")
        ids = ids_of(req)
        limit = backend.max_seq_len
        return JSONResponse({"count": len(ids), "max_model_len": limit, "tokens": ids})

    def detokenize_now(received: Received) -> JSONResponse:
        req = received.parse(DetokenizeRequest)
        _check_model(req.model, backend.model_name)
        bad = [t for t in req.tokens if not 0 <= t < backend.vocab_size]
        if bad:
            why = f"tokens: id {bad[0]} is outside the vocabulary [0, {backend.vocab_size})"
            raise APIError(400, why, "tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens)})

    @app.post("/tokenize", openapi_extra=body.documented(app, TokenizeRequest))
    async def tokenize(request: Request):
        return await body.in_thread(tokenize_now, await body.received(request))

    @app.post("/detokenize", openapi_extra=body.documented(app, DetokenizeRequest))
    async def detokenize(request: Request):
        return await body.in_thread(detokenize_now, await body.received(request))
