"""A stateful fuzzer of the serving engine (hypothesis): random sessions, turns with random
directives in mixed modes, whole-prompt edits (empty-result and disjoint prompts included),
valid and invalid sampling parameters, closes, and offloads and evictions under a tight pool.

References, independent of the engine's planning: a plain list-of-tokens model of each
session (its own validity check and list edit), each untouched session run alone in a second
engine (greedy outputs must be identical), and a fresh prefill through the functional core
(after a FORGET on a session no AMORTIZE ever touched, its KV must equal one).

Checked after every rule: every turn is finished, running, or queued behind its session's
earlier turns or waiting for room; refcounts equal page-table plus radix references; every
sequence's cached token ids are its session's prefix; an idle session's tokens equal the list
model's; after a FORGET the radix cache serves nothing past the FORGET's page of the old path.
At the end of each example the engine must drain (no wedged turn).

Bounded for CI: a two-layer dense model, a 24-page pool, derandomized, a fixed number of examples.
"""

from __future__ import annotations

import collections
import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_CONFIGS
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import leyline_jax as ll
from checkpoints.tiny import write_random_checkpoint
from leyline_jax import kv_state as kv
from leyline_jax.directives import Directive, DirectiveError, Mode
from serve.engine import Engine, RequestError, SamplingParams

PS = 8
ENGINE = dict(
    num_pages=24, page_size=PS, max_seqs=3, max_seq_len=96, kv_dtype=jnp.float32, prefill_chunk=32
)
VOCAB = 256
SYSTEM = list(range(100, 112))  # a shared prefix some sessions start with (radix sharing)
BAD_SAMPLING = [
    dict(seed=-1),
    dict(seed=2**32),
    dict(stop_tokens=None),
    dict(stop_tokens=5),
    dict(temperature=float("nan")),
    dict(top_p=0.0),
    dict(max_new_tokens=2.5),
    dict(max_new_tokens=True),
]


SEEN: collections.Counter = collections.Counter()  # what the run exercised (checked at the end)


# ---- the list model ---------------------------------------------------------------------------
def valid(ds, n: int) -> bool:
    """The directive rules of DESIGN.md §2, written out on their own."""
    for d in ds:
        if not 0 <= d.start <= d.end <= n or any(not 0 <= t < VOCAB for t in d.replacement):
            return False
    real = sorted((d for d in ds if d.end > d.start or d.replacement), key=lambda d: d.start)
    pairs = zip(real, real[1:], strict=False)
    return all(a.end <= b.start and a.start != b.start for a, b in pairs)


def edit(tokens: list[int], ds) -> list[int]:
    out = list(tokens)
    for d in sorted(ds, key=lambda d: d.start, reverse=True):  # right to left: coords hold
        out[d.start : d.end] = d.replacement
    return out


@dataclasses.dataclass
class Turn:
    req: object
    new: list[int]
    directives: list
    prompt: list[int] | None  # submit_prompt
    mode: Mode
    sampling: SamplingParams
    alone: object = None  # the same turn in the reference engine (untouched sessions)
    checked: bool = False


@dataclasses.dataclass
class Model:
    sid: int
    ref_sid: int | None  # its twin in the reference engine while untouched
    tokens: list[int] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    amortized: bool = False  # some AMORTIZE edit ever touched it
    forget_at: int | None = None  # set by a finished FORGET turn: check its KV and radix

    def in_flight(self) -> bool:
        return any(not t.checked for t in self.turns)


def fresh_kv(model, tokens: list[int]):
    """c_kv, k_pe rows [L, n, ...] a fresh prefill of `tokens` caches."""
    state = ll.init_state(
        model.config, num_pages=16, page_size=PS, max_seqs=1, kv_dtype=jnp.float32
    )
    state, _ = ll.prefill(model, state, 0, tokens)
    return session_kv(state, 0, len(tokens))


def session_kv(state, seq: int, n: int):
    row = np.asarray(state.page_table)[seq]
    slots = row[np.arange(n) // PS] * PS + np.arange(n) % PS
    c = np.asarray(state.moved).reshape(state.num_layers, -1, state.moved.shape[-1])[:, slots]
    k = np.asarray(state.rotated).reshape(state.num_layers, -1, state.rotated.shape[-1])[:, slots]
    return c, k


def kv_matches_fresh(model, state, seq: int, tokens: list[int]) -> float:
    """max |cached - fresh| / max |fresh| over c_kv and k_pe of `tokens` in `seq`."""
    got, want = session_kv(state, seq, len(tokens)), fresh_kv(model, tokens)
    return max(
        float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))
        for g, w in zip(got, want, strict=True)
    )


# fp32 throughout: a FORGET's re-prefill differs from one whole fresh prefill only by how the
# work is chunked (sums in another order), ~1e-6 relative; kept evicted-span influence is O(1)
KV_TOL = 1e-4


def check_refcounts(engine: Engine) -> None:
    want = kv.table_references(engine.state)
    for p in engine.radix.pages():
        want[p] += 1
    np.testing.assert_array_equal(engine.state.refcount, want)


class EngineMachine(RuleBasedStateMachine):
    model = None  # set by the test

    def __init__(self):
        super().__init__()
        self.engine = Engine(self.model, **ENGINE)
        self.ref = Engine(self.model, **ENGINE)  # untouched sessions, each run alone
        self.sessions: dict[int, Model] = {}
        self.closed: list[list[int]] = []  # token lists of closed sessions (radix holds them)

    # ---- helpers ---------------------------------------------------------------------------
    def _sampling(self, data) -> SamplingParams:
        greedy = data.draw(st.integers(0, 3), "greedy") > 0
        return SamplingParams(
            max_new_tokens=data.draw(st.integers(1, 4), "max_new"),
            temperature=0.0 if greedy else 0.8,
            top_p=data.draw(st.sampled_from([1.0, 0.9])),
            stop_tokens=tuple(data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
            seed=data.draw(st.integers(0, 2**32 - 1), "seed"),
        )

    def _idle(self, data, pred=lambda m: True):
        ids = [k for k, m in self.sessions.items() if not m.in_flight() and pred(m)]
        return data.draw(st.sampled_from(ids), "session") if ids else None

    def _untouch(self, m: Model) -> None:
        """The session leaves the reference: it is no longer what a plain run would give."""
        if m.ref_sid is not None:
            self.ref.run_until_idle()
            self.ref.close_session(m.ref_sid)
            m.ref_sid = None

    def _submit(self, m: Model, turn_kw: dict, sampling: SamplingParams, plain: bool) -> None:
        if not plain or sampling.temperature > 0:
            self._untouch(m)
        if "prompt" in turn_kw:
            req = self.engine.submit_prompt(
                m.sid, turn_kw["prompt"], mode=turn_kw["mode"], sampling=sampling
            )
        else:
            req = self.engine.submit(
                m.sid, turn_kw["new"], directives=turn_kw["directives"], sampling=sampling
            )
        turn = Turn(
            req,
            turn_kw.get("new", []),
            turn_kw.get("directives", []),
            turn_kw.get("prompt"),
            turn_kw.get("mode", Mode.AMORTIZE),
            sampling,
        )
        if m.ref_sid is not None:  # the same turn alone, now
            turn.alone = self.ref.submit(m.ref_sid, turn.new, sampling=sampling)
            self.ref.run_until_idle()
        m.turns.append(turn)

    # ---- rules -----------------------------------------------------------------------------
    @precondition(lambda self: len(self.sessions) < 4)
    @rule(data=st.data())
    def open_session(self, data):
        prefix = SYSTEM if data.draw(st.booleans(), "shared") else []
        tokens = prefix + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
        m = Model(self.engine.open_session(), self.ref.open_session())
        self.sessions[m.sid] = m
        self._submit(m, dict(new=tokens, directives=[]), self._sampling(data), plain=True)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def append_turn(self, data):
        """A turn of new tokens, maybe with directives (random spans in mixed modes, valid or
        not when the turn runs), queued behind the session's earlier turns if any."""
        sid = data.draw(st.sampled_from(sorted(self.sessions)), "session")
        m = self.sessions[sid]
        n = max(len(m.tokens), 1)
        tokens = st.integers(0, VOCAB - 1)
        # mostly short turns; now and then a long one (page pressure, and past max_seq_len)
        new = data.draw(st.lists(tokens, max_size=12) | st.lists(tokens, min_size=40, max_size=70))
        ds = []
        for _ in range(data.draw(st.integers(0, 2), "n_directives")):
            a = data.draw(st.integers(0, n + 2), "start")
            b = data.draw(st.integers(a, min(a + 30, n + 2)), "end")
            rep = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=6), "replacement")
            mode = data.draw(st.sampled_from([Mode.AMORTIZE, Mode.FORGET]), "mode")
            ds.append(Directive(a, b, tuple(rep), mode))
        if not new and not ds and not m.tokens:
            new = [1]
        self._submit(m, dict(new=new, directives=ds), self._sampling(data), plain=not ds)

    @precondition(
        lambda self: any(not m.in_flight() and len(m.tokens) > 4 for m in self.sessions.values())
    )
    @rule(data=st.data())
    def splice_turn(self, data):
        """A valid edit in the middle of an idle session, in either mode: AMORTIZE splices the
        tokens after it, FORGET re-prefills them."""
        sid = self._idle(data, lambda m: len(m.tokens) > 4)
        m = self.sessions[sid]
        n = len(m.tokens)
        a = data.draw(st.integers(1, n - 3), "start")
        b = data.draw(st.integers(a, n - 2), "end")
        rep = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=5), "replacement")
        mode = data.draw(st.sampled_from([Mode.AMORTIZE, Mode.FORGET]), "mode")
        new = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=4), "new")
        ds = [Directive(a, b, tuple(rep), mode)]
        self._submit(m, dict(new=new, directives=ds), self._sampling(data), plain=False)

    @precondition(lambda self: any(not m.in_flight() for m in self.sessions.values()))
    @rule(data=st.data())
    def too_long_turn(self, data):
        """A turn that would take the session past max_seq_len: it fails alone."""
        m = self.sessions[self._idle(data)]
        over = ENGINE["max_seq_len"] - len(m.tokens) + data.draw(st.integers(0, 8), "over")
        new = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=over, max_size=over))
        self._submit(m, dict(new=new, directives=[]), self._sampling(data), plain=True)

    @precondition(lambda self: any(not m.in_flight() for m in self.sessions.values()))
    @rule(data=st.data())
    def prompt_turn(self, data):
        """The whole prompt re-sent with an edit: a span dropped or replaced, the prompt as it
        is, only its last token, a prompt sharing nothing, or one with a prefix of it."""
        sid = self._idle(data)
        m = self.sessions[sid]
        old = m.tokens
        kind = data.draw(
            st.sampled_from(["edit", "same", "last", "disjoint", "prefix", "append"]), "kind"
        )
        if kind == "edit":
            a = data.draw(st.integers(0, len(old) - 1))
            b = data.draw(st.integers(a, len(old)))
            rep = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
            prompt = old[:a] + rep + old[b:]
        elif kind == "same":
            prompt = list(old)
        elif kind == "last":
            prompt = old[-1:]
        elif kind == "disjoint":
            prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        elif kind == "prefix":
            prompt = old[: data.draw(st.integers(1, len(old)))]
        else:
            prompt = old + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
        if not prompt:
            prompt = [3]
        mode = data.draw(st.sampled_from([Mode.AMORTIZE, Mode.FORGET]), "mode")
        self._submit(m, dict(prompt=prompt, mode=mode), self._sampling(data), plain=False)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def bad_submission(self, data):
        """Refused at submit, with the documented error; nothing is queued."""
        sid = data.draw(st.sampled_from(sorted(self.sessions)), "session")
        queued = len(self.engine._queued)
        what = data.draw(st.sampled_from(["sampling", "token", "type", "stop"]), "bad")
        with pytest.raises(ValueError):
            if what == "sampling":
                bad = data.draw(st.sampled_from(BAD_SAMPLING))
                self.engine.submit(sid, [1], sampling=SamplingParams(**bad))
            elif what == "token":
                bad = data.draw(st.sampled_from([VOCAB, -1, 2.0, True, "7"]))
                self.engine.submit(sid, [1, bad])
            elif what == "type":
                self.engine.submit(sid, [1], directives=[(0, 1)])
            else:
                self.engine.submit(sid, [1], sampling=SamplingParams(stop_tokens=(VOCAB,)))
        assert len(self.engine._queued) == queued

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def close(self, data):
        sid = data.draw(st.sampled_from(sorted(self.sessions)), "session")
        m = self.sessions[sid]
        busy = bool(self.engine.sessions[sid].queue) or self.engine.sessions[sid].active
        if busy:
            with pytest.raises(ValueError, match="in flight"):
                self.engine.close_session(sid)
            return
        self._settle()
        self.engine.close_session(sid)
        self._untouch(m)
        self.closed.append(m.tokens)
        del self.sessions[sid]

    @rule(steps=st.integers(1, 3))
    def step(self, steps):
        for _ in range(steps):
            queued = len(self.engine._queued)
            stalled = queued and not any(s.active for s in self.engine.sessions.values())
            self.engine.step()
            if stalled:  # queued for a reason: with nothing running, nothing may block a turn
                assert len(self.engine._queued) < queued, "a queued turn is wedged"
            self._settle()

    @rule()
    def drain(self):
        self.engine.run_until_idle(max_steps=2000)
        self._settle()

    # ---- following finished turns ------------------------------------------------------------
    def _settle(self) -> None:
        """Fold finished turns into the list model, in each session's order, checking each."""
        for m in self.sessions.values():
            for turn in m.turns:
                if turn.checked:
                    continue
                if not turn.req.finished:
                    break
                self._check_turn(m, turn)
                turn.checked = True
            m.turns = [t for t in m.turns if not t.checked]

    def _check_turn(self, m: Model, turn: Turn) -> None:
        req = turn.req
        before = list(m.tokens)
        if turn.prompt is not None:
            ok, prompt, forget = True, turn.prompt, turn.mode is Mode.FORGET
            amortize = turn.mode is Mode.AMORTIZE and prompt[: len(before)] != before
        else:
            ds = turn.directives
            ok = valid(ds, len(before))
            prompt = edit(before, ds) + turn.new if ok else None
            ok = ok and bool(prompt)
            real = [d for d in ds if d.end > d.start or d.replacement]  # both empty: a no-op
            forget = any(d.mode is Mode.FORGET for d in real)
            amortize = any(d.mode is Mode.AMORTIZE for d in real)
        if not ok:
            assert isinstance(req.error, DirectiveError), req.error
            SEEN["invalid_turns"] += 1
            return
        too_long = len(prompt) + turn.sampling.max_new_tokens > ENGINE["max_seq_len"]
        if too_long:
            assert isinstance(req.error, RequestError) and "max_seq_len" in str(req.error)
            SEEN["too_long_turns"] += 1
            return
        if isinstance(req.error, RequestError) and "pages" in str(req.error):
            # a splice holds the session's old pages while it fills fresh ones: a turn may
            # never fit beside them. Only plausible when the two together exceed the pool.
            final = len(prompt) + turn.sampling.max_new_tokens
            pages = -(-final // PS) + 1 + -(-len(before) // PS)
            assert pages > ENGINE["num_pages"], (req.error, len(before), final)
            SEEN["never_fit_turns"] += 1
            return
        assert req.error is None, req.error
        out = req.output
        sp = turn.sampling
        assert 1 <= len(out) <= sp.max_new_tokens
        assert all(t not in sp.stop_tokens for t in out[:-1])
        assert len(out) == sp.max_new_tokens or out[-1] in sp.stop_tokens
        st_ = req.stats
        assert st_.prompt_tokens == len(prompt)
        assert st_.reused_tokens + st_.spliced_tokens + st_.prefilled_tokens == len(prompt)
        assert st_.prefilled_tokens >= 1
        if forget:
            assert st_.spliced_tokens <= len(prompt)  # counted, not re-derived
        m.tokens = prompt + out
        m.amortized |= amortize
        if turn.alone is not None:
            assert turn.alone.output == out, (turn.alone.output, out)
            SEEN["alone_compared"] += 1
        SEEN["spliced_turns"] += st_.spliced_tokens > 0
        if forget:
            m.forget_at = self._first_forget(before, turn)
            if m.forget_at is not None:
                self._check_purge(m, before, m.forget_at)
            if not m.amortized:
                self._check_forget_kv(m, turn)

    @staticmethod
    def _first_forget(before, turn: Turn) -> int | None:
        if turn.prompt is None:
            real = [d for d in turn.directives if d.end > d.start or d.replacement]
            return min(d.start for d in real if d.mode is Mode.FORGET)
        p = 0  # an edited prompt's first change is where its FORGET starts, at the latest
        while p < min(len(before), len(turn.prompt)) and before[p] == turn.prompt[p]:
            p += 1
        return p if p < len(before) else None

    def _check_purge(self, m: Model, old: list[int], start: int) -> None:
        """The radix cache serves nothing of the old path past the FORGET's page, unless
        another session holds the same tokens through that page (its own KV)."""
        end = (start // PS + 1) * PS
        others = [x.tokens for k, x in self.engine.sessions.items() if k != m.sid] + self.closed
        mine = [m.tokens, self.engine.sessions[m.sid].tokens]  # later turns may have run
        if any(o[:end] == old[:end] for o in others + mine):
            return
        _, hit = self.engine.radix.match(old)
        SEEN["purge_checked"] += 1
        assert hit <= start // PS * PS, (hit, start)

    def _check_forget_kv(self, m: Model, turn: Turn) -> None:
        s = self.engine.sessions[m.sid]
        if s.seq is None or s.cached == 0 or s.active is not None or s.tokens != m.tokens:
            return  # no KV, or a later turn of the session has run since (drain)
        err = kv_matches_fresh(self.model, self.engine.state, s.seq, s.tokens[: s.cached])
        SEEN["forget_kv_checked"] += 1
        assert err <= KV_TOL, (err, m.sid, turn.directives, turn.prompt, s.cached, s.tokens)

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def turns_are_accounted_for(self):
        """Every turn is finished, running (its session's active turn), or queued in order
        (why it waits is checked by `step`: with nothing running, a step admits or fails one)."""
        queued = [r for _, r in self.engine._queued]
        for s in self.engine.sessions.values():
            assert s.active is None or s.active.status in ("prefill", "decode")
            assert all(r.status == "queued" and r in queued for r in s.queue)
        for m in self.sessions.values():
            for t in m.turns:
                r = t.req
                assert r.finished or r is self.engine.sessions[m.sid].active or r in queued

    @invariant()
    def refcounts_exact(self):
        check_refcounts(self.engine)

    @invariant()
    def cache_describes_tokens(self):
        state = self.engine.state
        for sid, s in self.engine.sessions.items():
            if s.seq is not None:
                assert state.active[s.seq]
                assert int(state.lengths[s.seq]) == s.cached <= len(s.tokens)
                assert ll.tokens(self.engine.state, s.seq) == s.tokens[: s.cached]
            m = self.sessions[sid]
            if not m.in_flight():
                assert s.tokens == m.tokens
            assert s.clean <= s.cached

    def teardown(self):
        self.engine.run_until_idle(max_steps=2000)  # nothing is wedged
        self._settle()
        SEEN.update(
            {
                k: v
                for k, v in self.engine.counters.items()
                if k in ("offloads", "radix_evicted_pages")
            }
        )
        for m in self.sessions.values():
            assert not m.in_flight()
        check_refcounts(self.engine)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Two dense layers: the least depth at which a cached latent depends on other tokens
    (one layer's c_kv is a function of its own token alone, so no KV check could fail)."""
    cfg = {**ALL_CONFIGS["glm4_moe_lite"], "num_hidden_layers": 2, "mlp_layer_types": ["dense"] * 2}
    return ll.load_model(write_random_checkpoint(tmp_path_factory.mktemp("fuzz"), cfg))


def test_engine_fuzz(model):
    EngineMachine.model = model
    SEEN.clear()
    run_state_machine_as_test(
        EngineMachine,
        settings=settings(
            max_examples=int(os.environ.get("LEYLINE_FUZZ_EXAMPLES", 30)),
            stateful_step_count=25,
            deadline=None,
            derandomize=not os.environ.get("LEYLINE_FUZZ_RANDOM"),  # a longer local hunt
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
            print_blob=True,
            # no shrinking in CI: a shrink of this machine takes many minutes; a failure
            # prints its steps as found (set LEYLINE_FUZZ_SHRINK=1 to shrink locally)
            phases=[Phase.explicit, Phase.reuse, Phase.generate]
            + ([Phase.shrink] if os.environ.get("LEYLINE_FUZZ_SHRINK") else []),
        ),
    )
    # the run reached what it is meant to check (a fuzzer that never gets there proves nothing)
    for what in (
        "forget_kv_checked",
        "purge_checked",
        "alone_compared",
        "spliced_turns",
        "invalid_turns",
        "too_long_turns",
        "offloads",
    ):
        assert SEEN[what] > 0, (what, dict(SEEN))
    print(dict(SEEN))


def test_forget_kv_check_can_fail(model):
    """The FORGET check is not vacuous: after an AMORTIZE edit of the same span the session's KV
    is measurably not a fresh prefill's (it keeps the evicted span's influence)."""
    errs = {}
    for mode in (Mode.FORGET, Mode.AMORTIZE):
        engine = Engine(model, **ENGINE)
        s = engine.open_session()
        engine.submit(s, list(range(1, 41)), sampling=SamplingParams(2)).result()
        engine.submit(s, [7], directives=[Directive(5, 15, (), mode)]).result()
        sess = engine.sessions[s]
        errs[mode] = kv_matches_fresh(model, engine.state, sess.seq, sess.tokens[: sess.cached])
    assert errs[Mode.FORGET] <= KV_TOL < errs[Mode.AMORTIZE], errs
