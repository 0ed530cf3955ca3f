"""The serving engine: sessions, continuous batching, the radix prefix cache, directives in flight.

The imperative shell around the functional core. All device work goes through the core's
jitted, shape-bucketed steps (`paged.extend`: one ragged step for prefill chunks and decode
tokens together; the directive steps; `sample`); everything here is host bookkeeping in plain
Python, and the sampled tokens are the only thing a step reads back from the device.

The engine is split by job: this module holds the API, sessions and the loop (admission
order, the step runner); `serve.budget` the page arithmetic of admission, `serve.lineage` what
may be shared through the radix cache, `serve.sampling` the sampling parameters and the draw.

One iteration (`Engine.step`):
  1. admit queued turns, oldest first, while the pool can hold them (see "Pages" below); a turn
     carrying directives has them applied now: between iterations, never inside a step of
     that session, while every other session keeps its place;
  2. one ragged step over every running turn: the next prompt chunk of each turn still
     prefilling and the last generated token of each generating turn (chunked prefill riding
     with decode); a turn whose prompt is done, and each generating turn, samples a token;
     turns that hit a stop token or their token budget finish.

Sessions. A session is a conversation: its token list (prompt and generated tokens of every
turn so far) and, while it holds one, a sequence slot whose KV caches a prefix of that list.
A turn appends tokens (and may carry directives, in the session's current coordinates) and
generates. An edit is applied to the tokens the KV holds; the previous turn's last output, known
but not yet cached, is fed with the turn's new tokens if the edit keeps it and never if it
deletes it; a FORGET cuts the KV and its re-prefill runs through the ragged step. Idle
sessions keep their KV until the pool needs it; an offloaded session keeps its token list and
gets its prefix back from the radix cache (or a prefill) on its next turn.

Lineage (`serve.lineage`). KV that AMORTIZE spliced stays with the session that made it: only
the prefix a fresh prefill would reproduce (`clean`) enters the radix cache, and a FORGET purges
the session's radix path from the first evicted token on.

Pages. A turn is admitted only when the free pages, less what running turns may still take
(their remaining prompt and token budget), cover the most it can take. To find room the engine
evicts radix leaves nobody else uses (least recently used first), then offloads idle sessions
(least recently used first); failing that the turn waits for running turns to finish. A turn
that could not fit even in an otherwise empty pool fails alone, with an error saying why.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import leyline_jax as ll
from leyline_jax import directives as dv
from leyline_jax import kv_state as kv
from leyline_jax import paged
from leyline_jax.config import check_ids, check_tokens
from leyline_jax.directives import Mode
from leyline_jax.sharding import MeshConfig, shard_model
from serve import budget, lineage
from serve.budget import KVPlan, TurnPlan
from serve.edits import compose
from serve.radix import RadixCache
from serve.sampling import SamplingParams, is_int, sample

__all__ = [
    "Engine",
    "Request",
    "RequestError",
    "SamplingParams",
    "Session",
    "TurnCancelled",
    "TurnStats",
    "sample",
]


class RequestError(RuntimeError):
    """A turn that cannot be served (it never fits the pool or the sequence bound)."""


class TurnCancelled(RuntimeError):
    """A turn ended by `Engine.cancel` before it finished."""


@dataclasses.dataclass
class TurnStats:
    prompt_tokens: int = 0  # the turn's whole prompt: the session's tokens after its edits
    reused_tokens: int = 0  # ... whose KV was already cached and kept as is
    spliced_tokens: int = 0  # ... whose KV AMORTIZE moved and rotated
    prefilled_tokens: int = 0  # ... run through the model in this turn
    submitted_s: float = 0.0  # perf_counter() times, and the two spans measured from them
    first_token_s: float | None = None
    finished_s: float | None = None
    ttft_s: float | None = None  # submission to first token
    latency_s: float | None = None  # submission to finish (or failure)

    def first_token(self, now: float) -> None:
        self.first_token_s, self.ttft_s = now, now - self.submitted_s

    def finished(self, now: float) -> None:
        self.finished_s, self.latency_s = now, now - self.submitted_s


class Request:
    """One turn of a session: new tokens (and directives) in, generated tokens out."""

    def __init__(self, engine, session, tokens, directives, sampling):
        self.engine, self.session = engine, session
        self.new_tokens = [int(t) for t in tokens]
        self.directives = list(directives)
        self.sampling = sampling
        self.status = "queued"  # queued -> prefill -> decode -> done | failed
        self.output: list[int] = []
        self.error: Exception | None = None
        self.stats = TurnStats(submitted_s=time.perf_counter())
        self.pending: list[int] = []  # prompt tokens not yet in the KV
        self.fed = 0  # generated tokens whose KV is cached
        self.prompt: list[int] | None = None  # a whole prompt (submit_prompt), diffed at admission
        self.mode = Mode.AMORTIZE

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed")

    def result(self) -> list[int]:
        """Run the engine until this turn finishes; its generated tokens (raises its error)."""
        while not self.finished:
            self.engine.step()
        if self.error is not None:
            raise self.error
        return list(self.output)

    def stream(self) -> Iterator[int]:
        """Yield generated tokens as the engine produces them (drives the engine)."""
        sent = 0
        while True:
            while sent < len(self.output):
                yield self.output[sent]
                sent += 1
            if self.finished:
                if self.error is not None:
                    raise self.error
                return
            self.engine.step()


@dataclasses.dataclass(eq=False)
class Session:
    id: int
    tokens: list[int] = dataclasses.field(default_factory=list)  # the conversation so far
    seq: int | None = None  # sequence slot, while the session holds KV
    cached: int = 0  # tokens[:cached] are in the KV
    clean: int = 0  # tokens[:clean] have the KV a fresh prefill would give
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    active: Request | None = None
    last_used: float = 0.0


class Engine:
    def __init__(
        self,
        model: ll.MLAModel,
        *,
        num_pages: int = 256,
        page_size: int = 16,
        max_seqs: int = 16,
        max_seq_len: int | None = None,
        kv_dtype=jnp.bfloat16,
        k_pe_dtype=None,
        prefill_chunk: int = 256,
        radix: bool = True,
        mesh: MeshConfig | None = None,
    ):
        if not 1 <= prefill_chunk <= paged.PREFILL_CHUNK:
            raise ValueError(f"prefill_chunk must be in [1, {paged.PREFILL_CHUNK}]")
        if mesh is not None and not isinstance(mesh, MeshConfig):
            raise TypeError(f"mesh must be a leyline_jax.sharding.MeshConfig, got {mesh!r}")
        self.mesh = mesh
        self.model = model if mesh is None else shard_model(model, mesh)
        model = self.model
        self.graph = nnx.split(model)
        self.state = ll.init_state(
            model.config,
            num_pages=num_pages,
            page_size=page_size,
            max_seqs=max_seqs,
            max_seq_len=max_seq_len,
            kv_dtype=kv_dtype,
            k_pe_dtype=k_pe_dtype,
            mesh=mesh,
        )
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.radix = RadixCache(page_size) if radix else None
        self.sessions: dict[int, Session] = {}
        self._ids = itertools.count()
        self._order = itertools.count()  # submission order of queued turns
        self._queued: list[tuple[int, Request]] = []
        self.counters = collections.Counter()  # tokens prefilled / reused / spliced, evictions

    # ---- sessions ---------------------------------------------------------------------------
    def open_session(self) -> int:
        sid = next(self._ids)
        self.sessions[sid] = Session(sid, last_used=time.perf_counter())
        return sid

    def restore_session(
        self,
        session: int,
        tokens: Sequence[int],
        *,
        pages: Sequence[int] = (),
        cached: int = 0,
        clean: int = 0,
    ) -> None:
        """Recreate session `session` as a snapshot saved it (`serve.snapshot.restore`): its
        token list and, with `pages`, a free sequence slot holding tokens[:cached] in those
        pages (whose KV the caller already wrote, e.g. `paged.load_pages`; the last may be
        partly filled; the sequence takes one reference to each). tokens[:clean] is clean (a
        fresh prefill's KV) and enters the radix cache as a finished turn's does; KV past it
        (AMORTIZE-spliced) serves this session only. The session is idle and most recently
        used; later `open_session` ids are above `session`. Raises ValueError, before anything
        changes, for an id in use, lengths that disagree (0 <= clean <= cached <= len(tokens),
        pages covering tokens[:cached] exactly, nothing cached without pages), or no free
        sequence slot."""
        if not is_int(session) or session < 0:
            raise ValueError(f"session id {session!r} must be a non-negative integer")
        if session in self.sessions:
            raise ValueError(f"session {session} is already open")
        toks = check_tokens(tokens, self.model.config.vocab_size, allow_empty=True).tolist()
        if not all(is_int(v) for v in (cached, clean)) or not 0 <= clean <= cached <= len(toks):
            raise ValueError(f"need 0 <= clean ({clean}) <= cached ({cached}) <= {len(toks)}")
        pages = list(pages)
        if len(pages) != -(-cached // self.page_size):
            raise ValueError(f"{len(pages)} pages for {cached} cached tokens of {self.page_size}")
        s = Session(int(session), toks, last_used=time.perf_counter())
        if cached:
            free = self._free_slots()
            if not free:
                raise ValueError(f"no free sequence slot for session {session}")
            self.state = paged.adopt(self.state, free[0], pages, toks[:cached], partial=True)
            s.seq, s.cached, s.clean = free[0], cached, clean
            self._cache_prefix(s)
        self.sessions[s.id] = s
        self._ids = itertools.count(max(next(self._ids), s.id + 1))

    def restore_prefix(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Offer the radix cache `tokens` (len(pages) whole pages) whose KV, as a fresh prefill
        of them gives it, is held in `pages` (pages in use: a snapshot's prefix cache, loaded
        by `serve.snapshot.restore`); the cache takes one reference to each page it newly
        holds (none for a prefix it already has). Returns how many. Without a radix cache:
        0. Raises ValueError for tokens that do not fill the pages or pages not in use."""
        if self.radix is None:
            return 0
        toks = check_tokens(tokens, self.model.config.vocab_size, allow_empty=True).tolist()
        p = check_ids(pages, self.state.num_pages, "page id", allow_empty=True).tolist()
        if len(toks) != len(p) * self.page_size:
            raise ValueError(f"{len(toks)} tokens do not fill {len(p)} pages")
        if (self.state.refcount[p] == 0).any():
            raise ValueError("prefix pages must be pages in use")
        taken = self.radix.insert(toks, p)
        if taken:
            self.state = paged.retain(self.state, taken)
        return len(taken)

    def submit(
        self,
        session: int,
        tokens: Sequence[int],
        *,
        directives: Sequence[ll.Directive] = (),
        sampling: SamplingParams | None = None,
    ) -> Request:
        """Queue a turn: apply `directives` (an atomic batch in the session's coordinates when
        the turn runs, each in its own mode), append `tokens`, generate. Checked now: the
        session (KeyError), token ids and sampling (ValueError), that each directive is a
        `Directive` (DirectiveError). Checked when the turn runs, failing that turn only: the
        directives' spans against the session as it is then."""
        s, sampling = self._check_turn(session, sampling)
        toks = check_tokens(tokens, self.model.config.vocab_size, allow_empty=True).tolist()
        if not toks and not s.tokens and not s.queue and s.active is None:
            raise ValueError("the first turn of a session needs at least one token")
        try:
            ds = list(directives)
        except TypeError as e:
            raise dv.DirectiveError(f"directives must be a sequence of Directive: {e}") from e
        for d in ds:
            if not isinstance(d, ll.Directive):
                raise dv.DirectiveError(f"{d!r} is not a Directive")
        return self._queue(Request(self, s, toks, ds, sampling))

    def submit_prompt(
        self,
        session: int,
        prompt: Sequence[int],
        *,
        mode: Mode = Mode.AMORTIZE,
        sampling: SamplingParams | None = None,
        directives: Sequence[ll.Directive] = (),
    ) -> Request:
        """Queue a turn given as the whole prompt (what an unmodified harness sends): when it
        runs, the difference from the session's tokens becomes directives in `mode` plus the
        appended tail (`serve.edits.edits_and_feed`). `directives` (an aware client's explicit
        edits) are in the prompt's own coordinates: the turn's prompt is the prompt with them
        applied, and when the prompt extends the session each is spliced exactly as given, in
        its own mode (`serve.edits.compose`). Checked now like `submit`; `mode` must be a
        `Mode` (ValueError); the directives against the prompt (DirectiveError)."""
        s, sampling = self._check_turn(session, sampling)
        vocab = self.model.config.vocab_size
        toks = check_tokens(prompt, vocab).tolist()
        if not isinstance(mode, Mode):
            raise ValueError(f"mode={mode!r} must be Mode.AMORTIZE or Mode.FORGET")
        try:
            ds = dv.validate(list(directives), len(toks), vocab)
        except TypeError as e:
            raise dv.DirectiveError(f"directives must be a sequence of Directive: {e}") from e
        if not dv.apply_to_list(toks, ds):
            raise dv.DirectiveError("the directives leave the prompt empty")
        req = Request(self, s, [], ds, sampling)
        req.prompt, req.mode = toks, mode
        return self._queue(req)

    def _check_turn(self, session, sampling) -> tuple[Session, SamplingParams]:
        s = self._session(session)
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        vocab = self.model.config.vocab_size
        bad = [t for t in sampling.stop_tokens if t >= vocab]
        if bad:
            raise ValueError(f"stop token {bad[0]} is outside the vocabulary [0, {vocab})")
        return s, sampling

    def _queue(self, req: Request) -> Request:
        req.session.queue.append(req)
        self._queued.append((next(self._order), req))
        return req

    def close_session(self, session: int) -> None:
        """Close a session after its turns finish; its clean prefix stays in the radix cache."""
        s = self._session(session)
        if s.active is not None or s.queue:
            raise ValueError(f"session {session} still has turns in flight")
        self._offload(s)
        del self.sessions[session]

    def cancel(self, request: Request) -> bool:
        """End a queued or running turn where it stands (between steps), failing it with
        `TurnCancelled`; returns whether it was still live. Its session keeps what the turn did
        so far, consistently (a turn cut mid-prefill keeps its whole prompt as the session's
        tokens with `tokens[:cached]` in the KV: the next turn's edit and feed plan starts from
        there) and the radix cache gets its clean prefix, as when a turn finishes. What
        a server calls when its client goes away."""
        if not isinstance(request, Request) or request.engine is not self:
            raise ValueError("request must be a Request of this engine")
        if request.finished:
            return False
        s = request.session
        if request.status == "queued":
            self._queued = [(o, r) for o, r in self._queued if r is not request]
            if request in s.queue:
                s.queue.remove(request)
        else:
            s.active = None
            self._cache_prefix(s)
        request.status, request.error = "failed", TurnCancelled("the turn was cancelled")
        request.stats.finished(time.perf_counter())
        self.counters["cancelled_turns"] += 1
        return True

    def reset_prefix_cache(self) -> int:
        """Empty the radix prefix cache (like vLLM's `reset_prefix_cache`): the tree drops
        every reference it holds, and pages no session holds return to the pool. Sessions keep
        their own KV (close them to drop it); their clean prefixes enter the cache again as
        they run. Returns how many pages came back to the pool."""
        if self.radix is None:
            return 0
        before = len(kv.free_pages(self.state))
        pages = self.radix.clear()
        if pages:
            self.state = paged.release(self.state, pages)
        return len(kv.free_pages(self.state)) - before

    def warmup(self) -> int:
        """Compile every shape this engine's steps can take: the ragged step and sampling (row
        buckets up to `max_seqs`, token buckets up to `prefill_chunk` tokens a row) and the
        directive steps (splice moves up to `max_seq_len` slots, zeroing up to a sequence's
        pages), each run once on padding that changes nothing, so serving compiles nothing
        (an edit or purge larger than one sequence's pages compiles its bucket on first use).
        Returns how many shapes ran. With the persistent compilation cache on
        (`serve.compile_cache`), a later process loads them instead."""
        self.state, shapes = paged.precompile(
            self.model, self.state, self.state.max_seqs, self.prefill_chunk, graph=self.graph
        )
        self.state, runs = dv.precompile(self.model, self.state)
        shapes += runs
        vocab = self.model.config.vocab_size
        for b in (1 << i for i in range(paged.bucket(self.state.max_seqs).bit_length())):
            f32, seed = jnp.zeros(b, jnp.float32), jnp.zeros(b, jnp.uint32)
            logits = jnp.zeros((b, vocab), jnp.float32)
            jax.block_until_ready(sample(logits, f32, f32 + 1, seed, jnp.zeros(b, jnp.int32)))
            shapes += 1
        return shapes

    def _session(self, session: int) -> Session:
        s = self.sessions.get(session) if is_int(session) else None
        if s is None:
            raise KeyError(f"unknown or closed session {session}")
        return s

    # ---- the loop ---------------------------------------------------------------------------
    def idle(self) -> bool:
        return not self._queued and not any(s.active for s in self.sessions.values())

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.idle():
                return
            self.step()
        raise RuntimeError("the engine did not go idle")

    def step(self) -> None:
        """One iteration: admissions (and their directives), then one ragged step of every
        running turn's prefill chunk or decode token, then sampling."""
        self._admit()
        self._run_batch()

    # ---- admission ----------------------------------------------------------------------------
    def _running(self) -> list[Request]:
        return [s.active for s in self.sessions.values() if s.active is not None]

    def _still_needs(self, req: Request) -> int:
        """Pages a running turn may still take: its remaining prompt and token budget."""
        left = req.sampling.max_new_tokens - req.fed
        return budget.still_needs(self.state, req.session.seq, len(req.pending), left)

    def _available(self) -> int:
        free = len(kv.free_pages(self.state))
        return free - sum(self._still_needs(r) for r in self._running())

    def _admit(self) -> None:
        self._queued.sort(key=lambda x: x[0])
        for order, req in list(self._queued):
            s = req.session
            if s.active is not None or s.queue[0] is not req:
                continue  # a session runs its turns one at a time, in order
            outcome = self._try_admit(req)
            if outcome == "wait":
                break  # first come, first served: later turns wait behind this one
            self._queued.remove((order, req))
            s.queue.popleft()

    def _plan(self, req: Request) -> TurnPlan:
        """Validate the turn against its session now. Explicit directives are taken as given,
        each in its own mode; a whole prompt (`submit_prompt`) becomes directives + new tokens
        here, against the session's tokens as they are now. Raises DirectiveError (a
        ValueError) for what the session refuses (`budget.kv_plan` then decides what of the
        cached KV the turn keeps and what it feeds)."""
        s, vocab = req.session, self.model.config.vocab_size
        if req.prompt is not None:
            ds, new = compose(s.tokens, req.prompt, req.directives, mode=req.mode)
        else:
            ds, new = req.directives, req.new_tokens
        ds = dv.validate(ds, len(s.tokens), vocab)
        edited = dv.apply_to_list(s.tokens, ds)
        if not new and not edited:
            raise dv.DirectiveError("the turn would leave the session empty: it adds no token")
        return TurnPlan(ds, edited + list(new))

    def _cut(self, s: Session, ds, cut: int) -> None:
        """Truncate a session's KV to tokens[:cut] (KV before the cut is kept exactly), after
        a FORGET batch's radix purge."""
        self._purge(s, ds)
        trunc = ll.Directive(cut, s.cached, (), Mode.FORGET)
        self.state = ll.apply_directives(self.model, self.state, s.seq, [trunc])
        s.cached, s.clean = cut, min(s.clean, cut)

    def _try_admit(self, req: Request) -> str:
        s = req.session
        try:
            plan = self._plan(req)
        except ValueError as e:  # DirectiveError included
            return self._fail(req, e)
        final = len(plan.prompt) + req.sampling.max_new_tokens
        if final > self.state.max_seq_len:
            return self._fail(
                req,
                RequestError(
                    f"the turn would make session {s.id} {final} tokens long (prompt and "
                    f"max_new_tokens), more than max_seq_len={self.state.max_seq_len}"
                ),
            )
        kvp = None if s.seq is None else budget.kv_plan(s.cached, plan)
        if kvp is not None and kvp.kept == 0:
            # nothing of the cached KV survives the edit: the session's KV starts again
            self._offload(s)
            self._purge(s, plan.directives)
            kvp = None
        need, held = budget.need(self.page_size, plan, req.sampling.max_new_tokens, kvp)
        if need > self.state.num_pages - held:
            return self._fail(
                req,
                RequestError(
                    f"the turn needs up to {need} pages of {self.page_size} tokens beside the "
                    f"{held} its session holds meanwhile; the pool has {self.state.num_pages}"
                ),
            )
        if kvp is not None and kvp.cut < s.cached:
            # cut first: the pages past the cut come back before the turn takes any (the turn
            # will cut there whenever it runs; a turn that then waits leaves its session cut)
            self._cut(s, plan.directives, kvp.cut)
        if not self._make_room(need, s):
            return "wait"
        fresh = s.seq is None
        if fresh and not self._take_slot(s):
            return "wait"
        try:
            self._start(req, plan, kvp)
        except ll.OutOfPagesError:  # the accounting above is an upper bound: not expected
            s.active, req.status = None, "queued"
            return "wait"
        return "admitted"

    def _make_room(self, need: int, for_session: Session) -> bool:
        """Evict radix leaves, then offload idle sessions, until `need` pages are available."""
        while self._available() < need:
            if self.radix is not None:
                pages = self.radix.evict(need - self._available(), self.state.refcount)
                if pages:
                    self.state = paged.release(self.state, pages)
                    self.counters["radix_evicted_pages"] += len(pages)
                    continue
            victim = self._idle_victim(exclude=for_session)
            if victim is None:
                return False
            self._offload(victim)
        return True

    def _idle_victim(self, exclude: Session) -> Session | None:
        idle = [
            s
            for s in self.sessions.values()
            if s is not exclude and s.seq is not None and s.active is None
        ]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def _free_slots(self) -> list[int]:
        """Sequence slots no session holds, lowest first."""
        used = {x.seq for x in self.sessions.values() if x.seq is not None}
        return [q for q in range(self.state.max_seqs) if q not in used]

    def _take_slot(self, s: Session) -> bool:
        free = self._free_slots()
        if not free:
            victim = self._idle_victim(exclude=s)
            if victim is None:
                return False
            free = [self._offload(victim)]
        s.seq = free[0]
        self.state = paged.adopt(self.state, s.seq, [], [])  # open, empty
        return True

    def _offload(self, s: Session) -> int | None:
        """Give up a session's KV (its clean prefix stays in the radix cache); returns the
        sequence slot it held."""
        seq = s.seq
        if seq is None:
            return None
        self._cache_prefix(s)
        self.state = paged.free(self.state, seq)
        s.seq, s.cached, s.clean = None, 0, 0
        self.counters["offloads"] += 1
        return seq

    def _cache_prefix(self, s: Session) -> None:
        if s.seq is not None:
            self.state = lineage.cache_prefix(
                self.radix, self.state, s.seq, s.tokens, min(s.clean, s.cached)
            )

    def _fail(self, req: Request, error: Exception) -> str:
        req.status, req.error = "failed", error
        req.stats.finished(time.perf_counter())
        self.counters["failed_turns"] += 1
        return "failed"

    def _purge(self, s: Session, ds) -> None:
        self.state = lineage.purge(self.radix, self.state, s.tokens, ds)

    def _start(self, req: Request, plan: TurnPlan, kvp: KVPlan | None) -> None:
        """Apply the turn's edit to the session's KV and set up its prompt (the turn is
        admitted). `kvp` None: the session has just been given an empty sequence slot."""
        s, st, prompt = req.session, req.stats, plan.prompt
        self._purge(s, plan.directives)
        st.prompt_tokens = len(prompt)
        st.reused_tokens = st.spliced_tokens = 0
        if kvp is None:  # the longest clean prefix from the radix cache
            pages, hit = [], 0
            if self.radix is not None:
                pages, hit = self.radix.match(prompt, max_tokens=len(prompt) - 1)
            if hit:  # the slot is open and empty: reopen it holding the cached pages
                self.state = paged.free(self.state, s.seq)
                self.state = paged.adopt(self.state, s.seq, pages, prompt[:hit])
            s.cached = s.clean = st.reused_tokens = hit
        else:  # the KV holds tokens[:cut] (`_try_admit` cut it): splice what precedes the cut
            st.reused_tokens = kvp.cut
            if kvp.splices:
                self.state, done = ll.apply_directives(
                    self.model, self.state, s.seq, kvp.splices, report=True
                )
                st.reused_tokens, st.spliced_tokens = done.reused, done.spliced
            s.clean = lineage.clean_after_edit(s.clean, kvp)
            s.cached = kvp.kept
        s.tokens = list(prompt)
        req.pending = prompt[s.cached :]
        st.prefilled_tokens = len(prompt) - st.reused_tokens - st.spliced_tokens
        if not req.pending or st.prefilled_tokens < len(req.pending):
            raise RuntimeError(  # internal: the session's tokens no longer describe its cache
                f"session {s.id}: {st.reused_tokens} reused + {st.spliced_tokens} spliced of a "
                f"{len(prompt)}-token prompt with {s.cached} cached, {len(req.pending)} pending"
            )
        s.active, s.last_used = req, time.perf_counter()
        req.status = "prefill"
        self.counters["reused"] += st.reused_tokens
        self.counters["spliced"] += st.spliced_tokens

    # ---- device steps -------------------------------------------------------------------------
    def _run_batch(self) -> None:
        """One ragged step for every running turn: the next prompt chunk of each prefilling
        turn and the last token of each generating one, together (chunked prefill riding with
        decode). Turns whose prompt is done, and generating turns, sample a token."""
        rows = self._running()
        if not rows:
            return
        blocks = [
            r.pending[: self.prefill_chunk] if r.status == "prefill" else [r.output[-1]]
            for r in rows
        ]
        seqs = [r.session.seq for r in rows]
        self.state, logits = paged.extend(
            self.model, self.state, seqs, blocks, graph=self.graph, padded=True
        )
        emit = []
        for i, (r, b) in enumerate(zip(rows, blocks, strict=True)):
            s = r.session
            if r.status == "prefill":
                r.pending = r.pending[len(b) :]
                self.counters["prefilled"] += len(b)
            else:
                r.fed += 1
            if s.clean == s.cached:
                s.clean += len(b)
            s.cached += len(b)
            if r.status == "prefill":
                self._cache_prefix(s)  # full clean pages are shareable as soon as they exist
            if not r.pending:
                emit.append(i)
        if emit:
            self._emit(rows, emit, logits)

    def _emit(self, rows: list[Request], emit: list[int], logits) -> None:
        """Sample a token for rows[i], i in `emit`, and finish the turns that are done.
        `logits`: the step's, one row per step row and padding ([row bucket, vocab]); every row
        is sampled (padding and rows still prefilling are discarded), so sampling compiles one
        shape per row bucket, like the step."""
        pad = logits.shape[0] - len(rows)

        def col(values, dtype):
            return jnp.asarray(np.asarray(values + [values[0]] * pad, dtype))

        toks = sample(
            logits,
            col([r.sampling.temperature for r in rows], np.float32),
            col([r.sampling.top_p for r in rows], np.float32),
            col([r.sampling.seed for r in rows], np.uint32),
            col([len(r.output) for r in rows], np.int32),
        )
        with jax.transfer_guard_device_to_host("allow"):  # the one read a step makes
            toks = np.asarray(toks)
        now = time.perf_counter()
        for r, t in ((rows[i], int(toks[i])) for i in emit):
            s = r.session
            r.output.append(t)
            s.tokens.append(t)
            s.last_used = now
            if r.stats.first_token_s is None:
                r.stats.first_token(now)
            r.status = "decode"
            if t in r.sampling.stop_tokens or len(r.output) >= r.sampling.max_new_tokens:
                self._finish(r, now)

    def _finish(self, r: Request, now: float) -> None:
        r.status = "done"
        r.stats.finished(now)
        s = r.session
        s.active = None
        self._cache_prefix(s)
