"""`SessionTable`: the engine's sessions, their sequence slots, pins and queued turns: the one
writer of every `Session` field (the scheduler, the runner's post-processing and the engine
say what happened; the table records it).

A session is a conversation: its token list (prompt and generated tokens of every turn so far)
and, while it holds one, a sequence slot whose KV caches a prefix of that list (`cached`;
`clean` of it is what a fresh prefill would give). Idle sessions keep their KV until the pool
needs it; an offloaded session keeps its token list (packed, 4 bytes a token: `Session.pack`)
and gets its prefix back from the radix cache (or a prefill) on its next turn. A session
holding a pin is never offloaded. Only the sessions holding a slot (`holding`, at most
`max_seqs`) are scanned per step, so idle sessions cost memory, not time. `queued` is the one
queue of turns not yet admitted, in submission order.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Sequence

from leyline_jax import directives as dv
from leyline_jax.allocator import pages_for
from leyline_jax.config import check_tokens
from leyline_jax.hf_config import is_int
from serve import spans
from serve.engine.caches import OWN_LINEAGE, PrefixCaches
from serve.engine.planner import pin_edits
from serve.engine.pool import Pool
from serve.engine.types import Request, Session


class SessionTable:
    def __init__(self, pool: Pool, caches: PrefixCaches, counters: Counter):
        self.pool, self.caches, self.counters = pool, caches, counters
        self.sessions: dict[int, Session] = {}
        self.holding: dict[int, Session] = {}  # those holding a sequence slot
        self.queued: list[Request] = []  # turns not yet admitted, oldest first
        self._ids = itertools.count()
        self._order = itertools.count()  # submission order (`Request.order`)

    def get(self, session: int) -> Session:
        s = self.sessions.get(session) if is_int(session) else None
        if s is None:
            raise KeyError(f"unknown or closed session {session}")
        return s

    def open(self, lineage: str | None = None, salt: str = "") -> int:
        if lineage is not None and not isinstance(lineage, str):
            raise ValueError(f"lineage must be a string, got {lineage!r}")
        if not isinstance(salt, str):
            raise ValueError(f"salt must be a string, got {salt!r}")
        if lineage is not None and lineage.startswith(OWN_LINEAGE):
            raise ValueError(
                f"lineage {lineage!r}: names starting with {OWN_LINEAGE!r} are the engine's "
                "(a session's own lineage)"
            )
        sid = next(self._ids)
        own = f"{OWN_LINEAGE}{sid}"
        lineage = own if lineage is None else lineage
        s = Session(sid, last_used=time.perf_counter(), lineage=lineage, salt=salt, pool=self.pool)
        self.sessions[sid] = s
        return sid

    def reserve(self, n: int) -> list[int]:
        """`n` ids no session has had nor will get from `open`: for sessions restored beside
        live ones (`serve.snapshot.restore`'s merge)."""
        return [next(self._ids) for _ in range(n)]

    def close(self, session: int) -> None:
        s = self.get(session)
        if self.busy(s):
            raise ValueError(f"session {session} still has turns in flight")
        self.offload(s)
        del self.sessions[session]
        if s.lineage.startswith(OWN_LINEAGE):  # no later session can have its own lineage
            self.caches.drop_lineage(s.lineage)

    # ---- pins --------------------------------------------------------------------------------
    def pin(self, session: int, start: int, end: int) -> None:
        s = self.get(session)
        (span,) = spans.check_spans([(start, end)], len(s.tokens), "pinned span")
        s.pins = sorted([*s.pins, span])

    def unpin(self, session: int, start: int, end: int) -> None:
        s = self.get(session)
        if (start, end) not in s.pins:
            raise ValueError(f"session {session} has no pin ({start}, {end}): {s.pins}")
        s.pins.remove((start, end))

    def pinned_pages(self, exclude: Session | None = None) -> set[int]:
        """Pages no eviction or offload may free: those of sessions holding pins (but
        `exclude`) and the radix cache's pinned pages."""
        radix = self.caches.radix
        out = set(radix.pinned_pages()) if radix is not None else set()
        for x in self.holding.values():
            if x is not exclude and x.pins:
                out.update(self.pool.seq_pages(x.seq))
        return out

    # ---- slots -------------------------------------------------------------------------------
    def idle_victim(self, exclude: Session) -> Session | None:
        """The least recently used idle session holding KV and no pin (but `exclude`)."""
        idle = [
            s for s in self.holding.values() if s is not exclude and s.active is None and not s.pins
        ]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def free_slots(self) -> list[int]:
        """Sequence slots no session holds, lowest first."""
        used = {x.seq for x in self.holding.values()}
        return [q for q in range(self.pool.state.max_seqs) if q not in used]

    def take_slot(self, s: Session) -> bool:
        """Give `s` an open, empty sequence slot (offloading an idle session if need be)."""
        free = self.free_slots()
        if not free:
            victim = self.idle_victim(exclude=s)
            if victim is None:
                return False
            free = [self.offload(victim)]
        s.seq = free[0]
        self.holding[s.id] = s
        self.pool.open(s.seq)
        return True

    def offload(self, s: Session) -> int | None:
        """Give up a session's KV (its clean prefix stays in the radix cache); returns the
        sequence slot it held."""
        seq = s.seq
        if seq is None:
            return None
        self.caches.cache_prefix(s)
        self.pool.free(seq)
        s.seq, s.clean, s.foreign = None, 0, False
        del self.holding[s.id]
        if not self.busy(s):
            s.pack()
        self.counters["offloads"] += 1
        return seq

    # ---- turns -------------------------------------------------------------------------------
    def enqueue(self, req: Request) -> Request:
        req.order = next(self._order)
        self.queued.append(req)
        return req

    def dequeue(self, req: Request) -> None:
        """Take a turn out of the queue (admitted, or cancelled while queued)."""
        self.queued.remove(req)

    def turns(self, s: Session) -> list[Request]:
        """`s`'s queued turns, oldest first."""
        return [r for r in self.queued if r.session is s]

    def busy(self, s: Session) -> bool:
        """A turn of `s` runs or waits."""
        return s.active is not None or any(r.session is s for r in self.queued)

    def running(self) -> list[Request]:
        """The admitted turns, in the order their sessions took their slots."""
        return [s.active for s in self.holding.values() if s.active is not None]

    def available(self, exclude=frozenset()) -> int:
        """Free pages, less what running turns may still take (their remaining prompt and
        token budget); turns whose id is in `exclude` are left out."""
        still = sum(
            self.pool.still_needs(r.session.seq, len(r.pending), r.sampling.max_new_tokens - r.fed)
            for r in self.running()
            if id(r) not in exclude
        )
        return self.pool.free_count() - still

    def admit(self, req: Request) -> None:
        """`req` is admitted: it leaves the queue and its session runs it."""
        self.dequeue(req)
        req.session.active = req

    def requeue(self, req: Request) -> None:
        """An admitted turn whose edit the pool could not hold goes back to the queue, in its
        place by submission order (`Request.order`)."""
        req.session.active = None
        at = sum(r.order < req.order for r in self.queued)
        self.queued.insert(at, req)

    def end(self, s: Session) -> None:
        """Its running turn ended (done, failed or cancelled)."""
        s.active = None

    def cut(self, s: Session, at: int) -> None:
        """Its KV was cut to tokens[:at] (the caller cut it)."""
        s.clean = min(s.clean, at)

    def edited(self, s: Session, prompt, clean: int, ds, private: bool, foreign: bool) -> None:
        """Its admitted turn's edit is applied: the session's text is `prompt` (after the
        batch `ds`, which its pins move with), its clean prefix `clean`; `private`: it ran
        MOVE; `foreign`: that MOVE copied KV from another session's pages."""
        s.pins = spans.remap(s.pins, pin_edits(s.tokens, ds, prompt))
        s.tokens, s.clean = list(prompt), clean
        s.private, s.foreign = s.private or private, s.foreign or foreign
        s.last_used = time.perf_counter()

    def fed(self, s: Session, n: int) -> None:
        """A step wrote the KV of its next `n` tokens (the KV now holds tokens[:cached])."""
        if s.clean == s.cached - n:
            s.clean = s.cached

    def generated(self, s: Session, token: int, now: float) -> None:
        s.tokens.append(token)
        s.last_used = now

    def scratched(self, s: Session, ds: list, first_cached: int | None) -> None:
        """SCRATCH spans `ds` (deletions) left its text; its KV was spliced from
        `first_cached` on (None: no cached token was)."""
        if first_cached is not None:
            s.clean = min(s.clean, first_cached)
        s.pins = spans.remap(s.pins, ds)
        s.tokens = dv.apply_to_list(s.tokens, ds)

    def mark_foreign(self, lineage: str, pages: set[int]) -> None:
        """Sessions of `lineage` whose KV holds one of `pages` (its private tree's, purged
        while another's KV still holds them): their KV is never cached for the lineage again."""
        for other in self.holding.values() if pages else ():
            if other.lineage == lineage:
                other.foreign |= bool(pages & set(self.pool.seq_pages(other.seq)))

    # ---- snapshots ---------------------------------------------------------------------------
    def restore(
        self, session: int, tokens: Sequence[int], pages: Sequence[int], cached: int, clean: int,
        pins=(), lineage: str | None = None, private: bool = False, foreign: bool = False,
        salt: str = "",
    ) -> Session:  # fmt: skip
        """Recreate a saved session (see `Engine.restore_session`, which documents it)."""
        if not is_int(session) or session < 0:
            raise ValueError(f"session id {session!r} must be a non-negative integer")
        if session in self.sessions:
            raise ValueError(f"session {session} is already open")
        toks = check_tokens(tokens, self.pool.model.config.vocab_size, allow_empty=True).tolist()
        if not all(is_int(v) for v in (cached, clean)) or not 0 <= clean <= cached <= len(toks):
            raise ValueError(f"need 0 <= clean ({clean}) <= cached ({cached}) <= {len(toks)}")
        pages, ps = list(pages), self.pool.page_size
        if len(pages) != pages_for(cached, ps):
            raise ValueError(f"{len(pages)} pages for {cached} cached tokens of {ps}")
        own = f"{OWN_LINEAGE}{int(session)}"
        lineage = own if lineage is None else lineage
        if not isinstance(lineage, str) or (lineage != own and lineage.startswith(OWN_LINEAGE)):
            raise ValueError(f"lineage {lineage!r} is not session {session}'s own nor a name")
        if not isinstance(salt, str):
            raise ValueError(f"salt must be a string, got {salt!r}")
        pins = spans.check_spans(pins, len(toks), "pinned span")
        s = Session(int(session), toks, last_used=time.perf_counter(), lineage=lineage, salt=salt)
        s.pool = self.pool
        s.pins, s.private, s.foreign = pins, bool(private), bool(foreign)
        if cached:
            free = self.free_slots()
            if not free:
                raise ValueError(f"no free sequence slot for session {session}")
            self.pool.adopt_partial(free[0], pages, toks[:cached])
            s.seq, s.clean = free[0], clean
            self.caches.cache_prefix(s)
            self.holding[s.id] = s
        else:
            s.pack()
        self.sessions[s.id] = s
        self._ids = itertools.count(max(next(self._ids), s.id + 1))
        return s
