"""Request bodies parsed off the event loop. A route that takes a JSON body reads its bytes on
the loop (`received`: already in memory, `serve.http.limits.LimitBody` read them), then parses
and validates them (`Received.parse`) in the worker thread where it prepares its turn
(`in_thread`), rather than letting FastAPI do both on the loop, where a 10 MB body of many
small objects (messages, content parts) held every other request for 0.15-3 s.

Why a thread, and for some bodies a process. In a thread the loop gets the GIL back whenever
the parse runs Python code (pydantic calls the models' validators for every message and content
part). What holds it is C: `json.loads` (1 ms a MB of prose, up to 20 ms a MB of small
numbers; 120 ms for 10 MB of content parts), pydantic's loops over lists of scalars (40 ms for
3 million token ids), and the collector's passes over the objects a body becomes (up to
80-200 ms for 10 MB of content parts). A process of its own takes away what it need not hand
back: where the route reads a message's text parts joined (chat, Anthropic's messages), a body
over `APART` bytes is parsed in the parsing process, which joins each list of text parts into
one part before the value comes back, so neither `json.loads` nor hundreds of thousands of
validated parts reach this process (`joined_text_parts`). A body it cannot shrink so (many
messages, tool schemas) comes back unjoined and is parsed in the thread: unpickling its value
here would hold the GIL as long as parsing it. Measured with tests/test_event_loop.py on
`python -m serve.http`: beside a 10 MB chat request, /health's p99 went from 5-9.5 s to 25-60
ms for one long message (the tokenizer's share: see `serve.chat.ChatTokenizer.encode`), to
20-135 ms for hundreds of thousands of messages, and from 205-253 ms to 2-18 ms for 256,410
content parts.

The errors are FastAPI's own, answered by `serve.http.errors` as before: a
`RequestValidationError` with the locations FastAPI gives (`("body", ...)`; a JSON syntax error
is "json_invalid"; no body, "missing"; a body that is not JSON by its Content-Type is validated
as bytes, and fails at "body"), and FastAPI's 400 for a body it cannot decode (not UTF-8, nested
too deep). The route documents its body with `documented`, so the OpenAPI schema describes it
as FastAPI did.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import email.message
import json
import multiprocessing
import threading
from typing import Any, TypeVar

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.models import OpenAPI
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

M = TypeVar("M", bound=BaseModel)
REF = "#/components/schemas/{model}"
APART = 1 << 20  # bytes: a JSON body this long whose route joins text parts is parsed apart


@dataclasses.dataclass(frozen=True)
class Received:
    """A request's body as it arrived, not parsed yet."""

    data: bytes
    content_type: str | None

    def parse(self, model: type[M], *, joins_text: bool = False) -> M:
        """The body as `model`, parsed and validated as FastAPI would (JSON by its
        Content-Type); raises FastAPI's errors (see the module docstring). Call it off the event
        loop. `joins_text`: the route reads a message's text parts joined with nothing between
        them, so a `messages[i].content` list of text parts alone may be validated as one part
        (`joined_text_parts`); a body over `APART` bytes is then parsed in the parsing process,
        which hands back the joined value."""
        if not self.data:
            missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
            raise RequestValidationError([missing])
        value: Any = self.data
        if self._is_json():
            apart = _apart(self.data) if joins_text and len(self.data) > APART else None
            if apart is None or apart[0] == "unjoined":  # parsed here
                apart = _loaded(self.data)
            match apart:
                case ("json_invalid", pos, msg):
                    bad = {"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error"}
                    raise RequestValidationError([bad | {"input": {}, "ctx": {"error": msg}}])
                case ("undecodable",):  # not UTF-8, nested too deep
                    raise HTTPException(400, "There was an error parsing the body")
                case (_, value):
                    pass
        try:
            return model.model_validate(value, from_attributes=True)
        except ValidationError as e:
            errors = e.errors(include_url=False)  # each without its input: freed here
            located = [err | {"loc": ("body", *err["loc"]), "input": None} for err in errors]
            raise RequestValidationError(located) from None

    def _is_json(self) -> bool:
        if not self.content_type:
            return False
        message = email.message.Message()
        message["content-type"] = self.content_type
        subtype = message.get_content_subtype()
        return message.get_content_maintype() == "application" and (
            subtype == "json" or subtype.endswith("+json")
        )


def _loaded(data: bytes) -> tuple:
    """`json.loads(data)` as ("ok", value), or why not: ("json_invalid", pos, msg), or
    ("undecodable",)."""
    try:
        return ("ok", json.loads(data))
    except json.JSONDecodeError as e:
        return ("json_invalid", e.pos, e.msg)
    except Exception:  # not UTF-8, nested too deep
        return ("undecodable",)


def joined_text_parts(value: Any) -> bool:
    """Each `messages[i].content` of `value` (a request's JSON) that is a list of two or more
    text parts, each exactly `{"type": "text", "text": <str>}`, made one such part, their texts
    joined (in place); whether any was. A list holding anything else (another type, another
    key) is left as it came, so a validation error names the part it names in the request."""
    messages = value.get("messages") if isinstance(value, dict) else None
    joined = False
    for m in messages if isinstance(messages, list) else ():
        parts = m.get("content") if isinstance(m, dict) else None
        if isinstance(parts, list) and len(parts) > 1 and all(map(_text_part, parts)):
            m["content"] = [{"type": "text", "text": "".join(p["text"] for p in parts)}]
            joined = True
    return joined


def _text_part(p) -> bool:
    return (
        type(p) is dict and len(p) == 2 and p.get("type") == "text" and type(p.get("text")) is str
    )


def _parsed_apart(data: bytes) -> tuple:
    """In the parsing process: `_loaded(data)`, its value's text parts joined; ("unjoined",)
    where none was (the value would cost the loop as much to unpickle as to parse)."""
    loaded = _loaded(data)
    if loaded[0] == "ok" and not joined_text_parts(loaded[1]):
        return ("unjoined",)
    return loaded


_parser: concurrent.futures.ProcessPoolExecutor | None = None
_parser_lock = threading.Lock()


def _apart(data: bytes) -> tuple | None:
    """`_parsed_apart(data)` in the parsing process (one, spawned on first use: it imports this
    module, not jax), waited for in the calling thread; None if the process failed (the caller
    parses here, and the next call starts another)."""
    global _parser
    with _parser_lock:
        if _parser is None:
            spawn = multiprocessing.get_context("spawn")
            _parser = concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn)
        parser = _parser
    try:
        return parser.submit(_parsed_apart, data).result()
    except concurrent.futures.process.BrokenProcessPool:
        with _parser_lock:
            if _parser is parser:
                _parser = None
        return None


async def in_thread(fn, *args):
    """`fn(*args)` in a worker thread (`asyncio.to_thread`). An exception it raises comes back
    without the frames it was raised through, and so without their locals (the parsed body,
    the prompt's ids): they are freed there, in the worker, not on the event loop once the
    error is answered (a 10 MB body of content parts: 50 ms of the loop's time)."""
    return await asyncio.to_thread(_framed, fn, args)


def _framed(fn, args):
    try:
        return fn(*args)
    except Exception as e:
        chain, seen = [e], set()
        while chain:  # the exception and those it chains (`raise ... from`, or during)
            x = chain.pop()
            if x is not None and id(x) not in seen:
                seen.add(id(x))
                x.__traceback__ = None  # its frames freed now
                chain += [x.__cause__, x.__context__]
        raise


async def received(request: Request) -> Received:
    """The request's body, read (on the event loop: the bytes are in memory already)."""
    return Received(await request.body(), request.headers.get("content-type"))


def documented(app, model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route of `app` whose body is `model`, parsed by the route itself:
    the request body OpenAPI would give it, its schema among the app's components (as FastAPI
    names them) once `app.openapi()` builds the document."""
    models = getattr(app.state, "documented_bodies", None)
    if models is None:
        models = app.state.documented_bodies = []
        build = app.openapi

        def openapi() -> dict:
            if app.openapi_schema is None:
                doc = build()
                schemas = doc.setdefault("components", {}).setdefault("schemas", {})
                for m in models:
                    schema = m.model_json_schema(ref_template=REF)
                    schemas.update(schema.pop("$defs", {}))
                    schemas[m.__name__] = schema
                # as FastAPI writes its own (`fastapi.openapi.utils.get_openapi`)
                app.openapi_schema = jsonable_encoder(
                    OpenAPI(**doc), by_alias=True, exclude_none=True
                )
            return app.openapi_schema

        app.openapi = openapi
    models.append(model)
    ref = {"$ref": REF.format(model=model.__name__)}
    invalid = {"$ref": REF.format(model="HTTPValidationError")}  # FastAPI's, for a body route
    return {
        "requestBody": {"content": {"application/json": {"schema": ref}}, "required": True},
        "responses": {
            "422": {
                "description": "Validation Error",
                "content": {"application/json": {"schema": invalid}},
            }
        },
    }
