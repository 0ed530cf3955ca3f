"""`HttpSessions`: the one owner of the server's per-session state.

A client names its conversation (`session_id` or `X-Session-Id`); the server keeps, per name:
the engine session it runs in, its replies' sampled ids (`ReplyMemory`) and what context
editing cleared (`ContextEditor`'s record). The engine thread maps names to engine sessions
(submit, close); the event loop renders histories with the replies and records. Both go
through this object (one lock), and a snapshot saves and restores it whole (`export`, `load`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from serve.http.history import ContextEditor, ReplyMemory


class HttpSessions:
    def __init__(self, count_tokens: Callable[[str], int]):
        self._lock = threading.Lock()
        self._engine: dict[str, int] = {}  # name -> engine session
        self.replies = ReplyMemory()  # used under the lock only
        self.context = ContextEditor(count_tokens)

    def engine_session(self, name: str) -> int | None:
        with self._lock:
            return self._engine.get(name)

    def bind(self, name: str, sid: int) -> None:
        with self._lock:
            self._engine[name] = sid

    def remember(self, name: str, text: str, ids) -> None:
        """Keep a reply's sampled ids for the session's next render."""
        with self._lock:
            self.replies.remember(name, text, ids)

    def substitute(self, name: str | None, messages: list[dict], rendered):
        """`rendered` with the session's remembered replies' ids in place
        (`ReplyMemory.substitute`)."""
        with self._lock:
            return self.replies.substitute(name, messages, rendered)

    def clear_tool_uses(self, name: str | None, messages: list[dict], edit):
        """Context editing over the session's record (`ContextEditor.apply`)."""
        with self._lock:
            return self.context.apply(name, messages, edit)

    def keep_replies(self, name: str, messages: list[dict]) -> None:
        """A FORGET turn: forget the session's remembered replies `messages` no longer hold."""
        texts = {m["content"] for m in messages if m["role"] == "assistant"}
        with self._lock:
            self.replies.keep(name, texts)

    def drop(self, name: str) -> None:
        """Forget everything of session `name` (it was closed)."""
        with self._lock:
            self._engine.pop(name, None)
            self.replies.forget(name)
            self.context.forget(name)

    # ---- snapshots ---------------------------------------------------------------------------
    def export(self) -> dict:
        """What a snapshot keeps beside the engine's sessions (JSON-able)."""
        with self._lock:
            return {
                "http_sessions": dict(self._engine),
                "replies": self.replies.export(),
                "cleared": {k: sorted(v) for k, v in self.context.cleared.items()},
            }

    def load(self, extra: dict) -> dict[str, int]:
        """Take a snapshot's `export` back (without the replies of sessions a later FORGET
        cut: `serve.forgotten`); the names and their engine sessions."""
        with self._lock:
            self._engine = {str(k): int(v) for k, v in extra.get("http_sessions", {}).items()}
            self.replies.load(extra.get("replies", {}))
            cut = set(extra.get("forgotten_sessions", ()))
            for name in [k for k, sid in self._engine.items() if sid in cut]:
                self.replies.forget(name)
            cleared = extra.get("cleared", {})
            self.context.cleared = {str(k): set(v) for k, v in cleared.items()}
            return dict(self._engine)
