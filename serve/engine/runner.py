"""`Runner`: the step's device work, exactly as the scheduler's batch says
(`serve.engine.batch`).

`execute(batch)`: each admitted turn's edit applied to its session's KV (its splices, then its
MOVE), then one ragged step over the batch's rows (the next prompt chunk of each turn still
prefilling and the last token of each generating one: chunked prefill riding with decode),
then one drawn token for each row whose prompt is done. It returns what happened (`Ran`) and
changes nothing on the host but the pool; post-processing records it.
`warmup_plan`: every shape those steps can take, to compile up front.

The drawn tokens are the only thing a step reads back from the device (and their
log-probabilities, in a step where a turn asks for them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from leyline_jax import paged, splice
from serve import sampling as draw
from serve.engine import planner
from serve.engine.batch import Batch, Edit, EditDone, Ran, Sample
from serve.engine.caches import PrefixCaches
from serve.engine.pool import Pool


class Runner:
    def __init__(self, pool: Pool, caches: PrefixCaches):
        self.pool, self.caches = pool, caches  # the caches: where MOVE finds shared pages

    def execute(self, batch: Batch) -> Ran:
        edits = tuple(self._edit(e) for e in batch.edits)
        started = {id(e.request): e for e, done in zip(batch.edits, edits, strict=True) if done}
        failed = {id(e.request) for e, done in zip(batch.edits, edits, strict=True) if not done}
        fed, done = [], []  # per row its block; the rows whose prompt is done once it is fed
        for i, row in enumerate(batch.rows):
            r, e = row.request, started.get(id(row.request))
            if id(r) in failed:
                fed.append(())
                continue
            if not row.prefill:
                fed.append((r.output[-1],))
                done.append(i)
                continue
            pending = r.pending if e is None else e.prompt[r.session.cached :]
            fed.append(tuple(pending[: row.count]))
            if len(fed[-1]) == len(pending):
                done.append(i)
        step = [i for i, block in enumerate(fed) if block]
        if not step:
            return Ran(edits, tuple(fed), ())
        turns = [batch.rows[i].request for i in step]
        logits = self.pool.extend([r.session.seq for r in turns], [list(fed[i]) for i in step])
        texts = [started[id(r)].prompt if id(r) in started else r.session.tokens for r in turns]
        return Ran(edits, tuple(fed), self._draw(logits, turns, step, set(done), texts))

    def _edit(self, e: Edit) -> EditDone | None:
        """Apply an admitted turn's splices, then its MOVE (`planner.move_plan`; one the pool
        cannot hold now is skipped: those tokens are prefilled instead). None: the pool could
        not hold the splices (the accounting is an upper bound: not expected)."""
        s = e.request.session
        try:
            applied = self.pool.apply(s.seq, e.splices) if e.splices else None
        except ll.OutOfPagesError:
            return None
        kept = s.cached
        if not e.move:
            return EditDone(kept, applied)
        d = planner.move_plan(
            e.prompt, kept, self.pool.page_size, lambda key: self.caches.locate(key, s)
        )
        if d is None:
            return EditDone(kept, applied)
        try:
            moved = self.pool.apply(s.seq, [d]).moved
        except ll.OutOfPagesError:
            return EditDone(kept, applied, d, skipped=True)
        return EditDone(s.cached, applied, d, moved)

    def _draw(self, logits, turns, step: list[int], rows: set[int], texts) -> tuple[Sample, ...]:
        """A token for turns[j] (the batch's row step[j]) where that row is in `rows`
        (`serve.sampling.tokens`), with log-probabilities where its turn asks. `logits`: one
        row per step row and padding ([row bucket, vocab])."""
        done = [j for j, i in enumerate(step) if i in rows]
        if not done:
            return ()
        toks = draw.tokens(logits, turns, set(done), texts)
        asked = any(turns[j].sampling.logprobs is not None for j in done)
        with jax.transfer_guard_device_to_host("allow"):  # the reads a step makes
            lps = [np.asarray(a) for a in draw.token_logprobs(logits, toks)] if asked else None
            toks = np.asarray(toks)
        out = []
        for j in done:
            lp, k = None, turns[j].sampling.logprobs
            if k is not None:
                top = zip(lps[1][j, :k].tolist(), lps[2][j, :k].tolist(), strict=True)
                lp = (float(lps[0][j]), tuple(top))
            out.append(Sample(step[j], int(toks[j]), lp))
        return tuple(out)

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
