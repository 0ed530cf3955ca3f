"""The serving engine: sessions, continuous batching, the radix prefix cache, directives in flight.

The imperative shell around the functional core. All device work goes through the core's
jitted, shape-bucketed steps (`paged.extend`: one ragged step for prefill chunks and decode
tokens together; the directive steps; `sample`); everything here is host bookkeeping in plain
Python, and the sampled tokens are the only thing a step reads back from the device.

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
generates. Idle sessions keep their KV until the pool needs it; an offloaded session keeps its
token list and gets its prefix back from the radix cache (or a prefill) on its next turn.

Lineage. KV that AMORTIZE spliced is not what a fresh prefill of the same tokens gives, so it
stays with the session (and its KV) that made it: each session tracks `clean`, the length of
the prefix whose KV a fresh prefill would reproduce, and only that prefix enters the radix
cache. A FORGET purges the radix path of the session's pre-edit tokens from the first evicted
token on before the edit runs, and pages nobody references afterwards are zeroed.

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
import math
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
from leyline_jax.config import check_tokens
from leyline_jax.directives import Mode
from serve.edits import edits_and_feed
from serve.radix import RadixCache


class RequestError(RuntimeError):
    """A turn that cannot be served (it never fits the pool or the sequence bound)."""


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return (_is_int(v) or isinstance(v, (float, np.floating))) and math.isfinite(v)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a turn generates. Checked when made: a bad field raises ValueError naming it.

    max_new_tokens: int >= 1. temperature: finite, >= 0 (0: greedy). top_p: in (0, 1].
    stop_tokens: token ids (any sequence of non-negative ints; kept as a tuple). seed: in
    [0, 2**32): with (seed, step) it fixes a sampled row's draw, whatever batch it is in."""

    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**32)")
        stops = self.stop_tokens
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (Sequence, np.ndarray)):
            raise ValueError(f"stop_tokens={stops!r} must be a sequence of token ids")
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_tokens={stops!r} must hold non-negative integer token ids")
        for name, value in (
            ("max_new_tokens", int(self.max_new_tokens)),
            ("temperature", float(self.temperature)),
            ("top_p", float(self.top_p)),
            ("seed", int(self.seed)),
            ("stop_tokens", tuple(int(t) for t in stops)),
        ):
            object.__setattr__(self, name, value)


@jax.jit
def sample(logits, temperature, top_p, seed, step):
    """One token per row of f32[B, V] logits: greedy where temperature == 0, else a draw from
    the top-p nucleus of softmax(logits / temperature). The key depends on (seed, step) only, so
    a row draws the same token whatever batch it is in."""

    def row(lg, t, p, s, n):
        key = jax.random.fold_in(jax.random.PRNGKey(s), n)
        scaled = lg / jnp.maximum(t, 1e-6)
        order = jnp.argsort(-scaled)
        probs = jax.nn.softmax(scaled[order])
        keep = (jnp.cumsum(probs) - probs) < p  # the smallest prefix with mass >= p
        drawn = order[jax.random.categorical(key, jnp.where(keep, scaled[order], -jnp.inf))]
        return jnp.where(t > 0, drawn, jnp.argmax(lg)).astype(jnp.int32)

    return jax.vmap(row)(logits, temperature, top_p, seed, step)


@dataclasses.dataclass
class TurnStats:
    prompt_tokens: int = 0  # the turn's whole prompt: the session's tokens after its edits
    reused_tokens: int = 0  # ... whose KV was already cached and kept as is
    spliced_tokens: int = 0  # ... whose KV AMORTIZE moved and rotated
    prefilled_tokens: int = 0  # ... run through the model in this turn
    submitted_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.submitted_s

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.submitted_s


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


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What an admitted turn does: a validated directive batch (the session's coordinates),
    then the turn's whole prompt (the edited list and the new tokens)."""

    directives: list[ll.Directive]
    prompt: list[int]
    edited: int  # the edited list's length: prompt[:edited] is the session after the batch


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
    ):
        if not 1 <= prefill_chunk <= paged.PREFILL_CHUNK:
            raise ValueError(f"prefill_chunk must be in [1, {paged.PREFILL_CHUNK}]")
        self.model = model
        self.graph = nnx.split(model)
        self.state = ll.init_state(
            model.config,
            num_pages=num_pages,
            page_size=page_size,
            max_seqs=max_seqs,
            max_seq_len=max_seq_len,
            kv_dtype=kv_dtype,
            k_pe_dtype=k_pe_dtype,
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
    ) -> Request:
        """Queue a turn given as the whole prompt (what an unmodified harness sends): when it
        runs, the difference from the session's tokens becomes directives in `mode` plus the
        appended tail (`serve.edits.edits_and_feed`). Checked now like `submit`; `mode` must be
        a `Mode` (ValueError)."""
        s, sampling = self._check_turn(session, sampling)
        toks = check_tokens(prompt, self.model.config.vocab_size).tolist()
        if not isinstance(mode, Mode):
            raise ValueError(f"mode={mode!r} must be Mode.AMORTIZE or Mode.FORGET")
        req = Request(self, s, [], (), sampling)
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

    def _session(self, session: int) -> Session:
        s = self.sessions.get(session) if _is_int(session) else None
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
        s, ps = req.session, self.page_size
        n = int(self.state.lengths[s.seq])
        final = n + len(req.pending) + req.sampling.max_new_tokens - req.fed
        shared = kv.last_page_shared(self.state, s.seq)
        return -(-final // ps) - (-(-n // ps)) + int(bool(shared))

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

    def _plan(self, req: Request) -> _Plan:
        """Validate the turn against its session now. Explicit directives are taken as given,
        each in its own mode; a whole prompt (`submit_prompt`) becomes directives + new tokens
        here, against the session's tokens as they are now. A turn always feeds at least one
        token (its first output needs logits): a turn that adds none feeds the edited list's
        last token again. Raises DirectiveError (a ValueError) for what the session refuses."""
        s, vocab = req.session, self.model.config.vocab_size
        if req.prompt is not None:
            ds, new = edits_and_feed(s.tokens, req.prompt, mode=req.mode)
        else:
            ds, new = req.directives, req.new_tokens
        ds = dv.validate(ds, len(s.tokens), vocab)
        edited = dv.apply_to_list(s.tokens, ds)
        if not new and not edited:
            raise dv.DirectiveError("the turn would leave the session empty: it adds no token")
        return _Plan(ds, edited + list(new), len(edited))

    @staticmethod
    def _kept(s: Session, plan: _Plan) -> int:
        """Tokens of a session holding KV whose KV the turn keeps before feeding its first
        token (a re-fed last token is cut)."""
        held = plan.edited if plan.directives else s.cached
        return held - 1 if held == len(plan.prompt) else held

    def _need(self, req: Request, plan: _Plan) -> tuple[int, int]:
        """(pages the turn may take from the pool at most, pages of the session's own that stay
        held while it does). An AMORTIZE splice copies the kept tokens into fresh pages before
        the old ones are released, so all the session's pages stay held at its peak; otherwise
        only those before the first edit (a FORGET cuts before it takes)."""
        s, ps = req.session, self.page_size
        final = len(plan.prompt) + req.sampling.max_new_tokens
        if s.seq is None:
            return -(-final // ps) + 1, 0
        n = int(self.state.lengths[s.seq])
        ds = plan.directives
        first = ds[0].start if ds else n
        keep = min(first, len(plan.prompt) - 1) // ps  # a re-fed last token may cut a page
        cut = min([d.start for d in ds if d.mode is Mode.FORGET], default=n)
        splices = any(d.mode is Mode.AMORTIZE and d.end <= cut for d in ds)
        held = -(-n // ps) if splices else keep
        return -(-final // ps) - keep + 1, held

    def _freed_first(self, s: Session, plan: _Plan) -> int:
        """Pages a turn frees before it takes any: a batch that cuts (FORGET) without splicing
        first drops the session's pages past its first edit, and its radix purge drops the
        tree's references to them; those nobody else holds come back to the pool."""
        ds = plan.directives
        if s.seq is None or not ds or any(d.mode is Mode.AMORTIZE for d in ds):
            return 0
        ps, cut = self.page_size, ds[0].start
        held = self.state.page_table[s.seq, cut // ps : -(-int(self.state.lengths[s.seq]) // ps)]
        purged = set()
        if self.radix is not None:
            pages, _ = self.radix.peek(s.tokens)
            purged = set(pages[cut // ps :])
        refs = self.state.refcount
        return sum(1 for p in held if refs[p] - 1 - (int(p) in purged) == 0)

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
        if s.seq is not None and self._kept(s, plan) == 0:
            # nothing of the cached KV survives the edit: the session's KV starts again
            self._offload(s)
            self._purge(s, plan.directives)
        need, held = self._need(req, plan)
        if need > self.state.num_pages - held:
            return self._fail(
                req,
                RequestError(
                    f"the turn needs up to {need} pages of {self.page_size} tokens beside the "
                    f"{held} its session holds meanwhile; the pool has {self.state.num_pages}"
                ),
            )
        if not self._make_room(need - self._freed_first(s, plan), s):
            return "wait"
        fresh = s.seq is None
        if fresh and not self._take_slot(s):
            return "wait"
        try:
            self._start(req, plan, fresh)
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

    def _take_slot(self, s: Session) -> bool:
        used = {x.seq for x in self.sessions.values() if x.seq is not None}
        free = [i for i in range(self.state.max_seqs) if i not in used]
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
        if self.radix is None or s.seq is None:
            return
        ps = self.page_size
        n = min(s.clean, s.cached) // ps
        if n == 0:
            return
        row = self.state.page_table[s.seq, :n]
        taken = self.radix.insert(s.tokens[: n * ps], [int(p) for p in row])
        if taken:
            self.state = paged.retain(self.state, taken)

    def _fail(self, req: Request, error: Exception) -> str:
        req.status, req.error = "failed", error
        req.stats.finished_s = time.perf_counter()
        self.counters["failed_turns"] += 1
        return "failed"

    def _purge(self, s: Session, ds) -> None:
        """A batch with a FORGET: the radix cache forgets the session's path from the first
        FORGET start on (its KV was computed with the evicted tokens); pages nobody else holds
        are zeroed. Idempotent."""
        forget = [d for d in ds if d.mode is Mode.FORGET]
        if forget and self.radix is not None:
            pages = self.radix.purge(s.tokens, forget[0].start)
            if pages:
                self.state = paged.release(self.state, pages, zero=True)

    def _start(self, req: Request, plan: _Plan, fresh: bool) -> None:
        """Apply the turn's directives and set up its prompt (the turn is admitted). `fresh`:
        the session has just been given an empty sequence slot."""
        s, st, ds, prompt = req.session, req.stats, plan.directives, plan.prompt
        self._purge(s, ds)
        st.prompt_tokens = len(prompt)
        st.reused_tokens = st.spliced_tokens = 0
        if fresh:  # the longest clean prefix from the radix cache
            pages, hit = [], 0
            if self.radix is not None:
                pages, hit = self.radix.match(prompt, max_tokens=len(prompt) - 1)
            if hit:  # the slot is open and empty: reopen it holding the cached pages
                self.state = paged.free(self.state, s.seq)
                self.state = paged.adopt(self.state, s.seq, pages, prompt[:hit])
            s.cached = s.clean = st.reused_tokens = hit
        else:
            last_moved = False
            if ds:  # directives address every token the session holds: cache them first
                self._feed_unfed(s)
                st.reused_tokens, st.spliced_tokens, last_moved = self._apply(s, ds)
            else:
                st.reused_tokens = s.cached
            if s.cached == len(prompt):  # nothing new: the last token is fed again
                self._cut_last(s)
                if st.reused_tokens == len(prompt):
                    st.reused_tokens -= 1
                elif last_moved:
                    st.spliced_tokens -= 1
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

    def _feed_unfed(self, s: Session) -> None:
        """Bring the KV up to the session's token list (the last generated token of the
        previous turn is known but not yet cached) so directives address cached tokens."""
        rest = s.tokens[s.cached :]
        for a in range(0, len(rest), self.prefill_chunk):
            block = rest[a : a + self.prefill_chunk]
            self.state, _ = paged.extend(self.model, self.state, [s.seq], [block], graph=self.graph)
        if s.clean == s.cached:
            s.clean = len(s.tokens)
        s.cached = len(s.tokens)

    def _cut_last(self, s: Session) -> None:
        """Drop the KV of the session's last cached token (a truncation: the rest is kept
        exactly), so that the token can be fed again for its logits."""
        n = s.cached
        cut = ll.Directive(n - 1, n, (), Mode.FORGET)
        self.state = ll.apply_directives(self.model, self.state, s.seq, [cut])
        s.cached, s.clean = n - 1, min(s.clean, n - 1)

    def _apply(self, s: Session, ds) -> tuple[int, int, bool]:
        """Apply a validated directive batch to a session holding KV of all its tokens; update
        its lineage. Returns (tokens reused, tokens spliced, whether the edited list's last
        token is a spliced one)."""
        self.state = ll.apply_directives(self.model, self.state, s.seq, ds)
        forget = [d for d in ds if d.mode is ll.Mode.FORGET]
        cut = forget[0].start if forget else len(s.tokens)
        spliced = [d for d in ds if d.end <= cut and d.mode is ll.Mode.AMORTIZE]
        cut_new = cut + sum(d.delta for d in spliced)
        new_len = len(dv.apply_to_list(s.tokens, ds))
        reused = ds[0].start
        # kept tokens after the first edit that AMORTIZE moved (and rotated) rather than refed
        moved = (cut - ds[0].start) - sum(d.end - d.start for d in spliced)
        ends_in_replacement = bool(spliced) and spliced[-1].end == cut and spliced[-1].replacement
        last_moved = moved > 0 and new_len == cut_new and not ends_in_replacement
        if spliced:
            s.clean = min(s.clean, spliced[0].start)
        elif s.clean >= cut:  # FORGET alone re-prefills after a clean prefix: all clean
            s.clean = new_len
        s.cached = new_len
        return reused, moved, last_moved

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
        self.state, logits = paged.extend(
            self.model, self.state, [r.session.seq for r in rows], blocks, graph=self.graph
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
            self._emit([rows[i] for i in emit], logits[np.asarray(emit)])

    def _emit(self, rows: list[Request], logits) -> None:
        """Sample one token for each row and finish the turns that are done."""
        b = paged.bucket(len(rows))
        pad = b - len(rows)

        def col(values, dtype):
            return jnp.asarray(np.asarray(values + [values[0]] * pad, dtype))

        logits = jnp.pad(logits, ((0, pad), (0, 0)))
        toks = sample(
            logits,
            col([r.sampling.temperature for r in rows], np.float32),
            col([r.sampling.top_p for r in rows], np.float32),
            col([r.sampling.seed for r in rows], np.uint32),
            col([len(r.output) for r in rows], np.int32),
        )
        with jax.transfer_guard_device_to_host("allow"):  # the one read a step makes
            toks = np.asarray(toks)[: len(rows)].tolist()
        now = time.perf_counter()
        for r, t in zip(rows, toks, strict=True):
            s = r.session
            r.output.append(t)
            s.tokens.append(t)
            s.last_used = now
            if r.stats.first_token_s is None:
                r.stats.first_token_s = now
            r.status = "decode"
            if t in r.sampling.stop_tokens or len(r.output) >= r.sampling.max_new_tokens:
                self._finish(r, now)

    def _finish(self, r: Request, now: float) -> None:
        r.status = "done"
        r.stats.finished_s = now
        s = r.session
        s.active = None
        self._cache_prefix(s)
