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
from leyline_jax import allocator, paged, splice
from leyline_jax import directives as dv
from leyline_jax.config import check_ids, check_tokens
from leyline_jax.directives import Mode
from leyline_jax.sharding import MeshConfig, shard_model
from serve import budget, lineage, spans
from serve.budget import KVPlan, TurnPlan
from serve.edits import compose
from serve.lineage import OWN_LINEAGE
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


def _no_page_sources(ds) -> None:
    """A caller's MOVE takes its sources from the session's own tokens: sources in other pages
    (`Source.pages`) are the engine's to choose (within a lineage), never a caller's."""
    for d in ds:
        if any(x.pages for x in d.sources):
            raise dv.DirectiveError(
                f"directive [{d.start}, {d.end}): a MOVE source with pages= reads KV the "
                "session does not hold; a turn's MOVE sources are positions in its session"
            )


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
    moved_tokens: int = 0  # of spliced_tokens, those MOVE copied from another position
    scratch_tokens: int = 0  # SCRATCH tokens spliced out of the session when the turn ended
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
        self.scratch: list[tuple[int, int]] = []  # SCRATCH spans of the turn's prompt
        self.scratch_tags: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.move: bool | None = None  # MOVE for this turn (None: the engine's default)
        self.decays: list | None = None  # the directives with DECAY resolved, once

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
    pins: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # PIN spans
    lineage: str = ""  # radix pages it inserted may be MOVE sources for this lineage only
    private: bool = False  # it ran MOVE: its non-clean KV is cached for its lineage only
    # its KV holds KV moved from radix pages (another session's history): its non-clean KV
    # then stays its own (never cached for the lineage) until the KV starts again
    foreign: bool = False


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
        move: bool = False,
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
        self.move = bool(move)  # MOVE by default (a turn may say otherwise)
        self._page_lineage: dict[int, str] = {}  # radix page -> lineage of the session it came from
        # lineage -> the KV its MOVE sessions hold past their clean prefix (spliced or moved,
        # so never shared with another lineage): a later session of the lineage starts from it
        self._private: dict[str, RadixCache] = {}

    # ---- sessions ---------------------------------------------------------------------------
    def open_session(self, *, lineage: str | None = None) -> int:
        """A new session. `lineage` (default: its own) names whose clean radix pages MOVE may
        copy into it: those that sessions of the same lineage cached (like vLLM's
        `cache_salt`, it keeps one tenant's KV from being moved into another's prompt;
        exact-prefix hits are shared as before)."""
        if lineage is not None and not isinstance(lineage, str):
            raise ValueError(f"lineage must be a string, got {lineage!r}")
        if lineage is not None and lineage.startswith(OWN_LINEAGE):
            raise ValueError(
                f"lineage {lineage!r}: names starting with {OWN_LINEAGE!r} are the engine's "
                "(a session's own lineage)"
            )
        sid = next(self._ids)
        self.sessions[sid] = Session(
            sid,
            last_used=time.perf_counter(),
            lineage=f"{OWN_LINEAGE}{sid}" if lineage is None else lineage,
        )
        return sid

    # ---- PIN ----------------------------------------------------------------------------------
    def pin(self, session: int, start: int, end: int) -> None:
        """Pin tokens [start, end) of a session (its coordinates now): no directive may cut
        into them unless it says `override_pin` (the pin is then dropped), policies leave the
        messages that hold them alone (`serve.policies`: the harness marks them), and the
        session's KV is never offloaded to make room while it holds a pin (a turn that could
        only fit by evicting pinned KV waits, or fails if it never could). Pins move with
        edits before them. Raises KeyError (session) or DirectiveError (span)."""
        s = self._session(session)
        (span,) = spans.check_spans([(start, end)], len(s.tokens), "pinned span")
        s.pins = sorted([*s.pins, span])

    def unpin(self, session: int, start: int, end: int) -> None:
        """Drop one pin of exactly [start, end) (as `pins(session)` lists it); ValueError if
        there is none. The session's KV returns to normal LRU offloading once it holds no pin."""
        s = self._session(session)
        if (start, end) not in s.pins:
            raise ValueError(f"session {session} has no pin ({start}, {end}): {s.pins}")
        s.pins.remove((start, end))

    def pins(self, session: int) -> list[tuple[int, int]]:
        """The session's pinned spans, in its coordinates now."""
        return list(self._session(session).pins)

    def pin_prefix(self, tokens: Sequence[int]) -> int:
        """Pin the radix cache's whole pages of the longest cached prefix of `tokens` (a system
        prompt, say): never evicted under pressure until `unpin_prefix`. Returns how many
        tokens are pinned (0 without a radix cache)."""
        if self.radix is None:
            return 0
        toks = check_tokens(tokens, self.model.config.vocab_size, allow_empty=True).tolist()
        return len(self.radix.pin(toks)) * self.page_size

    def unpin_prefix(self, tokens: Sequence[int]) -> int:
        """Undo one `pin_prefix(tokens)`; returns how many tokens it unpinned."""
        if self.radix is None:
            return 0
        toks = check_tokens(tokens, self.model.config.vocab_size, allow_empty=True).tolist()
        return len(self.radix.unpin(toks)) * self.page_size

    def _pinned_pages(self, exclude: Session | None = None) -> set[int]:
        """Pages no eviction or offload may free: those of sessions holding pins (but
        `exclude`) and the radix cache's pinned pages."""
        out = set(self.radix.pinned_pages()) if self.radix is not None else set()
        for x in self.sessions.values():
            if x is not exclude and x.pins and x.seq is not None:
                out.update(int(p) for p in allocator.seq_pages(self.state, x.seq))
        return out

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
        if len(pages) != allocator.pages_for(cached, self.page_size):
            raise ValueError(f"{len(pages)} pages for {cached} cached tokens of {self.page_size}")
        s = Session(
            int(session), toks, last_used=time.perf_counter(), lineage=f"session:{int(session)}"
        )
        if cached:
            free = self._free_slots()
            if not free:
                raise ValueError(f"no free sequence slot for session {session}")
            self.state = allocator.adopt(self.state, free[0], pages, toks[:cached], partial=True)
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
            self.state = allocator.retain(self.state, taken)
        return len(taken)

    def submit(
        self,
        session: int,
        tokens: Sequence[int],
        *,
        directives: Sequence[ll.Directive] = (),
        sampling: SamplingParams | None = None,
        scratch: Sequence[tuple[int, int]] = (),
        scratch_tags: tuple[Sequence[int], Sequence[int]] | None = None,
        move: bool | None = None,
    ) -> Request:
        """Queue a turn: apply `directives` (an atomic batch in the session's coordinates when
        the turn runs, each in its own mode; a DECAY is resolved then, from the session's KV,
        which must hold its span), append `tokens`, generate. Checked now: the
        session (KeyError), token ids and sampling (ValueError), that each directive is a
        `Directive` (DirectiveError). Checked when the turn runs, failing that turn only: the
        directives' spans against the session as it is then, and its pins.

        SCRATCH: `scratch` spans (start, end) of the turn's prompt (the session's tokens after
        the edit, then `tokens`) and, with `scratch_tags=(open, close)` (token ids), every
        generated block from `open` through `close` are spliced out of the session (AMORTIZE
        deletions) when the turn finishes, so its next prompt, re-sent without them, is an
        extension of what the session holds. MOVE: `move` (default: the engine's) copies runs
        of at least a page of the tokens the turn would prefill from where the session, or
        the clean radix cache of its lineage, holds them (see `_move_plan`)."""
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
        _no_page_sources(ds)
        req = Request(self, s, toks, ds, sampling)
        self._turn_options(req, scratch, scratch_tags, move, None)
        return self._queue(req)

    def _turn_options(self, req: Request, scratch, scratch_tags, move, length) -> None:
        """Check and set a turn's SCRATCH and MOVE options (spans against `length`, the
        prompt's, when known now; else when the turn runs)."""
        vocab = self.model.config.vocab_size
        try:
            req.scratch = [tuple(x) for x in scratch]
        except TypeError as e:
            raise dv.DirectiveError(f"scratch must be (start, end) pairs: {e}") from e
        if length is not None:
            req.scratch = spans.check_spans(req.scratch, length, "scratch span")
        if scratch_tags is not None:
            try:
                o, c = scratch_tags
            except (TypeError, ValueError) as e:
                raise ValueError(f"scratch_tags must be (open ids, close ids): {e}") from e
            o, c = (tuple(check_tokens(x, vocab).tolist()) for x in (o, c))
            req.scratch_tags = (o, c)
        if move is not None and not isinstance(move, bool):
            raise ValueError(f"move must be a bool or None, got {move!r}")
        req.move = move

    def submit_prompt(
        self,
        session: int,
        prompt: Sequence[int],
        *,
        mode: Mode = Mode.AMORTIZE,
        sampling: SamplingParams | None = None,
        directives: Sequence[ll.Directive] = (),
        scratch: Sequence[tuple[int, int]] = (),
        scratch_tags: tuple[Sequence[int], Sequence[int]] | None = None,
        move: bool | None = None,
    ) -> Request:
        """Queue a turn given as the whole prompt (what an unmodified harness sends): when it
        runs, the difference from the session's tokens becomes directives in `mode` plus the
        appended tail (`serve.edits.edits_and_feed`). `directives` (an aware client's explicit
        edits) are in the prompt's own coordinates: the turn's prompt is the prompt with them
        applied, and when the prompt extends the session each is spliced exactly as given, in
        its own mode (`serve.edits.compose`). Checked now like `submit`; `mode` must be a
        `Mode` (ValueError); the directives against the prompt (DirectiveError: DECAY, whose
        text depends on the session's KV, goes through `submit`). `scratch` spans are in the
        turn's prompt's coordinates (the prompt with `directives` applied); `scratch_tags`
        and `move` as in `submit`."""
        s, sampling = self._check_turn(session, sampling)
        vocab = self.model.config.vocab_size
        toks = check_tokens(prompt, vocab).tolist()
        if mode not in (Mode.AMORTIZE, Mode.FORGET):
            raise ValueError(f"mode={mode!r} must be Mode.AMORTIZE or Mode.FORGET")
        try:
            ds = dv.validate(list(directives), len(toks), vocab)
        except TypeError as e:
            raise dv.DirectiveError(f"directives must be a sequence of Directive: {e}") from e
        if any(d.mode is Mode.DECAY for d in ds):
            raise dv.DirectiveError(
                "a DECAY's text depends on the session's KV: send it with submit (session "
                "coordinates), not inside a whole prompt"
            )
        _no_page_sources(ds)
        final = dv.apply_to_list(toks, ds)
        if not final:
            raise dv.DirectiveError("the directives leave the prompt empty")
        req = Request(self, s, [], ds, sampling)
        req.prompt, req.mode = toks, mode
        self._turn_options(req, scratch, scratch_tags, move, len(final))
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
        """Close a session after its turns finish; its clean prefix stays in the radix cache
        (and, after MOVE, its other KV in its lineage's private tree, unless the lineage was
        its own)."""
        s = self._session(session)
        if s.active is not None or s.queue:
            raise ValueError(f"session {session} still has turns in flight")
        self._offload(s)
        del self.sessions[session]
        tree = self._private.pop(s.lineage, None) if s.lineage.startswith(OWN_LINEAGE) else None
        if tree is not None:  # no later session can have its own lineage
            self.state = allocator.release(self.state, tree.clear())

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
        """Empty the radix prefix cache (like vLLM's `reset_prefix_cache`): the tree (and
        every lineage's private tree) drops every reference it holds, and pages no session
        holds return to the pool. Sessions keep their own KV (close them to drop it); their
        clean prefixes enter the cache again as they run. Returns how many pages came back to
        the pool."""
        if self.radix is None:
            return 0
        before = len(allocator.free_pages(self.state))
        pages = self.radix.clear()
        for tree in self._private.values():
            pages += tree.clear()
        if pages:
            self.state = allocator.release(self.state, pages)
        return len(allocator.free_pages(self.state)) - before

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
        self.state, runs = splice.precompile(self.model, self.state)
        shapes += runs
        vocab = self.model.config.vocab_size
        for b in (1 << i for i in range(paged.bucket(self.state.max_seqs).bit_length())):
            f32, seed = jnp.zeros(b, jnp.float32), jnp.zeros(b, jnp.uint32)
            logits = jnp.zeros((b, vocab), jnp.float32)
            jax.block_until_ready(sample(logits, f32, f32 + 1, seed, jnp.zeros(b, jnp.int32)))
            shapes += 1
        return shapes

    def cache_pages(self) -> list[int]:
        """Every page reference the prefix caches hold: the radix cache's and the lineages'
        private trees' (a page in both is listed twice: each holds a reference)."""
        out = [] if self.radix is None else self.radix.pages()
        for tree in self._private.values():
            out += tree.pages()
        return out

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
        return allocator.still_needs(self.state, req.session.seq, len(req.pending), left)

    def _available(self) -> int:
        free = len(allocator.free_pages(self.state))
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
            ds, new = compose(s.tokens, req.prompt, req.directives, mode=req.mode, protect=s.pins)
        else:
            ds, new = req.directives, req.new_tokens
        ds = dv.validate(ds, len(s.tokens), vocab, s.tokens)
        if any(d.mode is Mode.DECAY for d in ds):
            spans.check_pins(s.pins, ds)
            # resolved once, from the KV as the turn first finds it: a turn that waits may cut
            # or lose its session's KV meanwhile (its text is fixed by then)
            if req.decays is None:
                req.decays = self._resolve_decays(s, ds)
            ds = req.decays
        edited = dv.apply_to_list(s.tokens, ds)
        if not new and not edited:
            raise dv.DirectiveError("the turn would leave the session empty: it adds no token")
        prompt = edited + list(new)
        spans.check_pins(s.pins, self._pin_edits(s.tokens, ds, prompt))
        if req.prompt is None:
            req.scratch = spans.check_spans(req.scratch, len(prompt), "scratch span")
        return TurnPlan(ds, prompt)

    @staticmethod
    def _pin_edits(tokens: list[int], ds, prompt: list[int]) -> list[ll.Directive]:
        """The directives that edit the session's text, for its pins: all but a deletion of
        its end whose tokens the prompt feeds again at the same place (how a turn re-feeds a
        cached last token: `serve.edits.edits_and_feed`), which changes no token."""
        out, shift = [], 0
        for d in ds:
            at = d.start + shift
            refeed = (
                not d.replacement
                and d.end == len(tokens)
                and prompt[at : at + d.end - d.start] == tokens[d.start : d.end]
            )
            if not refeed:
                out.append(d)
            shift += d.delta
        return out

    def _resolve_decays(self, s: Session, ds: list[ll.Directive]) -> list[ll.Directive]:
        """DECAY directives resolved into MOVEs of the tokens they keep, chosen from the
        session's KV (`leyline_jax.importance`): it must hold every DECAY span."""
        short = [d for d in ds if d.mode is Mode.DECAY and (s.seq is None or d.end > s.cached)]
        if short:
            raise dv.DirectiveError(
                f"DECAY [{short[0].start}, {short[0].end}) needs the span's KV, but session "
                f"{s.id} holds {s.cached if s.seq is not None else 0} cached tokens"
            )
        out, _ = dv.resolve_decays(self.model, self.state, s.seq, ds)
        return dv.validate(out, len(s.tokens), self.model.config.vocab_size, s.tokens)

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
        if kvp is not None and kvp.splices:
            kvp = self._movable(kvp)
        if kvp is not None and kvp.kept == 0:
            # nothing of the cached KV survives the edit: the session's KV starts again
            self._offload(s)
            self._purge(s, plan.directives)
            kvp = None
        need, held = budget.need(self.page_size, plan, req.sampling.max_new_tokens, kvp)
        own = set() if s.seq is None else set(self.state.page_table[s.seq, :held].tolist())
        pinned = len(self._pinned_pages(exclude=s) - own)
        if need > self.state.num_pages - held - pinned:
            return self._fail(
                req,
                RequestError(
                    f"the turn needs up to {need} pages of {self.page_size} tokens beside the "
                    f"{held} its session holds meanwhile; the pool has {self.state.num_pages}"
                    + (f", {pinned} of them pinned" if pinned else "")
                ),
            )
        if kvp is not None and kvp.cut < s.cached:
            # cut first: the pages past the cut come back before the turn takes any (the turn
            # will cut there whenever it runs; a turn that then waits leaves its session cut)
            self._cut(s, plan.directives, kvp.cut)
        if not self._make_room(need, s):
            return self._wait_or_fail(req, f"{need} pages")
        fresh = s.seq is None
        if fresh and not self._take_slot(s):
            return self._wait_or_fail(req, "a sequence slot")
        try:
            self._start(req, plan, kvp)
        except ll.OutOfPagesError:  # the accounting above is an upper bound: not expected
            s.active, req.status = None, "queued"
            return "wait"
        return "admitted"

    def _wait_or_fail(self, req: Request, what: str) -> str:
        """A turn that found no room waits while other turns run (they will free theirs); with
        none running, only pins hold what it needs (everything else can be evicted or
        offloaded), so it fails rather than wait for an unpin."""
        if self._running():
            return "wait"
        pinned = [x.id for x in self.sessions.values() if x.pins and x.seq is not None]
        return self._fail(
            req,
            RequestError(
                f"the turn needs {what} that only pinned KV holds (sessions {pinned} hold pins; "
                f"{len(self._pinned_pages())} pages are pinned): unpin some to make room"
            ),
        )

    def _movable(self, kvp: KVPlan) -> KVPlan:
        """The plan with every spliced MOVE whose sources the KV does not hold through the cut
        made a plain AMORTIZE (the same text, its replacement prefilled)."""
        out = []
        for d in kvp.splices:
            if any(not x.pages and x.position + x.length > kvp.cut for x in d.sources):
                d = ll.Directive(d.start, d.end, d.replacement, override_pin=d.override_pin)
                self.counters["moves_prefilled"] += 1
            out.append(d)
        return dataclasses.replace(kvp, splices=out)

    def _make_room(self, need: int, for_session: Session) -> bool:
        """Evict radix leaves, then offload idle sessions, until `need` pages are available."""
        while self._available() < need:
            trees = [] if self.radix is None else [self.radix, *self._private.values()]
            held = collections.Counter(p for tree in trees for p in tree.pages())
            pages = []
            for tree in trees:
                # a page another tree also holds is evictable here when only the trees hold it
                refs = self.state.refcount.copy()
                for p, n in (held - collections.Counter(tree.pages())).items():
                    refs[p] -= n
                pages = tree.evict(need - self._available(), refs)
                if pages:
                    break
            if pages:
                self.state = allocator.release(self.state, pages)
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
            if s is not exclude and s.seq is not None and s.active is None and not s.pins
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
        self.state = allocator.adopt(self.state, s.seq, [], [])  # open, empty
        return True

    def _offload(self, s: Session) -> int | None:
        """Give up a session's KV (its clean prefix stays in the radix cache); returns the
        sequence slot it held."""
        seq = s.seq
        if seq is None:
            return None
        self._cache_prefix(s)
        self.state = allocator.free(self.state, seq)
        s.seq, s.cached, s.clean, s.foreign = None, 0, 0, False
        self.counters["offloads"] += 1
        return seq

    def _cache_prefix(self, s: Session) -> None:
        if s.seq is not None:
            self.state, taken = lineage.cache_prefix(
                self.radix, self.state, s.seq, s.tokens, min(s.clean, s.cached)
            )
            for p in taken:
                self._page_lineage[p] = s.lineage
            if (
                s.private
                and not s.foreign
                and self.radix is not None
                and s.cached // self.page_size
            ):
                tree = self._private.setdefault(s.lineage, RadixCache(self.page_size))
                self.state, _ = lineage.cache_prefix(tree, self.state, s.seq, s.tokens, s.cached)

    def _fail(self, req: Request, error: Exception) -> str:
        req.status, req.error = "failed", error
        req.stats.finished(time.perf_counter())
        self.counters["failed_turns"] += 1
        return "failed"

    def _purge(self, s: Session, ds) -> None:
        self.state = lineage.purge(self.radix, self.state, s.tokens, ds)
        self.state = lineage.purge(self._private.get(s.lineage), self.state, s.tokens, ds)

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
            clean = hit
            tree = self._private.get(s.lineage)
            if tree is not None:  # the lineage's own KV, if it reaches further
                own, n = tree.match(prompt, max_tokens=len(prompt) - 1)
                if n > hit:
                    same = 0  # clean only as far as its pages are the radix cache's own
                    while same < min(len(own), len(pages)) and own[same] == pages[same]:
                        same += 1
                    pages, hit, clean = own, n, same * self.page_size
            if hit:  # the slot is open and empty: reopen it holding the cached pages
                self.state = allocator.free(self.state, s.seq)
                self.state = allocator.adopt(self.state, s.seq, pages, prompt[:hit])
            s.cached = st.reused_tokens = hit
            s.clean = clean
        else:  # the KV holds tokens[:cut] (`_try_admit` cut it): splice what precedes the cut
            st.reused_tokens = kvp.cut
            if kvp.splices:
                self.state, done = ll.apply_directives(
                    self.model, self.state, s.seq, kvp.splices, report=True
                )
                st.reused_tokens, st.spliced_tokens = done.reused, done.spliced
                st.moved_tokens = done.moved
            s.clean = lineage.clean_after_edit(s.clean, kvp)
            s.cached = kvp.kept
        s.pins = spans.remap(s.pins, self._pin_edits(s.tokens, plan.directives, prompt))
        if self.move if req.move is None else req.move:
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
        req.status = "prefill"
        self.counters["reused"] += st.reused_tokens
        self.counters["spliced"] += st.spliced_tokens

    # ---- MOVE ---------------------------------------------------------------------------------
    def _move_plan(self, s: Session, prompt: list[int], kept: int) -> ll.Directive | None:
        """MOVE for the tokens a turn would prefill, prompt[kept:] (its KV holds prompt[:kept]):
        scanning left to right, a run of at least a page of tokens that the session's own KV
        holds at another position (prompt[:kept]) is taken from there, extended as far as it
        matches; failing that, a whole page of the clean radix cache holding exactly the next
        page of tokens, cached by a session of the same lineage. Returns one insertion at
        `kept` whose replacement runs to the last such run (its gaps are prefilled), or None;
        at least the prompt's last token is left to feed."""
        ps, limit = self.page_size, len(prompt) - 1
        own: dict[tuple[int, ...], int] = {}
        for p in range(kept - ps, -1, -1):  # the earliest occurrence of each page of tokens
            own[tuple(prompt[p : p + ps])] = p
        sources, o = [], kept
        while o + ps <= limit:
            key = tuple(prompt[o : o + ps])
            p = own.get(key)
            if p is not None:
                n = ps
                while o + n < limit and p + n < kept and prompt[o + n] == prompt[p + n]:
                    n += 1
                sources.append(ll.Source(o - kept, p, n))
                o += n
                continue
            found = self.radix.locate(key) if self.radix is not None else None
            if found is not None and self._page_lineage.get(found[0]) == s.lineage:
                sources.append(ll.Source(o - kept, found[1], ps, pages=(found[0],)))
                o += ps
                continue
            o += 1
        if not sources:
            return None
        end = kept + sources[-1].offset + sources[-1].length
        return ll.Directive(kept, kept, prompt[kept:end], Mode.MOVE, sources=tuple(sources))

    def _move(self, req: Request, prompt: list[int]) -> None:
        """Apply the turn's MOVE (`_move_plan`) to its session's KV, if there is one. A MOVE the
        pool cannot hold now is skipped: those tokens are prefilled instead."""
        s, st = req.session, req.stats
        d = self._move_plan(s, prompt, s.cached)
        if d is None:
            return
        try:
            self.state, done = ll.apply_directives(self.model, self.state, s.seq, [d], report=True)
        except ll.OutOfPagesError:
            self.counters["moves_skipped"] += 1
            return
        s.cached += len(d.replacement)
        s.foreign = s.foreign or any(x.pages for x in d.sources)
        st.spliced_tokens += done.moved
        st.moved_tokens += done.moved
        self.counters["moved"] += done.moved

    # ---- SCRATCH ------------------------------------------------------------------------------
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
            self._offload(s)
            cached = []
        # only pages no running turn may still take
        need = allocator.splice_need(self.page_size, left, cached[0].start) if cached else 0
        if need > self._available():
            self.counters["scratch_deferred"] += 1
            return
        try:
            if cached:
                self.state = ll.apply_directives(self.model, self.state, s.seq, cached)
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
        s = r.session
        s.active = None
        self._cache_prefix(s)
        if r.scratch or r.scratch_tags is not None:
            self._drop_scratch(r)
        r.stats.finished(now)
