"""The serving engine: sessions, continuous batching, the radix prefix cache, directives in flight.

The imperative shell around the functional core, split by job (read in this order):
- `config`: `EngineConfig`, the one owner of the engine's settings and their defaults;
- `types`: a turn (`Request`), a `Session`, their statuses, the errors a turn fails with;
- `intake`: what `submit` checks before a turn is queued;
- `planner`: pure host planning (a turn's edit of its session's tokens and KV, MOVE's sources);
- `pool`: the one owner of the paged KV state; `caches`: the radix prefix cache and the
  lineage rule; `sessions`: sessions, their sequence slots, pins and the queue of turns (the
  one writer of every session fact);
- `batch`: what a step passes between its parts, as values;
- `scheduler`: admission, making room, and the step's `Batch`; `runner`: the batch's device
  work (the admitted turns' edits, the ragged step, the draw) and what it did (`Ran`);
  `postprocess`: what the step did, recorded (turns' progress and ends, the radix cache,
  SCRATCH); `warmup`: compiling every shape the steps take, one at a time, with progress.

`Engine` only sequences them: `step()` is `schedule() -> Batch`, `execute(Batch) -> Ran`,
`postprocess(Batch, Ran)`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import leyline_jax as ll
from leyline_jax.config import check_ids, check_tokens
from leyline_jax.directives import Mode
from serve.engine import intake
from serve.engine.caches import PrefixCaches
from serve.engine.config import EngineConfig
from serve.engine.pool import Pool
from serve.engine.postprocess import Postprocess
from serve.engine.runner import Runner
from serve.engine.scheduler import Scheduler
from serve.engine.sessions import SessionTable
from serve.engine.types import (
    Request,
    RequestError,
    Session,
    Status,
    TurnCancelled,
    TurnStats,
    lockstep,
)
from serve.engine.warmup import Warmup
from serve.sampling import SamplingParams

# the engine's public surface: the front, its settings and what a turn is made of and returns
__all__ = [
    "Engine",
    "EngineConfig",
    "Request",
    "RequestError",
    "SamplingParams",
    "Session",
    "Status",
    "TurnCancelled",
    "TurnStats",
]


class Engine:
    """`Engine(model, config=None, *, mesh=None, **settings)`: `settings` are `EngineConfig`
    fields (`num_pages=`, `page_size=`, ...) overriding `config` (default: `EngineConfig()`).
    `mesh`: a `leyline_jax.MeshConfig` to shard the model and split the pools over."""

    def __init__(self, model, config: EngineConfig | None = None, *, mesh=None, **settings):
        self.config = dataclasses.replace(config or EngineConfig(), **settings)
        self.counters = collections.Counter()  # tokens prefilled / reused / spliced, evictions
        self.pool = Pool(model, self.config, mesh)
        self.caches = PrefixCaches(self.pool, self.config.radix)
        self.table = SessionTable(self.pool, self.caches, self.counters)
        self.scheduler = Scheduler(self.table, self.pool, self.caches, self.config, self.counters)
        self.runner = Runner(self.pool, self.caches)
        self.postprocess = Postprocess(self.pool, self.table, self.caches, self.counters)

    # the parts' state, as callers and tests read it
    model = property(lambda self: self.pool.model)
    page_size = property(lambda self: self.config.page_size)
    sessions = property(lambda self: self.table.sessions)
    radix = property(lambda self: self.caches.radix)

    @property
    def on_forget(self):
        """Called on the engine's thread with each FORGET's record (`serve.forgotten.record`)
        before the FORGET changes anything; an exception it raises fails that turn alone. A
        server with a snapshot directory logs them there (`serve.forgotten.Log`)."""
        return self.caches.on_forget

    @on_forget.setter
    def on_forget(self, fn) -> None:
        self.caches.on_forget = fn

    @property
    def state(self) -> ll.PagedKVState:
        return self.pool.state

    @state.setter
    def state(self, value: ll.PagedKVState) -> None:
        self.pool.state = value

    # ---- sessions ---------------------------------------------------------------------------
    @lockstep("replay")
    def open_session(self, *, lineage: str | None = None, salt: str = "") -> int:
        """A new session. `salt` (like vLLM's `cache_salt`; a tenant's) names the radix cache
        it shares: it finds only prefixes that sessions of the same salt cached, and its own
        go there alone. `lineage` (default: its own) names whose clean radix pages MOVE may
        copy into it: those that sessions of the same lineage (and salt) cached."""
        return self.table.open(lineage, salt)

    @lockstep("replay")
    def close_session(self, session: int) -> None:
        """Close a session after its turns finish; its clean prefix stays in the radix cache
        (and, after MOVE, its other KV in its lineage's private tree, unless the lineage was
        its own)."""
        self.table.close(session)

    @lockstep("replay")
    def pin(self, session: int, start: int, end: int) -> None:
        """Pin tokens [start, end) of a session (its coordinates now): no directive may cut
        into them unless it says `override_pin` (the pin is then dropped), policies leave the
        messages that hold them alone (`serve.policies`: the harness marks them), and the
        session's KV is never offloaded to make room while it holds a pin (a turn that could
        only fit by evicting pinned KV waits, or fails if it never could). Pins move with
        edits before them. Raises KeyError (session) or DirectiveError (span)."""
        self.table.pin(session, start, end)

    @lockstep("replay")
    def unpin(self, session: int, start: int, end: int) -> None:
        """Drop one pin of exactly [start, end) (as `pins(session)` lists it); ValueError if
        there is none. The session's KV returns to normal LRU offloading once it holds no pin."""
        self.table.unpin(session, start, end)

    @lockstep("own")
    def read_pages(self, ids):
        """Host copies of the pages `ids` (`Pool.read_pages`; a collective in a group)."""
        return self.pool.read_pages(ids)

    @lockstep("read")
    def pins(self, session: int) -> list[tuple[int, int]]:
        """The session's pinned spans, in its coordinates now."""
        return list(self.table.get(session).pins)

    @lockstep("replay")
    def pin_prefix(self, tokens: Sequence[int]) -> int:
        """Pin the radix cache's whole pages of the longest cached prefix of `tokens` (a system
        prompt, say): never evicted under pressure until `unpin_prefix`. Returns how many
        tokens are pinned (0 without a radix cache)."""
        return self._prefix_pins(tokens, +1)

    @lockstep("replay")
    def unpin_prefix(self, tokens: Sequence[int]) -> int:
        """Undo one `pin_prefix(tokens)`; returns how many tokens it unpinned."""
        return self._prefix_pins(tokens, -1)

    def _prefix_pins(self, tokens, delta: int) -> int:
        if self.radix is None:
            return 0
        toks = check_tokens(tokens, self.model.config.vocab_size, allow_empty=True).tolist()
        pages = self.radix.pin(toks) if delta > 0 else self.radix.unpin(toks)
        return len(pages) * self.page_size

    @lockstep("setup")
    def restore_session(
        self, session: int, tokens: Sequence[int], *, pages=(), cached: int = 0, clean: int = 0,
        pins=(), lineage: str | None = None, private: bool = False, foreign: bool = False,
        salt: str = "",
    ) -> None:  # fmt: skip
        """Recreate session `session` as a snapshot saved it (`serve.snapshot.restore`): its
        token list and, with `pages`, a free sequence slot holding tokens[:cached] in those
        pages (whose KV the caller already wrote, e.g. `Pool.load_pages`; the last may be
        partly filled; the sequence takes one reference to each). tokens[:clean] is clean (a
        fresh prefill's KV) and enters the radix cache as a finished turn's does; KV past it
        (AMORTIZE-spliced) serves this session only. The session is idle and most recently
        used; later `open_session` ids are above `session`. It comes back with its `pins`,
        `lineage` (None: its own), `salt` and MOVE flags (`private`: it ran MOVE; `foreign`: its KV
        holds KV moved from another session's pages). Raises ValueError, before anything
        changes, for an id in use, lengths that disagree (0 <= clean <= cached <= len(tokens),
        pages covering tokens[:cached] exactly, nothing cached without pages), pins outside
        the tokens, another session's own lineage, or no free sequence slot."""
        self.table.restore(
            session, tokens, pages, cached, clean, pins, lineage, private, foreign, salt
        )

    @lockstep("setup")
    def restore_prefix(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Offer the radix cache `tokens` (len(pages) whole pages) whose KV, as a fresh prefill
        of them gives it, is held in `pages` (pages in use: a snapshot's prefix cache); the
        cache takes one reference to each page it newly holds (none for a prefix it already
        has). Returns how many. Without a radix cache: 0. Raises ValueError for tokens that do
        not fill the pages or pages not in use."""
        if self.radix is None:
            return 0
        toks = check_tokens(tokens, self.model.config.vocab_size, allow_empty=True).tolist()
        p = check_ids(pages, self.state.num_pages, "page id", allow_empty=True).tolist()
        if len(toks) != len(p) * self.page_size:
            raise ValueError(f"{len(toks)} tokens do not fill {len(p)} pages")
        if (self.state.refcount[p] == 0).any():
            raise ValueError("prefix pages must be pages in use")
        return self.caches.restore_prefix(toks, p)

    @lockstep("replay")
    def reset_prefix_cache(self) -> int:
        """Empty the radix prefix cache (like vLLM's `reset_prefix_cache`): every salt's tree
        (and every lineage's private tree) drops every reference it holds, and pages no session
        holds return to the pool. Sessions keep their own KV (close them to drop it); their
        clean prefixes enter the cache again as they run. Returns how many pages came back."""
        before = self.pool.free_count()
        self.caches.clear()
        return self.pool.free_count() - before

    @lockstep("read")
    def cache_pages(self) -> list[int]:
        """Every page reference the prefix caches hold: the radix cache's and the lineages'
        private trees' (a page in both is listed twice: each holds a reference)."""
        return self.caches.pages()

    # ---- turns -------------------------------------------------------------------------------
    @lockstep("own")
    def submit(
        self, session: int, tokens: Sequence[int], *, directives=(), sampling=None,
        scratch=(), scratch_tags=None, move: bool | None = None, recompute=None,
    ) -> Request:  # fmt: skip
        """Queue a turn: apply `directives` (an atomic batch in the session's coordinates when
        the turn runs, each in its own mode; a DECAY is resolved then, from the session's KV,
        which must hold its span), append `tokens`, generate. Checked now (`intake`): the
        session (KeyError), token ids and sampling (ValueError), that each directive is a
        `Directive` (DirectiveError). Checked when the turn runs, failing that turn only: the
        directives' spans against the session as it is then, and its pins.

        SCRATCH: `scratch` spans (start, end) of the turn's prompt (the session's tokens after
        the edit, then `tokens`) and, with `scratch_tags=(open, close)` (token ids), every
        generated block from `open` through `close` are spliced out of the session (AMORTIZE
        deletions) when the turn finishes, so its next prompt, re-sent without them, is an
        extension of what the session holds. MOVE: `move` (default: the engine's) copies runs
        of at least a page of the tokens the turn would prefill from where the session, or
        the clean radix cache of its lineage, holds them (`planner.move_plan`). `recompute`
        (default: the engine's `EngineConfig.recompute`): the budget every AMORTIZE and MOVE
        splice of the turn that names none recomputes (`Directive.recompute`)."""
        vocab = self.model.config.vocab_size
        req = intake.turn(self, self.table.get(session), tokens, directives, sampling, vocab)
        intake.options(req, scratch, scratch_tags, move, None, vocab, recompute)
        return self.table.enqueue(req)

    @lockstep("own")
    def submit_prompt(
        self, session: int, prompt: Sequence[int], *, mode: Mode = Mode.AMORTIZE,
        sampling=None, directives=(), scratch=(), scratch_tags=None, move: bool | None = None,
        recompute=None,
    ) -> Request:  # fmt: skip
        """Queue a turn given as the whole prompt (what an unmodified harness sends): when it
        runs, the difference from the session's tokens becomes directives in `mode` plus the
        appended tail (`serve.edits.edits_and_feed`). `directives` (an aware client's explicit
        edits) are in the prompt's own coordinates: the turn's prompt is the prompt with them
        applied, and when the prompt extends the session each is spliced exactly as given, in
        its own mode (`serve.edits.compose`). Checked now like `submit`; `mode` must be a
        `Mode` (ValueError); the directives against the prompt (DirectiveError: DECAY, whose
        text depends on the session's KV, goes through `submit`). `scratch` spans are in the
        turn's prompt's coordinates (the prompt with `directives` applied); `scratch_tags`,
        `move` and `recompute` as in `submit`."""
        vocab, s = self.model.config.vocab_size, self.table.get(session)
        req, n = intake.prompt_turn(self, s, prompt, mode, directives, sampling, vocab)
        intake.options(req, scratch, scratch_tags, move, n, vocab, recompute)
        return self.table.enqueue(req)

    @lockstep("own")
    def cancel(self, request: Request, *, stop: bool = False) -> bool:
        """End a queued or running turn where it stands (between steps), failing it with
        `TurnCancelled`; returns whether it was still live. Its session keeps what the turn did
        so far, consistently (a turn cut mid-prefill keeps its whole prompt as the session's
        tokens with `tokens[:cached]` in the KV: the next turn's edit and feed plan starts from
        there) and the radix cache gets its clean prefix, as when a turn finishes. What a
        server calls when its client goes away. `stop=True`: the caller's own stop condition
        ended a running turn (a stop string found in its text): it finishes as a turn does,
        with its output so far, counted in `stopped_turns`."""
        if not isinstance(request, Request) or request.engine is not self:
            raise ValueError("request must be a Request of this engine")
        if request.finished:
            return False
        if stop and request.status is Status.DECODE:
            self.postprocess.finish(request, time.perf_counter())
            self.counters["stopped_turns"] += 1
            return True
        if request.status is Status.QUEUED:
            self.table.dequeue(request)
        else:
            self.table.end(request.session)
            self.caches.cache_prefix(request.session)
        request.fail(TurnCancelled("the turn was cancelled"))
        self.counters["cancelled_turns"] += 1
        return True

    # ---- the loop ----------------------------------------------------------------------------
    @lockstep("setup")
    def warmup(self) -> int:
        """Compile every shape this engine's steps can take (`warmup_plan`), logging progress;
        how many there are. After it serving compiles nothing."""
        return self.warmup_plan().run()

    @lockstep("setup")
    def warmup_plan(self) -> Warmup:
        """The shapes to compile, one at a time (`serve.engine.warmup.Warmup`): each step
        shape (token buckets up to `max_num_batched_tokens`, `leyline_jax.paged.step_shapes`)
        with the sampling of its rows, and each edit shape (splice moves in blocks up to
        `max_num_batched_tokens` runs, zeroing in blocks of pages: `leyline_jax.splice.shapes`),
        each run once on padding that changes nothing."""
        return Warmup(self.runner.warmup_plan())

    @lockstep("read")
    def idle(self) -> bool:
        """No turn runs or waits."""
        return self.scheduler.idle()

    @lockstep("own")
    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.idle():
                return
            self.step()
        raise RuntimeError("the engine did not go idle")

    @lockstep("own")
    def step(self) -> None:
        """One iteration: admissions (and their edits), then one ragged step of every running
        turn's prefill chunk or decode token, then the draw; then what happened, recorded."""
        batch = self.scheduler.schedule()
        self.postprocess.apply(batch, self.runner.execute(batch))
