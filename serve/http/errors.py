"""Errors over HTTP: OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`)
with the offending field in `param` and the message starting with it. `APIError` is what a
route raises; `install(app)` answers it, the framework's validation errors (400, the field as
a dotted path) and its own refusals (404 path, 405 method, 400 body) in that shape. On
Anthropic's routes (`/v1/messages...`) the same error is worded in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`, the message starting with the field),
its type by status (`ANTHROPIC_TYPES`), and 503 is Anthropic's 529 (`overloaded_error`).
`renamed` names the field of another API a chat request was translated from."""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# Anthropic's error types by status (its `api/errors` page); another 4xx is an
# invalid_request_error, another 5xx an api_error
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_route(path: str) -> bool:
    """Is `path` one of Anthropic's routes (its errors in Anthropic's shape)?"""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers

    def body(self) -> dict:
        """OpenAI's error object; a message about a field starts with the field's name."""
        message, param = self.message, self.param
        if param and not message.startswith(param):
            message = f"{param}: {message}"
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}

    def anthropic(self) -> tuple[int, dict]:
        """(the status, the error object) in Anthropic's shape: a message about a field starts
        with its name and a colon, as Anthropic's own ("messages.0.content: ...")."""
        status = 529 if self.status == 503 else self.status
        kind = ANTHROPIC_TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        message, param = self.message, self.param
        if param and not message.startswith(f"{param}:"):
            message = f"{param}: {message}"
        return status, {"type": "error", "error": {"type": kind, "message": message}}

    def response(self, path: str = "") -> JSONResponse:
        """The answer to a request for `path` (Anthropic's shape on its routes)."""
        status, body = self.anthropic() if anthropic_route(path) else (self.status, self.body())
        return JSONResponse(body, status_code=status, headers=self.headers)


def anthropic_event(e: APIError) -> dict:
    """`e` as the `error` event of an Anthropic stream."""
    return {"event": "error", "data": json.dumps(e.anthropic()[1], ensure_ascii=False)}


def renamed(e: APIError, names: dict[str, str], whole: tuple[str, ...] = ()) -> APIError:
    """`e` naming the field of another API where the chat request it was raised for names its
    own: `names` maps a chat field (and the fields under it) to that API's; a field mapped to
    one in `whole` is named whole (its indices count the chat request's items, not the
    caller's)."""
    for chat_name, name in names.items():
        if e.param == chat_name or (e.param or "").startswith(chat_name + "."):
            tail = e.param[len(chat_name) :] if name not in whole else ""
            e.message = e.message.replace(e.param, name + tail, 1)
            e.param = name + tail
            break
    return e


def unavailable(why: str = "the engine is not running") -> APIError:
    """503 with Retry-After: the engine is not serving (stopped, stopping, or failed)."""
    return APIError(
        503, why, None, "server_error", code="unavailable", headers={"Retry-After": "5"}
    )


# pydantic names a union's member in the location ("prompt", "str"): not a field (a member
# spelled with brackets, or a model's class name, is left out by those marks alone)
_UNION_TAGS = {"str", "int", "float", "bool"}


def validation_param(loc) -> str:
    """A dotted field path from a FastAPI validation error location (("body", "messages", 0,
    "role") -> "messages.0.role"; the body itself -> "body"). Union members pydantic names in
    the location (a type, or a model's class name) are not fields and are left out."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "header", "path", "query"):
        parts = parts[1:]
    parts = [p for p in parts if p not in _UNION_TAGS and "[" not in p and not p[:1].isupper()]
    return ".".join(parts) or "body"


def install(app) -> None:
    """Answer every error the app meets in OpenAI's shape (Anthropic's on its routes)."""

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": ("body",), "msg": "invalid body"}
        param = validation_param(first.get("loc", ("body",)))
        if first.get("type") == "json_invalid":  # the location is a character offset
            param = "body"
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        why = f"{param}: {msg}{more}"
        return APIError(400, why, param, code="invalid_value").response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # what the framework refused before any field was read: the path (no such
        # endpoint), the method, or the body itself (not JSON, not UTF-8)
        param = {404: "path", 405: "method"}.get(e.status_code, "body")
        headers = getattr(e, "headers", None)
        error = APIError(e.status_code, str(e.detail), param, type_, headers=headers)
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):  # a bug: still the API's shape, never plain text
        why = f"internal error: {type(e).__name__}"
        return APIError(500, why, None, "server_error").response(request.url.path)
