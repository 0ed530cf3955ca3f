"""The serving engine: batching invariance, radix sharing, lineage, FORGET purge, pool
exhaustion, bad turns, sampling, compile counts.

References: a session run alone through the engine (batching invariance), the full-sequence
forward of the model (greedy decoding of an unedited session), and a fresh prefill through the
functional core (lineage). fp32 cache and params, greedy: tokens must be identical.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_BUCKET_GROWTH

import leyline_jax as ll
from leyline_jax import directives as dv
from leyline_jax import paged, splice
from serve.engine import Engine, RequestError, SamplingParams
from serve.sampling import sample

PS = 8
SYSTEM = np.random.default_rng(7).integers(0, 256, 21).tolist()


@pytest.fixture(scope="module")
def models(np_ckpt):
    """Each tiny checkpoint's model, loaded once per module."""
    return functools.cache(lambda name: ll.load_model(np_ckpt(name)))


@pytest.fixture(scope="module")
def model(request, models):
    """deepseek_v3's tiny model, or the one a test names with `on_both_families`."""
    return models(getattr(request, "param", "deepseek_v3"))


# the engine's invariants run on both attention families (MLA and GQA)
on_both_families = pytest.mark.parametrize("model", ["deepseek_v3", "llama"], indirect=True)


def make_engine(model, **kw):
    args = dict(num_pages=256, page_size=PS, max_seqs=16, kv_dtype=jnp.float32)
    return Engine(model, **{**args, **kw})


def script(i: int):
    """Session i's turns: (new tokens, directives, max_new). Odd sessions splice mid-way
    (AMORTIZE), every third one also FORGETs; all share the system prompt."""
    rng = np.random.default_rng(100 + i)
    turns = [(SYSTEM + rng.integers(0, 256, 3 + i % 5).tolist(), [], 5)]
    edit = []
    if i % 2:
        edit.append(ll.Directive(22, 25, [9, 9]))
    if i % 3 == 0:
        edit.append(ll.Directive(27, 29, [], ll.Mode.FORGET))
    turns.append((rng.integers(0, 256, 4).tolist(), edit, 4))
    turns.append((rng.integers(0, 256, 2).tolist(), [], 3))
    return turns


def run_sessions(engine, ids):
    """Drive sessions `ids` concurrently, turn by turn; returns {i: [outputs per turn]}."""
    sids = {i: engine.open_session() for i in ids}
    outs = {i: [] for i in ids}
    for turn in range(3):
        reqs = {}
        for i in ids:
            toks, ds, n = script(i)[turn]
            reqs[i] = engine.submit(
                sids[i], toks, directives=ds, sampling=SamplingParams(max_new_tokens=n)
            )
        engine.run_until_idle()
        for i in ids:
            outs[i].append(reqs[i].result())
    return outs


def check_refcounts(engine):
    """Every page's refcount = references from open sequences' page tables + the radix tree."""
    st = engine.state
    rc = np.asarray(st.refcount)
    want = np.zeros_like(rc)
    pt, ln, act = np.asarray(st.page_table), np.asarray(st.lengths), np.asarray(st.active)
    for q in np.flatnonzero(act):
        for p in pt[q, : -(-int(ln[q]) // st.page_size)]:
            want[p] += 1
    for p in engine.radix.pages():
        want[p] += 1
    np.testing.assert_array_equal(rc, want)


@functools.cache
def _alone(model):
    return {i: run_sessions(make_engine(model), [i])[i] for i in range(16)}


@pytest.fixture(scope="module")
def alone(model):
    """Each scripted session run by itself."""
    return _alone(model)


@on_both_families
def test_unedited_session_alone_equals_full_forward_greedy(model, alone):
    """The engine's own reference is right: session 2 (no edits) decodes what greedy decoding
    with the full-sequence forward gives."""
    seq = []
    for turn, (toks, ds, n) in enumerate(script(2)):
        assert not ds
        seq += toks
        for _ in range(n):
            seq.append(int(np.asarray(model(jnp.asarray(seq)))[-1].argmax()))
        assert alone[2][turn] == seq[len(seq) - n :]


@pytest.mark.parametrize(
    "model, c",
    [*(("deepseek_v3", c) for c in (1, 4, 8, 16)), ("llama", 16)],  # GQA: the widest batch
    indirect=["model"],
)
def test_batching_invariance(model, alone, c):
    engine = make_engine(model)
    outs = run_sessions(engine, list(range(c)))
    for i in range(c):
        assert outs[i] == alone[i], i
    check_refcounts(engine)
    if c > 1:  # the system prompt's full pages were prefilled once, then reused
        assert engine.counters["reused"] > 0


def test_shared_system_prompt_is_prefilled_once(model):
    engine = make_engine(model)
    first = engine.open_session()
    engine.submit(first, SYSTEM + [1], sampling=SamplingParams(max_new_tokens=1)).result()
    reqs = [
        engine.submit(engine.open_session(), SYSTEM + [2 + i], sampling=SamplingParams(1))
        for i in range(5)
    ]
    engine.run_until_idle()
    whole = len(SYSTEM) // PS * PS  # the system prompt's full pages
    for r in reqs:
        assert r.stats.reused_tokens == whole
        assert r.stats.prefilled_tokens == len(SYSTEM) + 1 - whole
    assert engine.counters["prefilled"] == len(SYSTEM) + 1 + 5 * (len(SYSTEM) + 1 - whole)
    check_refcounts(engine)


def test_counters_add_up(model):
    engine = make_engine(model)
    s = engine.open_session()
    r1 = engine.submit(s, list(range(40)), sampling=SamplingParams(max_new_tokens=3))
    r1.result()
    r2 = engine.submit(s, [5, 6], directives=[ll.Directive(10, 20, [1])])
    r2.result()
    st = r2.stats
    assert st.prompt_tokens == 43 - 10 + 1 + 2
    # the last output (known, never cached) is fed with the new tokens, not spliced
    assert (st.reused_tokens, st.spliced_tokens) == (10, 42 - 20)
    assert st.prefilled_tokens == 1 + 1 + 2
    assert st.ttft_s > 0 and st.latency_s >= st.ttft_s


@on_both_families
def test_lineage_spliced_kv_is_not_served_to_another_session(model):
    """A splices with AMORTIZE; B then sends A's edited token list as a fresh prompt: B gets
    a fresh prefill's logits (the radix hands it only A's clean prefix), not A's KV."""
    engine = make_engine(model)
    prompt = np.random.default_rng(3).integers(0, 256, 60).tolist()
    a = engine.open_session()
    engine.submit(a, prompt, sampling=SamplingParams(max_new_tokens=2)).result()
    ra = engine.submit(
        a, [4], directives=[ll.Directive(17, 30, [8, 8, 8])], sampling=SamplingParams(2)
    )
    ra.result()
    edited = engine.sessions[a].tokens[: ra.stats.prompt_tokens]
    b = engine.open_session()
    rb = engine.submit(b, edited, sampling=SamplingParams(max_new_tokens=1))
    rb.result()
    assert rb.stats.reused_tokens <= 17 // PS * PS  # nothing past A's first edited page
    # B's cache equals a fresh prefill of the edited list, A's spliced cache does not
    fresh = ll.init_state(
        model.config, num_pages=32, page_size=PS, max_seqs=1, kv_dtype=jnp.float32
    )
    fresh, want = ll.prefill(model, fresh, 0, edited)
    seq_b = engine.sessions[b].seq
    seq_a = engine.sessions[a].seq

    def logits_after(seq, token):
        engine.state, lg = paged.decode(model, engine.state, [seq], [token])
        return np.asarray(lg[0])

    fresh, want = paged.decode(model, fresh, [0], [rb.output[0]])
    got_b = logits_after(seq_b, rb.output[0])
    want = np.asarray(want[0])
    scale = np.abs(want).max()
    assert np.abs(got_b - want).max() <= 1e-4 * scale  # fp32: ~1e-6 measured
    # A's spliced KV (same tokens up to A's own generated ones) is measurably different
    a_tokens = engine.sessions[a].tokens
    assert a_tokens[: len(edited)] == edited
    fresh_a = ll.init_state(
        model.config, num_pages=32, page_size=PS, max_seqs=1, kv_dtype=jnp.float32
    )
    fresh_a, want_a = ll.prefill(model, fresh_a, 0, a_tokens)
    engine.state, got_a = paged.decode(model, engine.state, [seq_a], [a_tokens[-1]])
    # A's cache lacks its last generated token: compare A's logits after feeding it with the
    # fresh prefill of the whole list
    assert np.abs(np.asarray(got_a[0]) - np.asarray(want_a)).max() > 1e-3 * scale


@on_both_families
def test_forget_purges_the_radix_and_zeroes_released_pages(model):
    """After a FORGET of [21, 40): no slot of the pool still holds KV the old sequence had at
    positions >= 21 (computed with the evicted tokens), the pages the edit and the radix purge
    let go of are zero, and a request with the original tokens gets no cache hit past the span
    start."""
    engine = make_engine(model)
    prompt = np.random.default_rng(4).integers(0, 256, 64).tolist()
    a = engine.open_session()
    engine.submit(a, prompt, sampling=SamplingParams(max_new_tokens=2)).result()
    b0 = engine.open_session()  # another session shares A's prefix pages through the radix
    engine.submit(b0, prompt[:40] + [1], sampling=SamplingParams(1)).result()
    engine.close_session(b0)
    seq, start = engine.sessions[a].seq, 21

    def rows(state):  # last layer's moved band per slot (layer 0's depends on the token only)
        return np.asarray(state.moved)[-1].reshape(state.num_pages * state.page_size, -1)

    pt = np.asarray(engine.state.page_table[seq])
    slots = [pt[i // PS] * PS + i % PS for i in range(start, 64)]
    old = rows(engine.state)[slots].copy()
    pool = rows(engine.state)
    assert all((pool == row).all(axis=1).any() for row in old)  # the check below can fire
    released = set(pt[start // PS : -(-66 // PS)].tolist()) | set(engine.radix.pages())
    r = engine.submit(
        a,
        [3],
        directives=[ll.Directive(start, 40, [5], ll.Mode.FORGET)],
        sampling=SamplingParams(1),
    )
    r.result()
    pool = rows(engine.state)
    for row in old:
        assert not (pool == row).all(axis=1).any()
    rc = np.asarray(engine.state.refcount)
    free = [p for p in released if rc[p] == 0]  # what the purge and the cut let go of
    assert free and not np.asarray(engine.state.moved)[:, free].any()
    assert not np.asarray(engine.state.rotated)[:, free].any()
    check_refcounts(engine)
    b = engine.open_session()
    rb = engine.submit(b, prompt, sampling=SamplingParams(max_new_tokens=1))
    rb.result()
    assert rb.stats.reused_tokens <= start // PS * PS
    # B recomputed the original tokens' KV: to rounding (its chunks differ from A's, and on
    # some CPUs XLA's matmul blocking follows the chunk size), not bit for bit
    pool = rows(engine.state)
    near = np.abs(pool - old[-1]).max(axis=1) <= 1e-5 * np.abs(old[-1]).max()
    assert near.any()


def test_bad_directive_fails_that_turn_only(model):
    engine = make_engine(model)
    s, t = engine.open_session(), engine.open_session()
    engine.submit(s, list(range(30)), sampling=SamplingParams(2)).result()
    before = list(engine.sessions[s].tokens)
    bad = engine.submit(s, [1], directives=[ll.Directive(10, 99)])
    other = engine.submit(t, list(range(12)), sampling=SamplingParams(3))
    good = engine.submit(s, [2], sampling=SamplingParams(2))
    engine.run_until_idle()
    with pytest.raises(dv.DirectiveError):
        bad.result()
    assert engine.sessions[s].tokens[: len(before)] == before
    assert len(other.result()) == 3 and len(good.result()) == 2
    with pytest.raises(ValueError, match="outside"):
        engine.submit(s, [10**6])


@on_both_families
def test_pool_exhaustion_16_sessions(model, alone):
    """16 sessions on a pool far too small for all of them at once: nothing crashes, the one
    turn that can never fit fails with a clear error, every other turn completes with the
    tokens it gets alone, and the refcounts stay exact after every step."""
    # 192 slots; each session grows to ~40 tokens
    engine = make_engine(model, num_pages=24, max_seq_len=512)
    sids = {i: engine.open_session() for i in range(16)}
    huge = engine.submit(engine.open_session(), [t % 256 for t in range(300)])
    outs = {i: [] for i in range(16)}
    for turn in (0, 2):  # turns without edits: an offloaded session re-prefills exactly
        reqs = {}
        for i in range(16):
            toks = script(i)[turn][0]
            reqs[i] = engine.submit(sids[i], toks, sampling=SamplingParams(max_new_tokens=4))
        steps = 0
        while not engine.idle():
            engine.step()
            check_refcounts(engine)
            steps += 1
            assert steps < 2000
        for i in range(16):
            outs[i].append(reqs[i].result())
    with pytest.raises(RequestError, match="pages"):
        huge.result()
    ref = make_engine(model)
    for i in range(16):
        s = ref.open_session()
        want0 = ref.submit(s, script(i)[0][0], sampling=SamplingParams(4)).result()
        want2 = ref.submit(s, script(i)[2][0], sampling=SamplingParams(4)).result()
        assert outs[i] == [want0, want2], i
    assert engine.counters["offloads"] > 0 or engine.counters["radix_evicted_pages"] > 0


def test_sampling_is_per_row_and_respects_top_p():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
    t = jnp.asarray([0.0, 1.0, 1.0, 1.0])
    p = jnp.asarray([1.0, 1.0, 1e-6, 0.5])
    seed = jnp.asarray([0, 1, 2, 3], jnp.uint32)
    step = jnp.zeros(4, jnp.int32)
    out = np.asarray(sample(logits, t, p, seed, step))
    assert out[0] == int(np.argmax(logits[0]))  # greedy
    assert out[2] == int(np.argmax(logits[2]))  # a nucleus of one token
    # row 1 alone draws the same token as in the batch (key = seed, step)
    alone = np.asarray(sample(logits[1:2], t[1:2], p[1:2], seed[1:2], step[1:2]))
    assert alone[0] == out[1]
    # top-p 0.5 only ever draws from the smallest set with half the mass
    probs = np.asarray(jax_softmax(logits[3]))
    order = np.argsort(-probs)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1])
    draws = {
        int(sample(logits[3:4], t[3:4], p[3:4], seed[3:4], jnp.asarray([n], jnp.int32))[0])
        for n in range(40)
    }
    assert draws <= nucleus and len(draws) > 1


def jax_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def test_steady_state_never_recompiles(model):
    """A long mixed run (16 sessions, edits, sampling) compiles only in its first pass: the
    same workload again adds no compilation."""

    def counts():
        return paged.compile_counts() | splice.compile_counts() | {"sample": sample._cache_size()}

    run_sessions(make_engine(model), list(range(16)))
    before = counts()
    run_sessions(make_engine(model), list(range(16)))
    assert counts() == before


def test_stream_and_sampled_turns_are_batch_invariant(model):
    """Streaming yields the turn's tokens as they come; a sampled turn (temperature, top-p,
    seed) draws the same tokens alone and beside other sessions."""
    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.8, seed=11)
    prompt = np.random.default_rng(9).integers(0, 256, 19).tolist()

    def run(others: int):
        engine = make_engine(model)
        for i in range(others):
            engine.submit(engine.open_session(), prompt[: 5 + i], sampling=SamplingParams(7))
        r = engine.submit(engine.open_session(), prompt, sampling=params)
        streamed = list(r.stream())
        assert streamed == r.result()
        return streamed

    alone = run(0)
    assert run(5) == alone
    greedy = make_engine(model)
    g = greedy.submit(greedy.open_session(), prompt, sampling=SamplingParams(6)).result()
    assert alone != g  # the sampling path is really taken


def test_submit_prompt_derives_the_directives(model):
    """A whole edited prompt gives the turn explicit directives would give (same splice, same
    tokens out, same counters), in either mode; an unchanged prompt re-feeds its last token."""
    rng = np.random.default_rng(12)
    first = rng.integers(0, 256, 70).tolist()
    outs = {}
    for how in ("directive", "prompt"):
        engine = make_engine(model)
        s = engine.open_session()
        engine.submit(s, first, sampling=SamplingParams(2)).result()
        old = list(engine.sessions[s].tokens)
        new = old[:20] + [7, 7, 7] + old[45:] + [1, 2, 3]
        if how == "directive":
            r = engine.submit(s, [1, 2, 3], directives=[ll.Directive(20, 45, [7, 7, 7])])
        else:
            r = engine.submit_prompt(s, new)
        outs[how] = (r.result(), r.stats.spliced_tokens, r.stats.prefilled_tokens)
        assert engine.sessions[s].tokens[: len(new)] == new
        same = engine.submit_prompt(s, list(engine.sessions[s].tokens))
        same.result()
        assert same.stats.prefilled_tokens == 1
    assert outs["directive"] == outs["prompt"]
    # the cached tokens after the edit were spliced (the last output is fed, never cached)
    assert outs["prompt"][1] == 70 + 1 - 45


@pytest.mark.parametrize("mode", [ll.Mode.AMORTIZE, ll.Mode.FORGET])
def test_prompt_ending_like_the_cached_tokens(model, mode):
    """A new prompt whose last token is the session's last token (here: the previous output's
    last token after an inserted block) leaves edit detection no tail; the turn still feeds a
    token, and the session's tokens keep describing its cache. Its output equals a fresh
    session's for the same prompt (the edits end at the end: nothing downstream to rotate)."""
    rng = np.random.default_rng(13)
    first = rng.integers(0, 256, 40).tolist()
    engine = make_engine(model)
    s = engine.open_session()
    g = engine.submit(s, first, sampling=SamplingParams(4)).result()
    a = (g[-1] + 1) % 256
    new = first + rng.integers(0, 256, 30).tolist() + g[:-1] + [a, g[-1]]
    r = engine.submit_prompt(s, new, mode=mode, sampling=SamplingParams(4))
    out = r.result()
    st = r.stats
    assert st.prompt_tokens == len(new) and st.spliced_tokens == 0
    assert st.reused_tokens + st.prefilled_tokens == len(new)
    assert engine.sessions[s].tokens[: len(new)] == new
    fresh = make_engine(model)
    assert fresh.submit(fresh.open_session(), new, sampling=SamplingParams(4)).result() == out


def test_one_ragged_step_per_iteration(model, monkeypatch):
    """Every iteration runs one device step: a long session's prefill chunks ride with the
    short sessions' decode tokens (rows of different lengths, no grouping by shape), and each
    session decodes what it would decode alone."""
    calls = []
    rows = paged._rows

    def spy(state, seqs, blocks, *args, **kw):
        calls.append([len(b) for b in blocks])  # tokens per row of one step
        return rows(state, seqs, blocks, *args, **kw)

    monkeypatch.setattr(paged, "_rows", spy)
    engine = make_engine(model, prefill_chunk=64)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (300, 5, 6, 7)]
    sids = [engine.open_session() for _ in prompts]
    reqs = [
        engine.submit(s, p, sampling=SamplingParams(max_new_tokens=6))
        for s, p in zip(sids, prompts, strict=True)
    ]
    steps = 0
    while not engine.idle():
        before = len(calls)
        engine.step()
        steps += 1
        assert len(calls) - before <= 1  # one device step per iteration
    assert any(64 in c and 1 in c for c in calls)  # a prefill chunk beside decode tokens
    assert steps < 300 // 64 + 1 + 6 + 1
    monkeypatch.setattr(paged, "_rows", rows)
    for p, r in zip(prompts, reqs, strict=True):
        solo = make_engine(model, prefill_chunk=64)
        want = solo.submit(solo.open_session(), p, sampling=SamplingParams(max_new_tokens=6))
        assert r.result() == want.result()


def test_a_step_reads_only_the_sampled_tokens(model):
    """The bookkeeping is host data: prefills, decodes, AMORTIZE and FORGET edits, radix hits
    and evictions run with device-to-host transfers disallowed, except the sampled tokens the
    engine reads explicitly. On an accelerator the guard is shown to be real (reading the pools
    inside it raises); on CPU, where arrays already live in host memory, JAX's guard sees no
    transfer at all, so there `test_bookkeeping_needs_no_device` carries the proof."""
    engine = make_engine(model, num_pages=40)
    first = [engine.open_session() for _ in range(3)]
    with jax.transfer_guard_device_to_host("disallow"):
        reqs = [
            engine.submit(s, SYSTEM + [i] * (5 + 9 * i), sampling=SamplingParams(3))
            for i, s in enumerate(first)
        ]
        engine.run_until_idle()
        engine.submit(first[0], [7], directives=[ll.Directive(22, 25, [9, 9])]).result()
        engine.submit(first[1], [], directives=[ll.Directive(21, 30, (), ll.Mode.FORGET)]).result()
        engine.submit_prompt(first[2], SYSTEM + [5, 6]).result()
        if jax.default_backend() != "cpu":  # on CPU arrays are host memory: nothing to guard
            with pytest.raises(Exception, match="[Dd]isallowed"):
                np.asarray(engine.state.moved)
    assert all(len(r.result()) == 3 for r in reqs)


@pytest.fixture
def fed(monkeypatch):
    """Tokens each call of the ragged step (`paged.extend`) and of `paged.prefill` runs."""
    calls = {"extend": [], "prefill": []}
    extend, prefill = paged.extend, paged.prefill

    def spy_extend(model, state, seqs, blocks, **kw):
        calls["extend"].append(sum(len(b) for b in blocks))
        return extend(model, state, seqs, blocks, **kw)

    def spy_prefill(model, state, seq, tokens, *a, **kw):
        calls["prefill"].append(len(tokens))
        return prefill(model, state, seq, tokens, *a, **kw)

    monkeypatch.setattr(paged, "extend", spy_extend)
    monkeypatch.setattr(paged, "prefill", spy_prefill)
    return calls


@pytest.mark.parametrize("case", ["keeps_output", "deletes_output", "forget"])
def test_an_edited_turn_feeds_only_what_its_edit_keeps(model, fed, case):
    """The previous turn's last output is known but not cached. An edit is applied to the
    cached tokens alone: the output is fed with the turn's new tokens if the edit keeps it,
    never if it deletes it; a FORGET cuts and its re-prefill rides the ragged step (no
    separate prefill). One step per turn here: tokens through it = what the edit left."""
    engine = make_engine(model)
    s = engine.open_session()
    first = list(range(40))
    g = engine.submit(s, first, sampling=SamplingParams(1)).result()
    assert engine.sessions[s].tokens == first + g
    mode = ll.Mode.FORGET if case == "forget" else ll.Mode.AMORTIZE
    ds = [ll.Directive(10, 20, [1], mode)]
    if case == "deletes_output":
        ds.append(ll.Directive(40, 41, ()))
    fed["extend"].clear()
    r = engine.submit(s, [5, 6], directives=ds, sampling=SamplingParams(1))
    out = r.result()
    prompt = dv.apply_to_list(first + g, ds) + [5, 6]
    st = r.stats
    assert st.prompt_tokens == len(prompt)
    if case == "forget":
        assert (st.reused_tokens, st.spliced_tokens) == (10, 0)
        assert fed["extend"] == [len(prompt) - 10]
    else:
        assert (st.reused_tokens, st.spliced_tokens) == (10, 20)
        assert fed["extend"] == [len(prompt) - 31]  # [g, 5, 6] or [5, 6]
    assert st.prefilled_tokens == len(prompt) - st.reused_tokens - st.spliced_tokens
    assert fed["prefill"] == []
    if case == "forget":  # FORGET is exact: a fresh session of the edited prompt agrees
        fresh = make_engine(model)
        alone = fresh.submit(fresh.open_session(), prompt, sampling=SamplingParams(1))
        assert alone.result() == out
    check_refcounts(engine)


def test_reset_prefix_cache_empties_the_tree_only(model):
    """`reset_prefix_cache` drops the tree's references: pages only it held come back to the
    pool and a new session reuses nothing; an open session keeps its own KV."""
    engine = make_engine(model)
    kept, closed = engine.open_session(), engine.open_session()
    engine.submit(kept, SYSTEM + [1, 2], sampling=SamplingParams(2)).result()
    engine.submit(closed, list(range(100, 140)), sampling=SamplingParams(2)).result()
    engine.close_session(closed)
    assert len(engine.radix) > 0
    free = len(engine.state.refcount) - np.count_nonzero(engine.state.refcount)
    back = engine.reset_prefix_cache()
    assert back == 40 // PS  # the closed session's pages; the open one's stay held
    assert len(engine.radix) == 0
    assert len(engine.state.refcount) - np.count_nonzero(engine.state.refcount) == free + back
    check_refcounts(engine)
    other = engine.open_session()
    again = engine.submit(other, list(range(100, 140)), sampling=SamplingParams(2))
    again.result()
    assert again.stats.reused_tokens == 0
    nxt = engine.submit(kept, [3])
    nxt.result()
    assert nxt.stats.reused_tokens == len(SYSTEM) + 2 + 1  # its own KV, not the tree's
    engine.close_session(other)
    assert engine.reset_prefix_cache() == 40 // PS
    assert Engine(model, radix=False, num_pages=8).reset_prefix_cache() == 0


def test_turn_stats_serialise_whole(model):
    import dataclasses

    engine = make_engine(model)
    r = engine.submit(engine.open_session(), [1, 2, 3], sampling=SamplingParams(2))
    r.result()
    d = dataclasses.asdict(r.stats)
    assert d["ttft_s"] == r.stats.first_token_s - r.stats.submitted_s > 0
    assert d["latency_s"] == r.stats.finished_s - r.stats.submitted_s >= d["ttft_s"]


def _backend_compiles(into: list):
    """A listener that appends the name of every program XLA compiles to `into`."""

    def listen(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            into.append(kw.get("fun_name"))

    return listen


def test_warmup_compiles_every_shape_serving_meets(model):
    """After `warmup`, sessions of every size (a prompt longer than a chunk, decode beside
    prefill, up to max_seqs rows, an AMORTIZE splice and its fill, a FORGET's cut and purge)
    compile nothing: no ragged step, directive step or sampling shape (log-probabilities and
    penalties included), and no program at all (every compile XLA reports is counted). The
    pool size is this test's own, so no other test compiled these shapes; a turn on an engine
    not warmed up (another pool) compiles: the count can fail."""
    size = dict(num_pages=77, max_seqs=4, max_seq_len=160, prefill_chunk=32, bucket_growth=4)
    engine = make_engine(model, **size, max_num_batched_tokens=48)
    # steps of 1, 4, 16, 48 tokens; moves in blocks of 16, 48; zeroing and purging 1..64 pages
    assert engine.warmup() == len(engine.warmup_plan().names()) == 4 + 2 + 2 * 4
    compiled: list = []

    def counts():
        return paged.compile_counts(), splice.compile_counts(), sample._cache_size()

    def serve(engine):
        rng = np.random.default_rng(21)
        sids = [engine.open_session() for _ in range(4)]
        for n, s in zip((100, 3, 17, 40), sids, strict=True):
            asks = dict(logprobs=2) if n in (100, 17) else dict(presence_penalty=1.0)
            sp = SamplingParams(3, **asks)  # log-probabilities or penalties
            engine.submit(s, rng.integers(0, 256, n).tolist(), sampling=sp)
            engine.step()  # staggered arrivals: prefill chunks ride with decode rows
        engine.run_until_idle()
        engine.submit(sids[0], [1, 2], directives=[ll.Directive(5, 60, [4] * 9)]).result()
        forget = ll.Directive(3, 9, (), ll.Mode.FORGET)
        engine.submit(sids[2], [5], directives=[forget]).result()  # cut, purge, zeroing

    before = counts()
    listen = _backend_compiles(compiled)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        serve(engine)
        assert counts() == before
        assert compiled == []
        cold = make_engine(model, **size | {"num_pages": 78}, max_num_batched_tokens=48)
        cold.submit(cold.open_session(), [1, 2, 3], sampling=SamplingParams(2)).result()
        assert compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_the_default_shape_set_is_bounded(model):
    """The engine's default settings compile 30 shapes in all, whatever the pool's size: the
    step's token buckets up to max_num_batched_tokens (512), the splice's blocks of runs up to
    as many, and zeroing in blocks of up to 64 pages. A larger setting lists more; a coarser
    ladder fewer."""
    default = dict(bucket_growth=DEFAULT_BUCKET_GROWTH)  # the suite's own is coarser
    names = make_engine(model, num_pages=4096, **default).warmup_plan().names()
    assert len(names) == 10 + 6 + 2 * 7
    assert names[0] == "step of 1 tokens, 1 rows" and "step of 512 tokens, 16 rows" in names
    settings = dict(num_pages=64, max_num_batched_tokens=2048, **default)
    assert len(make_engine(model, **settings).warmup_plan().names()) == len(names) + 4
    coarse = make_engine(model, num_pages=4096, bucket_growth=4).warmup_plan().names()
    assert len(coarse) == 6 + 4 + 2 * 4  # 1, 4, 16, 64, 256, 512; 16, 64, 256, 512; 1..64
    assert "step of 512 tokens, 16 rows" in coarse and "step of 16 tokens, 16 rows" in coarse
