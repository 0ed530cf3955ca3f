"""`Scheduler`: admission, making room in the pool, and the step's batch.

`schedule()` returns the step as a value (`serve.engine.batch.Batch`): the edits of the turns it
admits now, then one row for every running turn (a generating turn's last token; a prefilling
turn's next chunk, at most `prefill_chunk` tokens, while the step holds fewer than
`max_num_batched_tokens`). The pool's bookkeeping is done here, as a turn is admitted: the
room it needs, its sequence slot, a FORGET's cut and purge, a cached prefix it reopens; the
device work of its edit (splices, MOVE) is in the batch, for the runner.

Turns are admitted oldest first, one at a time per session, each with its edit applied before
the step's rows run (never inside a step of that session, while every other session keeps its
place). A turn is admitted only when the free pages, less what running turns may still take
(their remaining prompt and token budget) and what turns admitted in this step may take, cover
the most it can take (`leyline_jax.allocator.turn_need`); a turn that cuts its session's KV
cuts it first, so what the cut frees is already back. To find room the scheduler evicts cached
pages nobody else uses (least recently used first), then offloads idle sessions (least
recently used first); failing that the turn, and every later one, waits for running turns to
finish. A turn that could not fit even in an otherwise empty pool (or only pinned KV holds what
it needs) fails alone, with an error saying why.
"""

from __future__ import annotations

from leyline_jax import allocator
from leyline_jax import directives as dv
from leyline_jax.directives import Mode
from serve import spans
from serve.engine import planner
from serve.engine.batch import Batch, Edit, Row
from serve.engine.caches import PrefixCaches
from serve.engine.planner import KVPlan, TurnPlan
from serve.engine.pool import Pool
from serve.engine.sessions import SessionTable
from serve.engine.types import Admission, Request, RequestError, Session, Status


class Scheduler:
    def __init__(self, table: SessionTable, pool: Pool, caches: PrefixCaches, config, counters):
        self.table, self.pool, self.caches = table, pool, caches
        self.config, self.counters = config, counters
        self._admitted: dict[int, tuple[Edit, int]] = {}  # this step's: id(turn) -> (edit, need)

    def idle(self) -> bool:
        return not self.table.queued and not self.table.running()

    def available(self) -> int:
        """Free pages, less what running turns may still take (their remaining prompt and
        token budget) and what turns admitted in this step may take at most."""
        reserved = sum(n for _, n in self._admitted.values())
        return self.table.available(exclude=self._admitted) - reserved

    def schedule(self) -> Batch:
        """Admit queued turns, oldest first, while the pool can hold them; the step's batch."""
        self._admitted = {}
        for req in list(self.table.queued):
            s = req.session
            if s.active is not None or self.table.turns(s)[0] is not req:
                continue  # a session runs its turns one at a time, in order
            if self._try_admit(req) is Admission.WAIT:
                break  # first come, first served: later turns wait behind this one
        edits = tuple(e for e, _ in self._admitted.values())
        batch = Batch(edits, self._rows())
        self._admitted = {}
        return batch

    def _rows(self) -> tuple[Row, ...]:
        running = self.table.running()
        budget = self.config.max_num_batched_tokens
        budget -= sum(r.status is not Status.PREFILL for r in running)
        rows = []
        for r in running:
            if r.status is not Status.PREFILL:
                rows.append(Row(r, 1, False))
                continue
            edit = self._admitted.get(id(r), (None,))[0]
            # a turn admitted now feeds what its edit leaves (its MOVE may leave fewer)
            left = len(r.pending) if edit is None else len(edit.prompt) - edit.kept
            n = min(self.config.prefill_chunk, budget, left)
            budget -= n
            if n:
                rows.append(Row(r, n, True))
        return tuple(rows)

    def _fail(self, req: Request, error: Exception) -> Admission:
        self.table.dequeue(req)
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
                req.decays = self._resolve_decays(s, ds)
            ds = req.decays
        plan = planner.plan_turn(s.tokens, ds, new, s.pins)
        if req.prompt is None:
            req.scratch = spans.check_spans(req.scratch, len(plan.prompt), "scratch span")
        return plan

    def _resolve_decays(self, s: Session, ds: list[dv.Directive]) -> list[dv.Directive]:
        """DECAY directives resolved into MOVEs of the tokens they keep, chosen from the
        session's KV (`leyline_jax.importance`): it must hold every DECAY span."""
        short = [d for d in ds if d.mode is Mode.DECAY and (s.seq is None or d.end > s.cached)]
        if short:
            raise dv.DirectiveError(
                f"DECAY [{short[0].start}, {short[0].end}) needs the span's KV, but session "
                f"{s.id} holds {s.cached} cached tokens"
            )
        self.pool.state, out, _ = dv.resolve_decays(self.pool.model, self.pool.state, s.seq, ds)
        return dv.validate(out, len(s.tokens), self.pool.model.config.vocab_size, s.tokens)

    def _purge(self, s: Session, ds) -> None:
        self.table.mark_foreign(s.lineage, self.caches.purge(s, ds))

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
            self._purge(s, plan.directives)
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
            self._cut(s, plan.directives, kvp.cut)
        if self._admitted and self.available() < need:
            return Admission.WAIT  # exact accounting once this step's edits are applied
        if not self._make_room(need, s):
            return self._wait_or_fail(req, f"{need} pages")
        if s.seq is None and not self.table.take_slot(s):
            return self._wait_or_fail(req, "a sequence slot")
        self._admit(req, plan, kvp, need)
        return Admission.ADMITTED

    def _cut(self, s: Session, ds, at: int) -> None:
        """Truncate a session's KV to tokens[:at] (KV before it is kept exactly), after a
        FORGET batch's purge of the caches."""
        self._purge(s, ds)
        self.pool.apply(s.seq, [dv.Directive(at, s.cached, (), Mode.FORGET)])
        self.table.cut(s, at)

    def _admit(self, req: Request, plan: TurnPlan, kvp: KVPlan | None, need: int) -> None:
        """The turn runs from this step: its FORGET purge and its cached prefix now (a
        session starting again reopens its slot on the longest prefix the caches let it
        reuse); its splices and MOVE in the batch."""
        s, prompt = req.session, plan.prompt
        self._purge(s, plan.directives)
        if kvp is None:
            pages, hit, clean = self.caches.match(s, prompt)
            if hit:  # the slot is open and empty: reopen it holding the cached pages
                self.pool.free(s.seq)
                self.pool.open(s.seq, pages, prompt[:hit])
            kvp = KVPlan([], hit, hit)
        else:
            clean = planner.clean_after_edit(s.clean, kvp)
        move = self.config.move if req.move is None else req.move
        budget = self.config.recompute if req.recompute is None else req.recompute
        splices = dv.with_recompute(kvp.splices, budget)
        edit = Edit(req, prompt, plan.directives, splices, kvp.cut, clean, kvp.kept, move)
        self._admitted[id(req)] = (edit, need)
        self.table.admit(req)
        req.status = Status.PREFILL

    def _make_room(self, need: int, for_session: Session) -> bool:
        """Evict cached pages, then offload idle sessions, until `need` pages are available."""
        while (short := need - self.available()) > 0:
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
        if self.table.running():
            return Admission.WAIT
        pinned = [x.id for x in self.table.holding.values() if x.pins]
        why = (
            f"the turn needs {what} that only pinned KV holds (sessions {pinned} hold pins; "
            f"{len(self.table.pinned_pages())} pages are pinned): unpin some to make room"
        )
        return self._fail(req, RequestError(why))
