"""Bounded requests (`LimitBody`, ASGI middleware): a body over `max_bytes` is a 413 (at once when
its `Content-Length` says so, else as soon as that many bytes arrived), and a body that stops
arriving is a 408 after `timeout_s` — so one client can neither fill the server's memory nor
hold a request open by sending half of it. The whole body is read here, within both bounds,
before the app sees it (a route then parses what is already in memory). Before that, a
connection that does not send a whole request head within `header_timeout_s` of opening (or of
its last answer) is closed (`header_deadline`: uvicorn's httptools protocol with the deadline
nginx calls `client_header_timeout`; uvicorn has none of its own).
"""

from __future__ import annotations

import asyncio
import time

from serve.http.errors import APIError

MAX_BODY_BYTES = 16 << 20  # `--max-body-bytes`: 16 MiB, some 4M tokens of text
BODY_TIMEOUT_S = 30.0  # `--body-timeout`: the whole body within this many seconds
HEADER_TIMEOUT_S = 10.0  # `--header-timeout`: a request's head within this many seconds


def header_deadline(timeout_s: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's httptools protocol, closing a connection whose request head is not complete
    `timeout_s` after it opened or after its last response (`uvicorn.Config(http=...)`)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Protocol(HttpToolsProtocol):
        _deadline = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None:  # idle: the next head has a deadline
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol


class LimitBody:
    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE"):
            return await self.app(scope, receive, send)
        try:
            chunks = await self._read(scope, receive)
        except APIError as e:
            return await e.response(scope["path"])(scope, receive, send)
        if chunks is None:  # the client went away: nobody to answer
            return None

        async def replay():
            if chunks:
                return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)

    async def _read(self, scope, receive) -> list[bytes] | None:
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            raise _too_large(self.max_bytes)
        deadline, chunks, size = time.monotonic() + self.timeout_s, [], 0
        while True:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                why = f"the request body did not arrive within {self.timeout_s:g} s"
                raise APIError(408, why, "body", code="body_timeout") from None
            if message["type"] == "http.disconnect":
                return None
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                raise _too_large(self.max_bytes)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return chunks


def _too_large(limit: int) -> APIError:
    why = f"the request body is over {limit} bytes (--max-body-bytes)"
    return APIError(413, why, "body", code="body_too_large")
