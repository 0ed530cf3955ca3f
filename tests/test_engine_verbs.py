"""The engine's verbs beyond AMORTIZE and FORGET: PIN, SCRATCH, MOVE and DECAY, end to end.

References: a second engine doing the same edit another way (SCRATCH against an explicit
AMORTIZE deletion), the functional core (`ll.apply_directives` with the same MOVE sources,
`ll.decay_selection` for DECAY), float64 rotations (MOVE's rotated band), and a control run
without the verb wherever an assertion could otherwise hold by accident (a pin that does not
matter, a scratch span that changes nothing, a MOVE whose KV equals a prefill's).

A two-layer dense model (one layer's latent depends on its own token alone, so no KV check
could fail), fp32 KV, greedy unless a test says otherwise.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_CONFIGS

import leyline_jax as ll
from checkpoints.tiny import write_random_checkpoint
from leyline_jax import allocator
from leyline_jax.directives import Directive, DirectiveError, Mode, Source
from serve.engine import Engine, RequestError, SamplingParams

PS = 8
SHAPE = dict(page_size=PS, max_seqs=4, max_seq_len=128, kv_dtype=jnp.float32)
ROOMY, TIGHT = 64, 12  # pool sizes: two shapes to compile, shared by every test here


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = {**ALL_CONFIGS["glm4_moe_lite"], "num_hidden_layers": 2, "mlp_layer_types": ["dense"] * 2}
    return ll.load_model(write_random_checkpoint(tmp_path_factory.mktemp("verbs"), cfg))


def make(model, num_pages=ROOMY, **kw):
    return Engine(model, num_pages=num_pages, **SHAPE, **kw)


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def turn(engine, sid, tokens, n=2, **kw):
    """Submit a turn and run it to its end; the Request."""
    r = engine.submit(sid, tokens, sampling=SamplingParams(n), **kw)
    r.result()
    return r


def slots(engine, seq: int, positions) -> np.ndarray:
    pos = np.asarray(positions)
    return np.asarray(engine.state.page_table)[seq, pos // PS] * PS + pos % PS


def rows(state, slot_ids):
    """(moved band, rotated band) of every layer at pool slots `slot_ids`: [L, n, width]."""
    m = np.asarray(state.moved).reshape(state.num_layers, -1, state.moved.shape[-1])
    r = np.asarray(state.rotated).reshape(state.num_layers, -1, state.rotated.shape[-1])
    return m[:, slot_ids], r[:, slot_ids]


def look(engine, sid):
    """Everything of a session a refused turn must leave alone: tokens, slot, cache lengths,
    pins, page row and the KV of its cached tokens."""
    s = engine.sessions[sid]
    kv = rows(engine.state, slots(engine, s.seq, range(s.cached))) if s.seq is not None else None
    row = None if s.seq is None else np.asarray(engine.state.page_table)[s.seq].tolist()
    return list(s.tokens), s.seq, s.cached, s.clean, list(s.pins), row, kv


def same(a, b) -> bool:
    *head_a, kv_a = a
    *head_b, kv_b = b
    if head_a != head_b:
        return False
    return kv_a is None or all(np.array_equal(x, y) for x, y in zip(kv_a, kv_b, strict=True))


def greedy(model, state, seq, tokens, n):
    """Feed `tokens` to the core's sequence `seq`, then decode `n` greedy tokens."""
    out = []
    state, logits = ll.prefill(model, state, seq, tokens)
    first = np.asarray(logits)
    for _ in range(n):
        out.append(int(np.asarray(logits).argmax()))
        state, logits = ll.prefill(model, state, seq, out[-1:])
    return out, first


def core_state(model):
    return ll.init_state(model.config, num_pages=ROOMY, **SHAPE)


def rotate64(k, delta: int, model):
    """k [..., D] (halves layout) rotated by Δ positions in float64: R(Δ · inv_freq)."""
    ang = delta * np.asarray(model.config.rope_inv_freq(), np.float64)
    h = k.shape[-1] // 2
    x1, x2 = k[..., :h].astype(np.float64), k[..., h:].astype(np.float64)
    cos, sin = np.cos(ang), np.sin(ang)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def assert_moved_kv(model, dst, src, delta):
    """The moved band bit-exact; the rotated band equal to the source's rotated by Δ in
    float64. fp32 phases p·inv_freq (p < 128) are off by at most ~1e-5 rad, and the rotation's
    products round at 6e-8 relative: 2e-5 of the band's largest value bounds both."""
    (dm, dr), (sm, sr) = dst, src
    np.testing.assert_array_equal(dm, sm)
    want = rotate64(sr, delta, model)
    np.testing.assert_allclose(dr, want, rtol=0, atol=2e-5 * np.abs(want).max())
    assert np.abs(dr - sr).max() > 1e-3 * np.abs(sr).max()  # Δ != 0 really rotated it


# ---- PIN ----------------------------------------------------------------------------------
def test_a_pinned_idle_session_keeps_its_kv_under_page_pressure(model):
    """Twelve pages; two idle sessions hold four each; a third session's turn needs five, so
    one idle session is offloaded. The least recently used one (A) is pinned: B goes instead,
    A keeps its slot and pages and its next turn reuses its whole cached prompt. Once unpinned,
    A is offloaded by LRU like any other. Without the pin (the control) A is the one to go."""
    for pinned in (True, False):
        eng = make(model, TIGHT)
        a, b, c, d = (eng.open_session() for _ in range(4))
        turn(eng, a, toks(30, 1))
        turn(eng, b, toks(30, 2))
        if pinned:
            eng.pin(a, 0, 5)
            assert eng.pins(a) == [(0, 5)]
        before = look(eng, a)
        turn(eng, c, toks(30, 3))
        if not pinned:  # the control: A, least recently used, is offloaded
            assert eng.sessions[a].seq is None and eng.sessions[b].seq is not None
            continue
        assert eng.sessions[b].seq is None and same(look(eng, a), before)
        r = turn(eng, a, [7, 8])
        assert r.stats.reused_tokens == before[2] == 31  # all of its cached prompt
        turn(eng, b, [9, 9])  # room for B: C (least recently used, unpinned) goes
        assert eng.sessions[c].seq is None and eng.sessions[a].seq is not None
        eng.unpin(a, 0, 5)
        assert eng.pins(a) == []
        with pytest.raises(ValueError, match="no pin"):
            eng.unpin(a, 0, 5)
        turn(eng, d, toks(30, 4))  # A is now the least recently used idle session
        assert eng.sessions[a].seq is None and eng.sessions[b].seq is not None
        assert eng.counters["offloads"] == 3


def test_a_turn_needing_pinned_kv_waits_for_others_then_fails_if_it_never_fits(model):
    """A pinned idle session holds four pages. B's turn fits only once C, running a long
    decode, finishes: B waits (queued) meanwhile, then runs beside A's untouched KV. A turn
    that would fit only by evicting pinned KV fails alone, with an error naming the pinned
    pages; once unpinned, the same turn runs."""
    eng = make(model, TIGHT)
    a, b, c = (eng.open_session() for _ in range(3))
    turn(eng, a, toks(30, 5))
    eng.pin(a, 2, 9)
    before = look(eng, a)
    rc = eng.submit(c, toks(10, 6), sampling=SamplingParams(20))
    eng.step()  # C admitted: it may still take 3 pages
    rb = eng.submit(b, toks(28, 7), sampling=SamplingParams(2))  # needs 5, only 4 available
    for _ in range(5):
        eng.step()
        assert rb.status == "queued" and rc.status == "decode"
    rb.result()
    assert rc.finished and rc.error is None and rb.error is None
    assert same(look(eng, a), before)

    eng = make(model, TIGHT)
    a, b = eng.open_session(), eng.open_session()
    turn(eng, a, toks(50, 8))  # 51 cached tokens: 7 pages
    eng.pin(a, 0, 51)
    r = eng.submit(b, toks(40, 9), sampling=SamplingParams(2))  # up to 7 pages; 5 unpinned
    eng.run_until_idle(max_steps=50)
    assert isinstance(r.error, RequestError) and "7 of them pinned" in str(r.error), r.error
    assert eng.sessions[a].seq is not None
    eng.unpin(a, 0, 51)
    assert turn(eng, b, toks(40, 9)).error is None
    assert eng.sessions[a].seq is None  # offloaded for it, now that it holds no pin


def test_pinned_sessions_holding_every_slot_do_not_wedge_a_turn(model):
    """Every sequence slot is held by a pinned idle session: a new session's turn can never
    get one (nothing runs to free one), so it must fail with a RequestError, as a turn that
    needs pinned pages does, not wait forever."""
    eng = make(model)
    *held, new = (eng.open_session() for _ in range(SHAPE["max_seqs"] + 1))
    for i, s in enumerate(held):
        turn(eng, s, toks(10, 20 + i))
        eng.pin(s, 0, 3)
    r = eng.submit(new, toks(10, 29), sampling=SamplingParams(2))
    for _ in range(20):
        eng.step()
    assert r.finished and isinstance(r.error, RequestError) and "pin" in str(r.error), r.status


def test_a_pinned_session_keeping_radix_pages_alive_does_not_wedge_a_turn(model):
    """P and Q share a 16-token prefix and prefill in the same step: the radix cache keeps P's
    pages for it, with Q's third page as their child. P closes; Q is pinned. Q's leaf (Q holds
    it) keeps P's two prefix pages unevictable though neither is in Q's page table. A turn the
    engine's pinned-page count says can fit (9 of 12 - 3 pinned) can then never find room: it
    must fail with a RequestError (or run), not wait forever with nothing running."""
    eng = make(model, TIGHT)
    p, q, r_ = (eng.open_session() for _ in range(3))
    system = toks(16, 23)
    rp = eng.submit(p, system + toks(8, 24), sampling=SamplingParams(1))
    rq = eng.submit(q, system + toks(8, 25), sampling=SamplingParams(1))
    eng.run_until_idle()
    assert rp.error is None and rq.error is None
    eng.close_session(p)
    eng.pin(q, 0, 4)
    r = eng.submit(r_, toks(62, 26), sampling=SamplingParams(2))  # up to 9 pages
    for _ in range(20):
        eng.step()
    assert r.finished, "the turn waits forever: nothing runs and nothing can be freed"
    assert r.error is None or isinstance(r.error, RequestError)


def test_a_pinned_radix_prefix_survives_eviction_until_unpinned(model):
    """X and Y close, leaving three pages each in the radix cache. X is pinned (`pin_prefix`):
    Z's turn, which needs Y's pages and X's, takes Y's only though X is the least recently
    used. Unpinned, X is an ordinary leaf again: the next pressure evicts it first. The control
    without the pin evicts X."""
    x_toks, y_toks = toks(24, 10), toks(24, 11)
    for pinned in (True, False):
        eng = make(model, TIGHT)
        x, y, z, w = (eng.open_session() for _ in range(4))
        turn(eng, x, x_toks, n=1)
        turn(eng, y, y_toks, n=1)
        eng.close_session(x)
        eng.close_session(y)
        if pinned:
            assert eng.pin_prefix(x_toks + [1, 2]) == 24  # the cached whole pages of it
            assert eng.pin_prefix([5, 5]) == 0  # nothing cached
        turn(eng, z, toks(60, 12))  # up to 9 pages: 6 free, three must be evicted
        if not pinned:
            assert eng.radix.peek(x_toks)[1] == 0 and eng.radix.peek(y_toks)[1] == 24
            continue
        assert eng.radix.peek(x_toks)[1] == 24 and eng.radix.peek(y_toks)[1] == 0
        z_toks = list(eng.sessions[z].tokens)
        eng.close_session(z)
        assert eng.unpin_prefix(x_toks) == 24
        with pytest.raises(ValueError, match="not pinned"):
            eng.unpin_prefix(x_toks)
        turn(eng, w, toks(10, 13))  # up to 3 pages, 2 free: the oldest leaf (X) goes
        assert eng.radix.peek(x_toks)[1] == 0 and eng.radix.peek(z_toks)[1] == 56


def test_directives_that_cut_into_a_pin_fail_and_change_nothing(model):
    """A pinned span (10, 20): a directive that deletes, replaces or inserts inside it fails its
    turn with DirectiveError (explicit, in either mode, alone or in a batch; or a whole-prompt
    edit of a pinned token) and leaves the session as it was; one that only touches tokens
    around it applies and shifts the pin; `override_pin=True` applies and drops the pin."""
    eng = make(model)
    s = eng.open_session()
    turn(eng, s, toks(40, 14))
    eng.pin(s, 10, 20)
    with pytest.raises(DirectiveError):
        eng.pin(s, 30, 50)  # past the session's 42 tokens
    cutting = [
        [Directive(15, 25, (3,))],
        [Directive(19, 20, ())],
        [Directive(12, 12, (4, 4))],  # an insertion strictly inside
        [Directive(5, 11, (), Mode.FORGET)],
        [Directive(2, 4, (9,)), Directive(18, 30, ())],  # one of a batch: none applies
    ]
    for ds in cutting:
        before = look(eng, s)
        r = eng.submit(s, [1], directives=ds)
        eng.run_until_idle()
        assert isinstance(r.error, DirectiveError) and "pinned" in str(r.error), (ds, r.error)
        assert same(look(eng, s), before), ds
    before = look(eng, s)
    prompt = list(before[0])
    prompt[14] = (prompt[14] + 1) % 256
    r = eng.submit_prompt(s, prompt + [1])
    eng.run_until_idle()
    assert isinstance(r.error, DirectiveError) and same(look(eng, s), before)

    turn(eng, s, [1], directives=[Directive(2, 5, (7,))])  # before it: shifted by -2
    assert eng.pins(s) == [(8, 18)]
    turn(eng, s, [1], directives=[Directive(8, 8, (6, 6, 6)), Directive(18, 19, ())])
    assert eng.pins(s) == [(11, 21)]  # insertion at its start, deletion at its end
    pinned = eng.sessions[s].tokens[11:21]
    turn(eng, s, [2], directives=[Directive(30, 33, ())])  # after it: unchanged
    assert eng.pins(s) == [(11, 21)] and eng.sessions[s].tokens[11:21] == pinned
    now = eng.sessions[s].tokens
    eng.submit_prompt(s, now[:3] + now[4:]).result()  # a whole prompt's edit before it
    assert eng.pins(s) == [(10, 20)] and eng.sessions[s].tokens[10:20] == pinned
    turn(eng, s, [3], directives=[Directive(12, 14, (5,), override_pin=True)])
    assert eng.pins(s) == []
    assert eng.sessions[s].tokens[10:19] == pinned[:2] + [5] + pinned[4:]


def test_resending_the_same_prompt_keeps_a_pin_on_its_last_token(model):
    """A whole prompt equal to the session's tokens edits nothing, whatever is pinned: its
    turn re-feeds the last token (the engine's own means of getting logits), which must not
    count as cutting into a pin that covers it."""
    eng = make(model)
    s = eng.open_session()
    turn(eng, s, toks(20, 15))
    n = len(eng.sessions[s].tokens)
    eng.pin(s, 0, n)
    r = eng.submit_prompt(s, list(eng.sessions[s].tokens), sampling=SamplingParams(2))
    eng.run_until_idle()
    assert r.error is None, r.error
    assert eng.pins(s) == [(0, n)]


def test_a_whole_prompt_editing_only_around_a_pin_keeps_it(model):
    """Edits a few tokens either side of a pinned span (closer than edit detection's
    `MIN_KEEP`, which folds the short kept run between them into one edit) leave every pinned
    token as it is: the turn runs, and the pin stays on the same tokens."""
    eng = make(model)
    s = eng.open_session()
    turn(eng, s, toks(40, 16))
    eng.pin(s, 10, 20)
    prompt = list(eng.sessions[s].tokens)
    pinned = prompt[10:20]
    prompt[8] = (prompt[8] + 1) % 256
    prompt[22] = (prompt[22] + 1) % 256
    r = eng.submit_prompt(s, prompt + [1], sampling=SamplingParams(2))
    eng.run_until_idle()
    assert r.error is None, r.error
    assert eng.pins(s) == [(10, 20)] and eng.sessions[s].tokens[10:20] == pinned


# ---- SCRATCH --------------------------------------------------------------------------------
A, R, B, C = toks(20, 40), toks(15, 41), toks(10, 42), toks(3, 43)


def test_scratch_span_leaves_the_session_and_its_kv_as_an_amortize_deletion(model):
    """`submit_prompt(A + R + B, scratch=R)`: after the turn the session holds A + B + output;
    the next turn re-sending A + B + output + C reuses every cached token (it feeds only the
    last output, known but never cached, and C), and decodes exactly what an engine gets from
    A + R + B then an explicit AMORTIZE deletion of R (the same splice on the same KV), and not
    what keeping R gives. The spliced KV never enters the radix cache (nothing of the session's
    path past A's first page); A + R + B's own prefill pages are clean and keyed by A + R + B."""
    outs = {}
    for how in ("scratch", "amortize", "kept"):
        eng = make(model)
        s = eng.open_session()
        scratch = [(len(A), len(A) + len(R))] if how == "scratch" else []
        r1 = eng.submit_prompt(s, A + R + B, scratch=scratch, sampling=SamplingParams(4))
        out1 = r1.result()
        if how == "scratch":
            assert eng.sessions[s].tokens == A + B + out1
            assert r1.stats.scratch_tokens == len(R)
            prompt = A + B + out1 + C
            r2 = eng.submit_prompt(s, prompt, sampling=SamplingParams(5))
            r2.result()
            st = r2.stats
            assert st.prompt_tokens == len(prompt)
            assert st.reused_tokens == len(prompt) - (len(C) + 1) and st.spliced_tokens == 0
            assert st.prefilled_tokens == len(C) + 1
            assert eng.radix.peek(eng.sessions[s].tokens)[1] <= len(A) // PS * PS
            assert eng.sessions[s].clean <= len(A)
            assert eng.radix.peek(A + R + B)[1] == len(A + R + B) // PS * PS
        elif how == "amortize":
            cut = Directive(len(A), len(A) + len(R))
            r2 = eng.submit(s, C, directives=[cut], sampling=SamplingParams(5))
            r2.result()
            assert r2.stats.spliced_tokens > 0
        else:
            r2 = eng.submit(s, C, sampling=SamplingParams(5))
            r2.result()
        outs[how] = (out1, r2.output)
    assert outs["scratch"] == outs["amortize"]
    assert outs["scratch"][0] == outs["kept"][0] and outs["scratch"][1] != outs["kept"][1]


def test_scratch_tags_remove_a_generated_block(model):
    """`scratch_tags=(open, close)`: the generated block from `open` through `close` leaves
    the session when the turn ends. A seeded sampled turn draws the same tokens alone or
    again, so the tags are chosen from a first run's output: the first token that occurs once
    opens, the next later token not seen since closes."""
    prompt = toks(12, 44)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    eng = make(model)
    g = eng.submit(eng.open_session(), prompt, sampling=params).result()
    i = next(k for k in range(1, 5) if g.count(g[k]) == 1)
    j = next(k for k in range(i + 2, len(g) - 1) if g[k] not in g[i + 1 : k])
    eng = make(model)
    s = eng.open_session()
    r = eng.submit(s, prompt, sampling=params, scratch_tags=([g[i]], [g[j]]))
    assert r.result() == g
    assert eng.sessions[s].tokens == prompt + g[:i] + g[j + 1 :]
    assert r.stats.scratch_tokens == j + 1 - i
    nxt = eng.submit_prompt(s, prompt + g[:i] + g[j + 1 :] + C, sampling=SamplingParams(2))
    nxt.result()
    assert nxt.stats.reused_tokens == nxt.stats.prompt_tokens - (len(C) + 1)


def test_scratch_spanning_every_cached_token(model):
    """A one-token turn whose whole prompt is scratch: every cached token goes, the one
    generated token (known, never cached) stays. The turn ends cleanly (no error out of the
    engine's step), the session holds just that token, and its next turn runs."""
    eng = make(model)
    s = eng.open_session()
    r = eng.submit_prompt(s, toks(12, 46), scratch=[(0, 12)], sampling=SamplingParams(1))
    out = r.result()
    assert r.error is None and eng.sessions[s].tokens == out
    assert r.stats.scratch_tokens == 12
    assert turn(eng, s, [1, 2]).error is None
    assert eng.sessions[s].tokens[:3] == out + [1, 2]


def test_bad_scratch_spans(model):
    """Spans out of range, empty or overlapping: `submit_prompt` refuses them at once
    (DirectiveError, nothing queued); `submit`, whose prompt is known when the turn runs,
    fails that turn and leaves the session as it was."""
    eng = make(model)
    s = eng.open_session()
    turn(eng, s, toks(10, 45))
    prompt = list(eng.sessions[s].tokens) + [1, 2]
    bad = [[(5, 100)], [(3, 3)], [(2, 6), (5, 8)], [(-1, 2)], [(1.5, 3)], [(True, 3)]]
    for spans in bad:
        with pytest.raises(DirectiveError):
            eng.submit_prompt(s, prompt, scratch=spans)
    assert not eng.table.queued
    for spans in bad:
        before = look(eng, s)
        r = eng.submit(s, [1, 2], scratch=spans)
        eng.run_until_idle()
        assert isinstance(r.error, DirectiveError), (spans, r.error)
        assert same(look(eng, s), before)
    with pytest.raises(ValueError):
        eng.submit(s, [1], scratch_tags=([1],))


def test_scratch_leaves_the_pages_a_running_turn_was_promised(model):
    """A 12-page pool: A's turn (10 prompt tokens, 38 to generate: 6 pages) and B's (31
    prompt tokens, one to generate) are admitted together; B finishes first, its three full
    pages also in the radix cache. Splicing B's scratch span out copies its kept KV into fresh
    pages while the radix keeps the old ones: more than the pool has beyond what A may still
    take, so the span stays (deferred) and A runs to its end. In a roomy pool the same span
    is spliced out."""
    for pages in (TIGHT, ROOMY):
        eng = make(model, pages)
        a, b = eng.open_session(), eng.open_session()
        ra = eng.submit(a, toks(10, 47), sampling=SamplingParams(38))
        prompt = toks(31, 48)
        rb = eng.submit_prompt(b, prompt, scratch=[(1, 2)], sampling=SamplingParams(1))
        eng.step()
        assert ra.status == "decode" and rb.finished  # both admitted, B done in one step
        eng.run_until_idle()
        assert ra.error is None and len(ra.output) == 38, ra.error
        assert rb.error is None
        if pages == TIGHT:
            assert eng.counters["scratch_deferred"] == 1
            assert eng.sessions[b].tokens == prompt + rb.output
        else:
            assert eng.counters["scratch_deferred"] == 0
            assert eng.sessions[b].tokens == prompt[:1] + prompt[2:] + rb.output


# ---- MOVE -----------------------------------------------------------------------------------
X = toks(30, 50)


def test_move_within_a_session(model):
    """The turn's new tokens repeat X[5:17], which the session holds: MOVE copies those 12
    tokens' KV (moved band bit-exact, rotated band by Δ = 29) instead of prefilling them, the
    counts still sum, and the turn decodes what the core decodes after the same MOVE
    (`ll.apply_directives` with the same sources). The moved KV is not a prefill's (the core's
    logits differ without the MOVE), it never enters the radix cache, and `Engine(move=False)`
    (the default) moves nothing."""
    new = [1, 2] + X[5:17] + [(X[17] + 1) % 256, 3, 4]
    for move in (False, True):  # the MOVE run last: the core reference below checks it
        eng = make(model, move=move)
        s = eng.open_session()
        o = turn(eng, s, X).output
        r = turn(eng, s, new, n=4)
        st = r.stats
        prompt = X + o + new
        assert st.reused_tokens + st.spliced_tokens + st.prefilled_tokens == len(prompt)
        if not move:
            assert st.moved_tokens == 0 and st.spliced_tokens == 0
            continue
        assert st.moved_tokens == st.spliced_tokens == 12 and st.reused_tokens == 31
        seq = eng.sessions[s].seq
        dst = rows(eng.state, slots(eng, seq, range(34, 46)))
        assert_moved_kv(model, dst, rows(eng.state, slots(eng, seq, range(5, 17))), 29)
        assert eng.radix.peek(eng.sessions[s].tokens)[1] <= 31 // PS * PS
        assert eng.sessions[s].clean <= 31

    state = core_state(model)
    state, _ = ll.prefill(model, state, 0, X)  # as the engine ran it: X, then o[0]
    state, _ = ll.prefill(model, state, 0, o[:1])
    d = Directive(31, 31, tuple(prompt[31:46]), Mode.MOVE, sources=(Source(3, 5, 12),))
    state, done = ll.apply_directives(model, state, 0, [d], report=True)
    assert done.moved == 12
    want, logits = greedy(model, state, 0, prompt[46:], 4)
    assert r.output == want
    plain = core_state(model)
    _, fresh = greedy(model, plain, 0, prompt, 1)
    assert np.abs(logits - fresh).max() > 1e-3 * np.abs(fresh).max()


def test_move_from_the_radix_cache_keeps_to_its_lineage(model):
    """A closed session of lineage "t" leaves X's pages in the radix cache. A new session of
    the same lineage whose prompt holds X[8:24] at position 5 moves those two pages (Δ = -3)
    instead of prefilling them, and decodes what the core decodes after the same MOVE from the
    same pages; its own pages never enter the radix cache. A session of another lineage (or
    of its own, the default) with the same prompt moves nothing from them, and neither does a
    session of lineage "t" whose turn turns MOVE off."""
    eng = make(model, move=True)
    a = eng.open_session(lineage="t")
    turn(eng, a, X + toks(4, 51), n=1)  # 34 cached: X[0:32] in four whole pages
    eng.close_session(a)
    pages, hit = eng.radix.peek(X + toks(4, 51))
    assert hit == 32
    prompt = toks(5, 52) + X[8:24] + toks(6, 53)
    off = eng.open_session(lineage="t")  # the same case with MOVE off for the turn
    r = turn(eng, off, toks(5, 56) + X[8:24] + toks(6, 57), n=1, move=False)
    assert r.stats.moved_tokens == r.stats.spliced_tokens == 0
    eng.close_session(off)
    b = eng.open_session(lineage="t")
    r = turn(eng, b, prompt, n=4)
    st = r.stats
    assert st.moved_tokens == st.spliced_tokens == 16 and st.reused_tokens == 0
    assert st.reused_tokens + st.spliced_tokens + st.prefilled_tokens == len(prompt)
    seq = eng.sessions[b].seq
    src = np.concatenate([pages[1] * PS + np.arange(PS), pages[2] * PS + np.arange(PS)])
    assert_moved_kv(model, rows(eng.state, slots(eng, seq, range(5, 21))), rows(eng.state, src), -3)
    assert eng.radix.peek(prompt)[1] == 0 and eng.sessions[b].clean == 0

    state = core_state(model)
    state, _ = ll.prefill(model, state, 0, X + toks(4, 51))
    row = np.asarray(state.page_table)[0]
    state = allocator.adopt(state, 1, [], [])
    srcs = (Source(5, 8, 8, pages=(int(row[1]),)), Source(13, 16, 8, pages=(int(row[2]),)))
    d = Directive(0, 0, tuple(prompt[:21]), Mode.MOVE, sources=srcs)
    state, done = ll.apply_directives(model, state, 1, [d], report=True)
    assert done.moved == 16
    assert r.output == greedy(model, state, 1, prompt[21:], 4)[0]

    # B's pages are not in the radix cache, X's are there to move (the second session reuses
    # the first one's clean prefill: exact prefixes are shared as before)
    for lineage in ("u", None):
        r = turn(eng, eng.open_session(lineage=lineage), prompt, n=1)
        assert r.stats.moved_tokens == r.stats.spliced_tokens == 0, lineage
    with pytest.raises(ValueError):
        eng.open_session(lineage=3)


def test_pages_a_move_session_left_in_both_caches_can_still_be_evicted(model):
    """A session that ran MOVE leaves its clean pages in the radix cache and in its lineage's
    private tree (one reference each). Closed, those pages belong to the caches alone: a turn
    that needs the whole pool must be able to evict them (it fits an empty pool), not wait
    forever because neither cache sees a page only it references."""
    eng = make(model, TIGHT)
    a, b = eng.open_session(lineage="t"), eng.open_session()
    assert turn(eng, a, toks(30, 54), move=True).error is None
    eng.close_session(a)
    r = eng.submit(b, toks(75, 55), sampling=SamplingParams(2))  # up to 11 of the 12 pages
    for _ in range(10):
        eng.step()
    assert r.finished and r.error is None, (r.status, r.error)


# ---- DECAY ----------------------------------------------------------------------------------
def test_decay_through_submit(model):
    """DECAY(10, 30, (7, 7), budget=5) on a session of 42 tokens: its tokens become the prefix,
    the 5 span tokens `ll.decay_selection` picks from the session's KV (a subsequence of the
    span), the replacement, the rest; their KV is moved (counted as moved). A budget at least
    the span's width keeps it whole; budget 0 deletes it. A DECAY over tokens the session does
    not cache (its last output; or an offloaded session) fails its turn with DirectiveError;
    inside a whole prompt it is refused at submit."""
    eng = make(model)
    s = eng.open_session()
    turn(eng, s, toks(40, 60))
    old = list(eng.sessions[s].tokens)
    kept = ll.decay_selection(model, eng.state, eng.sessions[s].seq, 10, 30, 5)
    assert len(kept) == 5 and kept == sorted(set(kept)) and all(10 <= p < 30 for p in kept)
    r = turn(eng, s, [1, 2], directives=[Directive(10, 30, (7, 7), Mode.DECAY, budget=5)])
    want = old[:10] + [old[p] for p in kept] + [7, 7] + old[30:] + [1, 2]
    assert eng.sessions[s].tokens[:-2] == want
    st = r.stats
    assert st.moved_tokens == 5
    assert st.reused_tokens + st.spliced_tokens + st.prefilled_tokens == st.prompt_tokens

    old = list(eng.sessions[s].tokens)
    turn(eng, s, [3], directives=[Directive(4, 8, (), Mode.DECAY, budget=9)])
    assert eng.sessions[s].tokens[: len(old)] == old  # all 4 kept, nothing replaced
    old = list(eng.sessions[s].tokens)
    turn(eng, s, [4], directives=[Directive(4, 8, (9,), Mode.DECAY, budget=0)])
    assert eng.sessions[s].tokens[: len(old) - 3] == old[:4] + [9] + old[8:]

    n = len(eng.sessions[s].tokens)  # the last output is known, not cached
    before = look(eng, s)
    r = eng.submit(s, [1], directives=[Directive(n - 2, n, (), Mode.DECAY, budget=1)])
    eng.run_until_idle()
    assert isinstance(r.error, DirectiveError) and "DECAY" in str(r.error)
    assert same(look(eng, s), before)
    with pytest.raises(DirectiveError, match="DECAY"):
        eng.submit_prompt(
            s, before[0] + [1], directives=[Directive(2, 6, (), Mode.DECAY, budget=1)]
        )
    eng.table.offload(eng.sessions[s])
    r = eng.submit(s, [1], directives=[Directive(2, 6, (), Mode.DECAY, budget=1)])
    eng.run_until_idle()
    assert isinstance(r.error, DirectiveError) and "DECAY" in str(r.error)


def test_kv_moved_from_radix_pages_stays_with_its_session(model):
    """KV a MOVE copied from radix pages was computed in another session's history: the
    session holding it never caches its non-clean KV for the lineage, so after it closes a
    new session of the lineage sending the same prompt reuses nothing of it (a FORGET of the
    source's history can then take it all back: the radix purge reaches the source pages,
    and no copy sits in a tree). KV a session moved within its own tokens still is cached for
    its lineage, and a session of its own lineage leaves no private tree behind."""
    eng = make(model, move=True)
    a = eng.open_session(lineage="t")
    turn(eng, a, X + toks(4, 51), n=1)
    eng.close_session(a)
    b = eng.open_session(lineage="t")
    prompt = toks(5, 52) + X[8:24] + toks(6, 53)
    r = turn(eng, b, prompt, n=4)
    assert r.stats.moved_tokens == 16
    again = list(eng.sessions[b].tokens)
    eng.close_session(b)
    r = turn(eng, eng.open_session(lineage="t"), again, n=1)
    assert r.stats.reused_tokens == 0, r.stats

    own = X + toks(2, 58) + X[4:20] + toks(3, 59)  # a run of its own tokens, moved
    for lineage in ("u", None):
        private = len(eng.cache_pages()) - len(eng.radix.pages())  # the private trees' pages
        c = eng.open_session(lineage=lineage)
        turn(eng, c, X, n=1)
        r = turn(eng, c, own[31:], n=1)
        assert r.stats.moved_tokens == 16, lineage
        kept = list(eng.sessions[c].tokens)
        eng.close_session(c)
        if lineage is None:  # its lineage is its own: nothing of it stays private
            assert len(eng.cache_pages()) - len(eng.radix.pages()) == private
        else:
            r = turn(eng, eng.open_session(lineage="u"), kept, n=1)
            assert r.stats.reused_tokens >= len(kept) // PS * PS - PS, r.stats


def test_callers_cannot_name_engine_pages_or_lineages(model):
    """A MOVE source in other pages (`Source.pages`) is the engine's to choose: `submit` and
    `submit_prompt` refuse one at once (DirectiveError, nothing queued); a lineage named like
    a session's own ("session:<id>") is refused by `open_session` (ValueError)."""
    eng = make(model)
    s = eng.open_session()
    turn(eng, s, toks(20, 61))
    n = len(eng.sessions[s].tokens)
    d = Directive(n, n, (1, 2), Mode.MOVE, sources=(Source(0, 0, 2, pages=(0,)),))
    with pytest.raises(DirectiveError, match="pages="):
        eng.submit(s, [1], directives=[d])
    with pytest.raises(DirectiveError, match="pages="):
        eng.submit_prompt(s, eng.sessions[s].tokens + [1, 2], directives=[d])
    assert not eng.table.queued
    with pytest.raises(ValueError, match="session:"):
        eng.open_session(lineage=f"session:{s}")


def test_explicit_directives_in_a_whole_prompt_keep_their_options(model):
    """`submit_prompt` with an explicit directive inside the session's tokens (the prompt
    extends them): the directive is spliced as given, its pin override too, so a pinned span
    it edits is edited (and unpinned) rather than the turn refused; without the override the
    turn fails and nothing changes."""
    eng = make(model)
    s = eng.open_session()
    turn(eng, s, toks(24, 62))
    eng.pin(s, 4, 10)
    prompt = list(eng.sessions[s].tokens) + [5, 6]
    before = look(eng, s)
    r = eng.submit_prompt(s, prompt, directives=[Directive(6, 8, (9,))])
    eng.run_until_idle()
    assert isinstance(r.error, DirectiveError) and "pinned" in str(r.error)
    assert same(look(eng, s), before)
    d = Directive(6, 8, (9,), override_pin=True)
    r = eng.submit_prompt(s, prompt, directives=[d], sampling=SamplingParams(1))
    eng.run_until_idle()
    assert r.error is None and r.stats.spliced_tokens > 0
    assert eng.sessions[s].tokens[:-1] == prompt[:6] + [9] + prompt[8:]
    assert eng.pins(s) == []
