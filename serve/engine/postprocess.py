"""`Postprocess`: what a step did, recorded (`apply(batch, ran)`): the one home of what follows
the device work.

- An applied edit: the turn's statistics and its session's text, clean prefix and pins; an
  edit the pool could not hold sends its turn back to the queue.
- A fed row: the turn's prompt still to feed, its session's clean prefix, and the whole clean
  pages it now has offered to the radix cache (shareable once they exist).
- A drawn token: its grammar, the turn's output and log-probabilities, and the turn's end on a
  stop token, its budget or a closed grammar. A turn that ends gives its clean prefix to the
  radix cache and its SCRATCH spans are spliced out of its session (`finish`, also what
  `Engine.cancel(stop=True)` calls).

Session facts are written through `SessionTable` alone.
"""

from __future__ import annotations

import time

import leyline_jax as ll
from leyline_jax import allocator
from leyline_jax import directives as dv
from serve import spans
from serve.engine.batch import Batch, Edit, EditDone, Ran, Sample
from serve.engine.caches import PrefixCaches
from serve.engine.pool import Pool
from serve.engine.sessions import SessionTable
from serve.engine.types import Request, Status


class Postprocess:
    def __init__(self, pool: Pool, table: SessionTable, caches: PrefixCaches, counters):
        self.pool, self.table, self.caches, self.counters = pool, table, caches, counters

    def apply(self, batch: Batch, ran: Ran) -> None:
        for e, done in zip(batch.edits, ran.edits, strict=True):
            self._edited(e, done)
        for row, block in zip(batch.rows, ran.fed, strict=True):
            if not block:
                continue
            r, s = row.request, row.request.session
            if row.prefill:
                r.pending = r.pending[len(block) :]
                self.counters["prefilled"] += len(block)
            else:
                r.fed += 1
            self.table.fed(s, len(block))
            if row.prefill:
                self.caches.cache_prefix(s)  # full clean pages are shareable once they exist
        now = time.perf_counter()
        for sample in ran.samples:
            self._drew(batch.rows[sample.row].request, sample, now)

    def _edited(self, e: Edit, done: EditDone | None) -> None:
        req, st = e.request, e.request.stats
        if done is None:  # the pool could not hold it now: nothing changed, it waits again
            self.table.requeue(req)
            req.status = Status.QUEUED
            return
        s, prompt = req.session, e.prompt
        st.prompt_tokens, st.reused_tokens, st.spliced_tokens = len(prompt), e.reused, 0
        if done.applied is not None:
            st.reused_tokens, st.spliced_tokens = done.applied.reused, done.applied.spliced
            st.moved_tokens = done.applied.moved
            st.recomputed_tokens = done.applied.recomputed
            self.counters["recomputed"] += done.applied.recomputed
        foreign = False
        if done.skipped:
            self.counters["moves_skipped"] += 1
        elif done.move is not None:
            st.spliced_tokens += done.moved
            st.moved_tokens += done.moved
            self.counters["moved"] += done.moved
            foreign = any(x.pages for x in done.move.sources)
        self.table.edited(s, prompt, e.clean, e.directives, e.move, foreign)
        req.pending = prompt[done.cached :]
        st.prefilled_tokens = len(prompt) - st.reused_tokens - st.spliced_tokens
        if not req.pending or st.prefilled_tokens < len(req.pending):
            raise RuntimeError(  # internal: the session's tokens no longer describe its cache
                f"session {s.id}: {st.reused_tokens} reused + {st.spliced_tokens} spliced of a "
                f"{len(prompt)}-token prompt with {done.cached} cached, {len(req.pending)} pending"
            )
        self.counters["reused"] += st.reused_tokens
        self.counters["spliced"] += st.spliced_tokens

    def _drew(self, r: Request, sample: Sample, now: float) -> None:
        t = sample.token
        if r.matcher is not None and not r.matcher.accept(t):  # it allowed no token
            self.finish(r, now)  # the reply ends where its grammar could go no further
            return
        r.output.append(t)
        if sample.logprob is not None:
            r.logprobs.append(sample.logprob)
        self.table.generated(r.session, t, now)
        if r.stats.first_token_s is None:
            r.stats.first_token(now)
        r.status = Status.DECODE
        closed = r.matcher is not None and r.matcher.closed  # the budget closed its grammar
        if t in r.sampling.stop_tokens or len(r.output) >= r.sampling.max_new_tokens or closed:
            self.finish(r, now)

    def finish(self, r: Request, now: float) -> None:
        """End `r` as done: its budget, a stop token, or its caller's stop (`Engine.cancel`)."""
        r.status = Status.DONE
        self.table.end(r.session)
        self.caches.cache_prefix(r.session)
        if r.scratch or r.scratch_tags is not None:
            self._drop_scratch(r)
        r.stats.finished(now)

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
        if need > self.table.available():
            self.counters["scratch_deferred"] += 1
            return
        try:
            if cached:
                self.pool.apply(s.seq, cached)
        except ll.OutOfPagesError:  # not expected (checked above); the spans stay
            self.counters["scratch_deferred"] += 1
            return
        removed = sum(d.end - d.start for d in ds)
        self.table.scratched(s, ds, cached[0].start if cached else None)
        req.stats.scratch_tokens = removed
        self.counters["scratch"] += removed
