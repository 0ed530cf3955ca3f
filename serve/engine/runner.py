"""`Runner`: everything that runs on the device for the engine, in the order a turn meets it.

- `start`: an admitted turn's edit applied to its session's KV (a radix or lineage hit for a
  session starting again; else its splices, then MOVE) and its prompt set up to feed.
- `step`: one ragged step over every running turn (the next prompt chunk of each turn still
  prefilling and the last token of each generating one: chunked prefill riding with decode),
  then one sampled token for each turn whose prompt is done; turns that hit a stop token or
  their budget finish (SCRATCH spans are spliced out of their sessions then).
- `warmup_plan`: every shape those steps can take, to compile up front.

The sampled tokens are the only thing a step reads back from the device (and their
log-probabilities, in a step where a turn asks for them).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from leyline_jax import allocator, paged, splice
from leyline_jax import directives as dv
from leyline_jax.directives import Mode
from serve import sampling as draw
from serve import spans
from serve.engine import planner
from serve.engine.caches import PrefixCaches
from serve.engine.planner import KVPlan, TurnPlan
from serve.engine.pool import Pool
from serve.engine.sessions import SessionTable
from serve.engine.types import Request, Session, Status


class Runner:
    def __init__(self, pool: Pool, table: SessionTable, caches: PrefixCaches, config, counters):
        self.pool, self.table, self.caches = pool, table, caches
        self.config, self.counters = config, counters

    def running(self) -> list[Request]:
        return [s.active for s in self.table.holding.values() if s.active is not None]

    def available(self) -> int:
        """Free pages, less what running turns may still take (their remaining prompt and
        token budget)."""
        still = sum(
            self.pool.still_needs(r.session.seq, len(r.pending), r.sampling.max_new_tokens - r.fed)
            for r in self.running()
        )
        return self.pool.free_count() - still

    # ---- edits -------------------------------------------------------------------------------
    def resolve_decays(self, s: Session, ds: list[ll.Directive]) -> list[ll.Directive]:
        """DECAY directives resolved into MOVEs of the tokens they keep, chosen from the
        session's KV (`leyline_jax.importance`): it must hold every DECAY span."""
        short = [d for d in ds if d.mode is Mode.DECAY and (s.seq is None or d.end > s.cached)]
        if short:
            raise dv.DirectiveError(
                f"DECAY [{short[0].start}, {short[0].end}) needs the span's KV, but session "
                f"{s.id} holds {s.cached if s.seq is not None else 0} cached tokens"
            )
        out, _ = dv.resolve_decays(self.pool.model, self.pool.state, s.seq, ds)
        return dv.validate(out, len(s.tokens), self.pool.model.config.vocab_size, s.tokens)

    def cut(self, s: Session, ds, at: int) -> None:
        """Truncate a session's KV to tokens[:at] (KV before it is kept exactly), after a
        FORGET batch's purge of the caches."""
        self.caches.purge(s, ds, self.table.holding)
        self.pool.apply(s.seq, [ll.Directive(at, s.cached, (), Mode.FORGET)])
        s.cached, s.clean = at, min(s.clean, at)

    def start(self, req: Request, plan: TurnPlan, kvp: KVPlan | None) -> None:
        """Apply the turn's edit to the session's KV and set up its prompt (the turn is
        admitted). `kvp` None: the session has just been given an empty sequence slot."""
        s, st, prompt = req.session, req.stats, plan.prompt
        self.caches.purge(s, plan.directives, self.table.holding)
        st.prompt_tokens, st.reused_tokens, st.spliced_tokens = len(prompt), 0, 0
        if kvp is None:  # the longest prefix the caches let it reuse
            pages, hit, s.clean = self.caches.match(s, prompt)
            if hit:  # the slot is open and empty: reopen it holding the cached pages
                self.pool.free(s.seq)
                self.pool.open(s.seq, pages, prompt[:hit])
            s.cached = st.reused_tokens = hit
        else:  # the KV holds tokens[:cut] (admission cut it): splice what precedes the cut
            st.reused_tokens = kvp.cut
            if kvp.splices:
                done = self.pool.apply(s.seq, kvp.splices)
                st.reused_tokens, st.spliced_tokens = done.reused, done.spliced
                st.moved_tokens = done.moved
            s.clean = planner.clean_after_edit(s.clean, kvp)
            s.cached = kvp.kept
        s.pins = spans.remap(s.pins, planner.pin_edits(s.tokens, plan.directives, prompt))
        if self.config.move if req.move is None else req.move:
            s.private = True
            self._move(req, prompt)
        s.tokens = list(prompt)
        req.pending = prompt[s.cached :]
        st.prefilled_tokens = len(prompt) - st.reused_tokens - st.spliced_tokens
        if not req.pending or st.prefilled_tokens < len(req.pending):
            raise RuntimeError(  # internal: the session's tokens no longer describe its cache
                f"session {s.id}: {st.reused_tokens} reused + {st.spliced_tokens} spliced of a "
                f"{len(prompt)}-token prompt with {s.cached} cached, {len(req.pending)} pending"
            )
        s.active, s.last_used = req, time.perf_counter()
        req.status = Status.PREFILL
        self.counters["reused"] += st.reused_tokens
        self.counters["spliced"] += st.spliced_tokens

    def _move(self, req: Request, prompt: list[int]) -> None:
        """Apply the turn's MOVE (`planner.move_plan`) to its session's KV, if there is one. A
        MOVE the pool cannot hold now is skipped: those tokens are prefilled instead."""
        s, st = req.session, req.stats
        d = planner.move_plan(
            prompt, s.cached, self.pool.page_size, lambda key: self.caches.locate(key, s)
        )
        if d is None:
            return
        try:
            done = self.pool.apply(s.seq, [d])
        except ll.OutOfPagesError:
            self.counters["moves_skipped"] += 1
            return
        s.cached += len(d.replacement)
        s.foreign = s.foreign or any(x.pages for x in d.sources)
        st.spliced_tokens += done.moved
        st.moved_tokens += done.moved
        self.counters["moved"] += done.moved

    def _drop_scratch(self, req: Request) -> None:
        """Splice the finished turn's SCRATCH spans out of its session (one AMORTIZE batch of
        deletions on the KV it holds; tokens known but not cached are dropped from the token
        list). A span that cuts into a pin is left; a batch the pool cannot hold now is left
        for the next turn's edit detection (its prompt no longer holds the spans)."""
        s = req.session
        marked = list(req.scratch)
        if req.scratch_tags is not None:
            n = len(s.tokens) - len(req.output)
            marked += [(n + a, n + b) for a, b in spans.find_tagged(req.output, *req.scratch_tags)]
        ds = [ll.Directive(a, b) for a, b in sorted(marked)]
        ds = [d for d in ds if not any(spans.cuts_into(d, p) for p in s.pins)]
        if not ds or s.seq is None or len(dv.apply_to_list(s.tokens, ds)) == 0:
            return
        cached = [ll.Directive(d.start, min(d.end, s.cached)) for d in ds if d.start < s.cached]
        left = s.cached - sum(d.end - d.start for d in cached)
        if not left:  # nothing of the KV is left
            self.table.offload(s)
            cached = []
        # only pages no running turn may still take
        need = allocator.splice_need(self.pool.page_size, left, cached[0].start) if cached else 0
        if need > self.available():
            self.counters["scratch_deferred"] += 1
            return
        try:
            if cached:
                self.pool.apply(s.seq, cached)
        except ll.OutOfPagesError:  # not expected (checked above); the spans stay
            self.counters["scratch_deferred"] += 1
            return
        removed = sum(d.end - d.start for d in ds)
        s.cached -= sum(d.end - d.start for d in cached)
        if cached:
            s.clean = min(s.clean, cached[0].start)
        s.pins = spans.remap(s.pins, ds)
        s.tokens = dv.apply_to_list(s.tokens, ds)
        req.stats.scratch_tokens = removed
        self.counters["scratch"] += removed

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """One ragged step for every running turn; a token for each turn whose prompt is done
        and each generating turn."""
        rows, blocks = self._batch(self.running())
        if not rows:
            return
        prefill = [r.status is Status.PREFILL for r in rows]
        logits = self.pool.extend([r.session.seq for r in rows], blocks)
        emit = []
        for i, (r, b, p) in enumerate(zip(rows, blocks, prefill, strict=True)):
            s = r.session
            if p:
                r.pending = r.pending[len(b) :]
                self.counters["prefilled"] += len(b)
            else:
                r.fed += 1
            if s.clean == s.cached:
                s.clean += len(b)
            s.cached += len(b)
            if p:
                self.caches.cache_prefix(s)  # full clean pages are shareable once they exist
            if not r.pending:
                emit.append(i)
        if emit:
            self._emit(rows, emit, logits)

    def _batch(self, running: list[Request]) -> tuple[list[Request], list[list[int]]]:
        """The step's rows and their blocks: every generating turn's last token, then each
        prefilling turn's next chunk (at most `prefill_chunk`) while the step holds fewer than
        `max_num_batched_tokens` tokens; a turn left out runs in a later step."""
        budget = self.config.max_num_batched_tokens
        budget -= sum(r.status is not Status.PREFILL for r in running)
        rows, blocks = [], []
        for r in running:
            if r.status is not Status.PREFILL:
                block = [r.output[-1]]
            else:
                block = r.pending[: min(self.config.prefill_chunk, budget)]
                budget -= len(block)
            if block:
                rows.append(r)
                blocks.append(block)
        return rows, blocks

    def _emit(self, rows: list[Request], emit: list[int], logits) -> None:
        """Sample a token for rows[i], i in `emit` (`serve.sampling.tokens`), and finish the
        turns that are done. `logits`: one row per step row and padding ([row bucket, vocab])."""
        toks = draw.tokens(logits, rows, set(emit))
        asked = any(rows[i].sampling.logprobs is not None for i in emit)
        with jax.transfer_guard_device_to_host("allow"):  # the reads a step makes
            lps = [np.asarray(a) for a in draw.token_logprobs(logits, toks)] if asked else None
            toks = np.asarray(toks)
        now = time.perf_counter()
        for i, r, t in ((i, rows[i], int(toks[i])) for i in emit):
            if r.matcher is not None and not r.matcher.accept(t):  # it allowed no token
                self.finish(r, now)  # the reply ends where its grammar could go no further
                continue
            r.output.append(t)
            if (k := r.sampling.logprobs) is not None:
                top = zip(lps[1][i, :k].tolist(), lps[2][i, :k].tolist(), strict=True)
                r.logprobs.append((float(lps[0][i]), tuple(top)))
            r.session.tokens.append(t)
            r.session.last_used = now
            if r.stats.first_token_s is None:
                r.stats.first_token(now)
            r.status = Status.DECODE
            closed = r.matcher is not None and r.matcher.closed  # the budget closed its grammar
            if t in r.sampling.stop_tokens or len(r.output) >= r.sampling.max_new_tokens or closed:
                self.finish(r, now)

    def finish(self, r: Request, now: float) -> None:
        """End `r` as done: its budget, a stop token, or its caller's stop (`Engine.cancel`)."""
        r.status, r.session.active = Status.DONE, None
        self.caches.cache_prefix(r.session)
        if r.scratch or r.scratch_tags is not None:
            self._drop_scratch(r)
        r.stats.finished(now)

    def warmup_plan(self) -> list[tuple[str, Callable[[], None]]]:
        """Every shape the steps can take, smallest first, as (what, compile it) pairs for
        `serve.engine.warmup.Warmup`: each step shape (`leyline_jax.paged.step_shapes`) with
        the sampling of its rows, then each edit shape (`leyline_jax.splice.shapes`)."""
        state = self.pool.state
        steps = [
            (f"step of {t} tokens, {b} rows", functools.partial(self._warm_step, t, b))
            for t, b in paged.step_shapes(state)
        ]
        edits = [
            (f"{kind} of {k}", functools.partial(self._warm_edit, kind, k))
            for kind, k in splice.shapes(state)
        ]
        return steps + edits

    def _warm_step(self, tokens: int, rows: int) -> None:
        pool = self.pool
        pool.state = paged.precompile(pool.model, pool.state, (tokens, rows), pool.graph)
        # the sampling columns made as `sampling.tokens` makes them (an upload compiles too)
        cols = [
            jnp.asarray(np.ones(rows, t)) for t in (np.float32, np.float32, np.uint32, np.int32)
        ]
        vocab = pool.model.config.vocab_size
        logits = jnp.zeros((rows, vocab), jnp.float32)
        toks = draw.sample(logits, *cols, None)  # as `_emit` calls it: no mask
        jax.block_until_ready(draw.token_logprobs(logits, toks))  # a step with logprobs asked
        penalized = draw.penalize(logits, *draw.penalties([], logits.shape))  # ... penalties
        masks = jnp.asarray(np.full((rows, draw.mask_words(vocab)), -1, np.int32))
        jax.block_until_ready(draw.sample(penalized, *cols, masks))  # ... a constrained row

    def _warm_edit(self, kind: str, size: int) -> None:
        pool = self.pool
        pool.state = splice.precompile(pool.model, pool.state, (kind, size))
