"""`HttpSessions`: the one owner of the server's per-session state.

A client names its conversation (`session_id` or `X-Session-Id`); the server keeps, per name:
the engine session it runs in, its replies' sampled ids (`ReplyMemory`) and what context
editing cleared (`ContextEditor`'s record). The engine thread maps names to engine sessions
(submit, close); the event loop renders histories with the replies and records. Both go
through this object (one lock), and a snapshot saves and restores it whole (`export`, `load`).

Sessions have a lifecycle: one idle (no turn in flight) for `ttl_s` is closed (`expired`), and
a new one past `max_sessions` in all, or `per_tenant` of its tenant's, first closes the least
recently used idle ones (`room_for`; `TooManySessions` when every one is busy). None: no limit.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Collection

from serve.http.history import ContextEditor, ReplyMemory


class TooManySessions(RuntimeError):
    """A new session would pass a cap while every session under it has a turn in flight."""


def tenant_of(name: str) -> str:
    """The tenant of a session key (`serve.http.auth.scoped`: "TENANT NAME", or a bare name)."""
    return name.split(" ", 1)[0] if " " in name else ""


class HttpSessions:
    def __init__(
        self,
        count_tokens: Callable[[str], int],
        ttl_s: float | None = None,
        max_sessions: int | None = None,
        per_tenant: int | None = None,
    ):
        self._lock = threading.Lock()
        # name -> engine session, least recently used first; name -> when last used
        self._engine: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._used: dict[str, float] = {}
        self._tenants: collections.Counter[str] = collections.Counter()  # sessions per tenant
        self.replies = ReplyMemory()  # used under the lock only
        self.context = ContextEditor(count_tokens)
        self.ttl_s, self.max_sessions, self.per_tenant = ttl_s, max_sessions, per_tenant

    def engine_session(self, name: str) -> int | None:
        """The engine session `name` runs in (None: none); it counts as used now."""
        with self._lock:
            if name in self._engine:
                self._engine.move_to_end(name)
                self._used[name] = time.monotonic()
            return self._engine.get(name)

    def bind(self, name: str, sid: int) -> None:
        with self._lock:
            self._tenants[tenant_of(name)] += name not in self._engine
            self._engine[name] = sid
            self._used[name] = time.monotonic()

    # ---- the lifecycle -------------------------------------------------------------------------
    def expired(self, busy: Collection[str]) -> list[str]:
        """Names idle past `ttl_s` (not in `busy`, those with a turn in flight)."""
        if self.ttl_s is None:
            return []
        cut = time.monotonic() - self.ttl_s
        with self._lock:
            return [n for n in self._engine if self._used[n] < cut and n not in busy]

    def room_for(self, name: str, busy: Collection[str]) -> list[str]:
        """The idle sessions to close, least recently used first, so that a new session `name`
        fits both caps; TooManySessions when it cannot. Walks the sessions only past a cap,
        oldest first, as far as it must."""
        tenant, out = tenant_of(name), []
        with self._lock:
            for cap, ours in ((self.per_tenant, True), (self.max_sessions, False)):
                if cap is None:
                    continue

                def within(n: str, ours=ours) -> bool:
                    return not ours or tenant_of(n) == tenant

                held = self._tenants[tenant] if ours else len(self._engine)
                over = held - sum(map(within, out)) + 1 - cap
                for n in self._engine if over > 0 else ():  # least recently used first
                    if within(n) and n not in busy and n not in out:
                        out.append(n)
                        over -= 1
                        if over == 0:
                            break
                if over > 0:
                    raise TooManySessions(
                        f"{cap} sessions, each with a turn in flight; retry later"
                    )
        return out

    def remember(self, name: str, text: str, ids) -> None:
        """Keep a reply's sampled ids for the session's next render."""
        with self._lock:
            self.replies.remember(name, text, ids)

    def substitute(self, name: str | None, messages: list[dict], rendered):
        """`rendered` with the session's remembered replies' ids in place
        (`ReplyMemory.substitute`)."""
        with self._lock:
            return self.replies.substitute(name, messages, rendered)

    def clear_tool_uses(self, name: str | None, messages: list[dict], edit, count=None):
        """Context editing over the session's record (`ContextEditor.edit`, counted outside the
        lock), what it cleared now added to the record."""
        with self._lock:
            record = set(self.context.cleared.get(name, ())) if name is not None else set()
        done = self.context.edit(record, messages, edit, count)
        if name is not None and done.new:
            with self._lock:
                self.context.cleared.setdefault(name, set()).update(done.new)
        return done

    def keep_replies(self, name: str, messages: list[dict]) -> None:
        """A FORGET turn: forget the session's remembered replies `messages` no longer hold."""
        texts = {m["content"] for m in messages if m["role"] == "assistant"}
        with self._lock:
            self.replies.keep(name, texts)

    def drop(self, name: str) -> None:
        """Forget everything of session `name` (it was closed)."""
        with self._lock:
            if self._engine.pop(name, None) is not None:
                self._tenants[tenant_of(name)] -= 1
            self._used.pop(name, None)
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

    def take_snapshot(self, engine, root):
        """Another server's snapshot under `root` taken into `engine` beside these sessions (a
        drained replica's, moved here; on the engine's thread): how many named sessions came,
        or the error when it cannot be (the engine then unchanged)."""
        from serve import snapshot

        try:
            extra = snapshot.restore(engine, root, merge=True)
        except (ValueError, OSError) as e:  # CheckpointError is a ValueError
            return e
        if extra is None:
            return FileNotFoundError(f"no snapshot under {root}")
        taken, unnamed = self.merge(extra)
        for sid in unnamed:
            engine.close_session(sid)
        return len(taken)

    def merge(self, extra: dict) -> tuple[dict[str, int], set[int]]:
        """Take another server's snapshot `export` (restored with `serve.snapshot.restore`'s
        merge: `extra["session_ids"]` maps its engine ids to this engine's) beside these
        sessions: (the names taken and their engine sessions, the restored engine sessions no
        name took: a name already here keeps its own session)."""
        ids = {int(k): v for k, v in extra.get("session_ids", {}).items()}
        cut = set(extra.get("forgotten_sessions", ()))
        with self._lock:
            taken = {
                str(k): ids[int(v)]
                for k, v in extra.get("http_sessions", {}).items()
                if int(v) in ids and str(k) not in self._engine
            }
            now = time.monotonic()
            for name, sid in taken.items():
                self._engine[name], self._used[name] = sid, now
                self._tenants[tenant_of(name)] += 1
            keep = {n for n, sid in taken.items() if sid not in cut}
            self.replies.load(extra.get("replies", {}), keep)
            for k, v in extra.get("cleared", {}).items():
                if str(k) in taken:
                    self.context.cleared[str(k)] = set(v)
        return taken, set(ids.values()) - set(taken.values())

    def load(self, extra: dict) -> dict[str, int]:
        """Take a snapshot's `export` back (without the replies of sessions a later FORGET
        cut: `serve.forgotten`); the names and their engine sessions."""
        with self._lock:
            names = extra.get("http_sessions", {}).items()
            self._engine = collections.OrderedDict((str(k), int(v)) for k, v in names)
            self._used = dict.fromkeys(self._engine, time.monotonic())
            self._tenants = collections.Counter(map(tenant_of, self._engine))
            self.replies.load(extra.get("replies", {}))
            cut = set(extra.get("forgotten_sessions", ()))
            for name in [k for k, sid in self._engine.items() if sid in cut]:
                self.replies.forget(name)
            cleared = extra.get("cleared", {})
            self.context.cleared = {str(k): set(v) for k, v in cleared.items()}
            return dict(self._engine)
