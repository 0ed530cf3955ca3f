"""`Scheduler`: the one queue of turns, admission, and making room in the pool.

Turns are admitted oldest first, one at a time per session, each with its edit applied as it
is admitted (between steps, never inside a step of that session, while every other session
keeps its place). A turn is admitted only when the free pages, less what running turns may
still take (their remaining prompt and token budget), cover the most it can take
(`leyline_jax.allocator.turn_need`); a turn that cuts its session's KV cuts it first, so what
the cut frees is already back. To find room the scheduler evicts cached pages nobody else uses
(least recently used first), then offloads idle sessions (least recently used first); failing
that the turn, and every later one, waits for running turns to finish. A turn that could not
fit even in an otherwise empty pool (or only pinned KV holds what it needs) fails alone, with
an error saying why.
"""

from __future__ import annotations

import itertools

from leyline_jax import allocator
from leyline_jax import directives as dv
from leyline_jax.directives import Mode
from serve import spans
from serve.engine import planner
from serve.engine.planner import TurnPlan
from serve.engine.runner import Runner
from serve.engine.sessions import SessionTable
from serve.engine.types import Admission, Request, RequestError, Session, Status


class Scheduler:
    def __init__(self, table: SessionTable, runner: Runner, counters):
        self.table, self.runner, self.counters = table, runner, counters
        self.pool, self.caches = runner.pool, runner.caches
        self.queued: list[tuple[int, Request]] = []  # (submission order, turn)
        self._order = itertools.count()

    def queue(self, req: Request) -> Request:
        req.session.queue.append(req)
        self.queued.append((next(self._order), req))
        return req

    def drop(self, req: Request) -> None:
        """Take a queued turn out of the queue (it was cancelled)."""
        self.queued = [(o, r) for o, r in self.queued if r is not req]
        if req in req.session.queue:
            req.session.queue.remove(req)

    def idle(self) -> bool:
        return not self.queued and not self.runner.running()

    def schedule(self) -> None:
        """Admit queued turns, oldest first, while the pool can hold them."""
        self.queued.sort(key=lambda x: x[0])
        for order, req in list(self.queued):
            s = req.session
            if s.active is not None or s.queue[0] is not req:
                continue  # a session runs its turns one at a time, in order
            if self._try_admit(req) is Admission.WAIT:
                break  # first come, first served: later turns wait behind this one
            self.queued.remove((order, req))
            s.queue.popleft()

    def _fail(self, req: Request, error: Exception) -> Admission:
        req.fail(error)
        self.counters["failed_turns"] += 1
        return Admission.FAILED

    def _plan(self, req: Request) -> TurnPlan:
        """Validate the turn against its session now (a whole prompt becomes directives + new
        tokens here, against the session's tokens as they are now; a DECAY is resolved once,
        from the KV as the turn first finds it). Raises DirectiveError (a ValueError) for what
        the session refuses."""
        s, vocab = req.session, self.pool.model.config.vocab_size
        ds, new = planner.edits_of(
            s.tokens, req.prompt, req.directives, req.new_tokens, req.mode, s.pins
        )
        ds = dv.validate(ds, len(s.tokens), vocab, s.tokens)
        if any(d.mode is Mode.DECAY for d in ds):
            spans.check_pins(s.pins, ds)
            if req.decays is None:  # a turn that waits may cut or lose its KV meanwhile
                req.decays = self.runner.resolve_decays(s, ds)
            ds = req.decays
        plan = planner.plan_turn(s.tokens, ds, new, s.pins)
        if req.prompt is None:
            req.scratch = spans.check_spans(req.scratch, len(plan.prompt), "scratch span")
        return plan

    def _try_admit(self, req: Request) -> Admission:
        s = req.session
        try:
            plan = self._plan(req)
        except ValueError as e:  # DirectiveError included
            return self._fail(req, e)
        final = len(plan.prompt) + req.sampling.max_new_tokens
        if final > self.pool.state.max_seq_len:
            why = (
                f"the turn would make session {s.id} {final} tokens long (prompt and "
                f"max_new_tokens), more than max_seq_len={self.pool.state.max_seq_len}"
            )
            return self._fail(req, RequestError(why))
        kvp = None if s.seq is None else planner.kv_plan(s.cached, plan)
        if kvp is not None and kvp.splices:
            kvp, plain = planner.movable(kvp)
            if plain:
                self.counters["moves_prefilled"] += plain
        if kvp is not None and kvp.kept == 0:
            # nothing of the cached KV survives the edit: the session's KV starts again
            self.table.offload(s)
            self.caches.purge(s, plan.directives, self.table.holding)
            kvp = None
        first = kvp.splices[0].start if kvp is not None and kvp.splices else None
        ps = self.pool.page_size
        need, held = allocator.turn_need(ps, final, None if kvp is None else kvp.cut, first)
        own = set() if s.seq is None else set(self.pool.seq_pages(s.seq)[:held])
        pinned = len(self.table.pinned_pages(exclude=s) - own)
        if need > self.pool.state.num_pages - held - pinned:
            why = (
                f"the turn needs up to {need} pages of {ps} tokens beside the {held} its "
                f"session holds meanwhile; the pool has {self.pool.state.num_pages}"
                + (f", {pinned} of them pinned" if pinned else "")
            )
            return self._fail(req, RequestError(why))
        if kvp is not None and kvp.cut < s.cached:
            # cut first: the pages past the cut come back before the turn takes any (the turn
            # will cut there whenever it runs; a turn that then waits leaves its session cut)
            self.runner.cut(s, plan.directives, kvp.cut)
        if not self._make_room(need, s):
            return self._wait_or_fail(req, f"{need} pages")
        if s.seq is None and not self.table.take_slot(s):
            return self._wait_or_fail(req, "a sequence slot")
        try:
            self.runner.start(req, plan, kvp)
        except allocator.OutOfPagesError:  # the accounting above is an upper bound
            s.active, req.status = None, Status.QUEUED
            return Admission.WAIT
        return Admission.ADMITTED

    def _make_room(self, need: int, for_session: Session) -> bool:
        """Evict cached pages, then offload idle sessions, until `need` pages are available."""
        while (short := need - self.runner.available()) > 0:
            freed = self.caches.evict(short)
            if freed:
                self.counters["radix_evicted_pages"] += freed
                continue
            victim = self.table.idle_victim(exclude=for_session)
            if victim is None:
                return False
            self.table.offload(victim)
        return True

    def _wait_or_fail(self, req: Request, what: str) -> Admission:
        """A turn that found no room waits while other turns run (they will free theirs); with
        none running, only pins hold what it needs (everything else can be evicted or
        offloaded), so it fails rather than wait for an unpin."""
        if self.runner.running():
            return Admission.WAIT
        pinned = [x.id for x in self.table.holding.values() if x.pins]
        why = (
            f"the turn needs {what} that only pinned KV holds (sessions {pinned} hold pins; "
            f"{len(self.table.pinned_pages())} pages are pinned): unpin some to make room"
        )
        return self._fail(req, RequestError(why))
