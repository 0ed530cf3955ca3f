"""Errors over HTTP: OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`)
with the offending field in `param` and the message starting with it. `APIError` is what a
route raises; `install(app)` answers it, the framework's validation errors (400, the field as
a dotted path) and its own refusals (404 path, 405 method, 400 body) in that shape."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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
    """Answer every error the app meets in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": ("body",), "msg": "invalid body"}
        param = validation_param(first.get("loc", ("body",)))
        if first.get("type") == "json_invalid":  # the location is a character offset
            param = "body"
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        return APIError(400, f"{param}: {msg}{more}", param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # what the framework refused before any field was read: the path (no such
        # endpoint), the method, or the body itself (not JSON, not UTF-8)
        param = {404: "path", 405: "method"}.get(e.status_code, "body")
        headers = getattr(e, "headers", None)
        return APIError(e.status_code, str(e.detail), param, type_, headers=headers).response()

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):  # a bug: still OpenAI's shape, never plain text
        why = f"internal error: {type(e).__name__}"
        return APIError(500, why, None, "server_error").response()
