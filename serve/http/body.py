"""Request bodies parsed off the event loop. A route that takes a JSON body reads its bytes on
the loop (`received`: already in memory, `serve.http.limits.LimitBody` read them), then parses
and validates them (`Received.parse`) in the worker thread where it prepares its turn
(`in_thread`), rather than letting FastAPI do both on the loop, where a 10 MB body of many
small objects (messages, content parts) held every other request for 0.15-3 s.

Why a thread and not a process of its own. In a thread the loop gets the GIL back whenever the
parse runs Python code (pydantic calls the models' validators for every message and content
part). What holds it is C: `json.loads` (1 ms a MB of prose, up to 20 ms a MB of small
numbers), pydantic's loops over lists of scalars (40 ms for 3 million token ids), and the
collector's passes over the objects a body becomes (up to 80-200 ms for 10 MB of content parts
or tool schemas). A process would take `json.loads`'s share away but not the collector's: its
validated tree is built here again when unpickled, with the same passes, and the process would
import the schema's dependencies (jax among them, 2.3 s) for it. Measured with
tests/test_event_loop.py on `python -m serve.http`: beside a 10 MB chat request, /health's p99
went from 5-9.5 s to 25-60 ms for one long message (the tokenizer's share: see
`serve.chat.ChatTokenizer.encode`), and to 20-135 ms for hundreds of thousands of messages or
content parts (what is left is the collector's).

The errors are FastAPI's own, answered by `serve.http.errors` as before: a
`RequestValidationError` with the locations FastAPI gives (`("body", ...)`; a JSON syntax error
is "json_invalid"; no body, "missing"; a body that is not JSON by its Content-Type is validated
as bytes, and fails at "body"), and FastAPI's 400 for a body it cannot decode (not UTF-8, nested
too deep). The route documents its body with `documented`, so the OpenAPI schema describes it
as FastAPI did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.message
import json
from typing import TypeVar

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.models import OpenAPI
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

M = TypeVar("M", bound=BaseModel)
REF = "#/components/schemas/{model}"


@dataclasses.dataclass(frozen=True)
class Received:
    """A request's body as it arrived, not parsed yet."""

    data: bytes
    content_type: str | None

    def parse(self, model: type[M]) -> M:
        """The body as `model`, parsed and validated as FastAPI would (JSON by its
        Content-Type); raises FastAPI's errors (see the module docstring). Call it off the event
        loop."""
        if not self.data:
            missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
            raise RequestValidationError([missing])
        value = self.data
        if self._is_json():
            try:
                value = json.loads(self.data)
            except json.JSONDecodeError as e:
                bad = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error"}
                raise RequestValidationError([bad | {"input": {}, "ctx": {"error": e.msg}}]) from e
            except Exception as e:  # not UTF-8, nested too deep
                raise HTTPException(400, "There was an error parsing the body") from e
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
