"""DECAY and MOVE on tiny checkpoints of both attention families (one MLA, one GQA).

(1) MOVE: each moved slot's moved band is the source slot's bit for bit, its rotated band the
    source's rotated in float64 by Δ = new position - old position (halves layout);
(2) MOVE to the same place is the identity; MOVE from other pages (`Source.pages`) equals the
    same MOVE from the sequence's own;
(3) DECAY: `importance.scores` against Hugging Face's own attention probabilities, `select`
    against a plain statement of its rules, DECAY keeping all / nothing against AMORTIZE;
(4) invalid DECAY / MOVE input raises DirectiveError before anything changes;
(5) lineage: no source at or after the batch's first FORGET.
fp32 params and storage; logits within 1e-4 of max|logit| (test_parity.py's bound).
"""

from __future__ import annotations

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import DECODERS, GQA_NAMES, MLA_NAMES, random_tokens
from test_parity import assert_logits_match, rel_err

import leyline_jax as ll
from leyline_jax import importance
from leyline_jax.directives import Applied, apply_to_list

MLA, GQA = "deepseek_v3", GQA_NAMES[0]  # MLA: YaRN frequencies, interleaved on disk
NAMES = (MLA, GQA)
assert MLA in MLA_NAMES and set(NAMES) <= set(DECODERS)
PAGE, MAX_LEN, N = 8, 128, 64
NEW = [5, 6, 7]
D, S, M = ll.Directive, ll.Source, ll.Mode

# Rotated band tolerance, relative to the slot's max|k|: the splice rotates from fp32 phases
# p * inv_freq of both absolute positions (p < MAX_LEN), each within half an ulp of a value below
# MAX_LEN * max(inv_freq) rad, so the angle is off by at most 2 * MAX_LEN * max(inv) * 2**-24
# (inv_freq <= 1: 1.5e-5); cos/sin and the rotation's products add a few ulps (16 * 2**-24). A
# rotation by a wrong Δ (off by one) is off by ~|2 sin(1/2)| = 0.96 in the fastest pair.
ROT_TOL = 2 * MAX_LEN * 2**-24 + 16 * 2**-24


@pytest.fixture(scope="module")
def lm(hf_ckpt):
    """Our model of a tiny Hugging Face checkpoint (one load per name in this module)."""
    return functools.cache(lambda name: ll.load_model(hf_ckpt(name)))


def fresh(model, *prompts):
    """A state holding each prompt as sequence 0, 1, ... (fp32 storage, pages of 8)."""
    state = ll.init_state(
        model.config,
        num_pages=48,
        page_size=PAGE,
        max_seqs=3,
        kv_dtype=jnp.float32,
        max_seq_len=MAX_LEN,
    )
    for i, p in enumerate(prompts):
        state, _ = ll.prefill(model, state, i, p)
    return state


def snapshot(state):
    return [np.asarray(x).copy() for x in jax.tree.leaves(state)]


def assert_unchanged(state, snap):
    for a, b in zip(snapshot(state), snap, strict=True):
        np.testing.assert_array_equal(a, b)


def read_slots(state, seq, positions):
    """Host copies of `seq`'s slots at `positions`: (moved [L, K, ...], rotated [L, K, ...]).
    Reads the whole pool (one shape to compile)."""
    pos = np.asarray(positions)
    bands = ll.paged.read_pages(state, np.arange(state.num_pages))
    page = state.page_table[seq][pos // PAGE]
    return tuple(x[:, page, pos % PAGE] for x in bands)


def rotate64(x, delta, inv):
    """x [L, K, (G,) Dr] in the halves layout rotated by delta[k] * inv in float64 (exact Δ)."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1] // 2
    ang = np.asarray(delta, np.float64)[:, None] * np.asarray(inv, np.float64)  # [K, Dr/2]
    ang = ang.reshape(len(delta), *([1] * (x.ndim - 3)), h)
    c, s = np.cos(ang), np.sin(ang)
    return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)


def assert_moved(model, before, after, delta):
    """Moved band bit-exact; rotated band = float64 rotation of the source's by Δ, per slot."""
    np.testing.assert_array_equal(after[0], before[0])
    assert model.config.rope_inv_freq().max() <= 1  # as ROT_TOL assumes
    want = rotate64(before[1], delta, model.config.rope_inv_freq())
    axes = tuple(i for i in range(want.ndim) if i != 1)
    err = np.abs(after[1] - want).max(axes) / np.abs(before[1]).max(axes)  # per slot
    assert err.max() <= ROT_TOL, f"rotated band off by {err.max():.2e} of max|k| > {ROT_TOL:.1e}"


def next_logits(model, state, seq=0):
    _, logits = ll.prefill(model, state, seq, NEW)
    return np.asarray(logits)


# ---- (1) MOVE exactness ---------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_move_copies_and_rotates_sources(name, lm):
    """Two sources (one downstream, one on a prefix page the splice keeps) and the kept
    downstream: each lands where the text says, moved bit-exact, rotated by its own Δ."""
    model = lm(name)
    toks = random_tokens(N, seed=1).tolist()
    rep = [7, 7, 7] + toks[40:50] + [9, 9, 9] + toks[3:7] + [11, 11, 11]
    d = D(20, 30, rep, M.MOVE, sources=[S(3, 40, 10), S(16, 3, 4)])
    state = fresh(model, toks)
    old = np.arange(N)
    before = read_slots(state, 0, old)
    state, applied = ll.apply_directives(model, state, 0, [d], report=True)
    assert ll.tokens(state, 0) == apply_to_list(toks, [d])
    assert applied == Applied(20, 34 + 14, 9, 77, moved=14)

    def group(src, dst):
        return [x[:, src] for x in before], read_slots(state, 0, dst), dst - src

    prefix = group(old[:16], old[:16])  # pages before the one holding `start`
    for b, a in zip(prefix[0], prefix[1], strict=True):
        np.testing.assert_array_equal(a, b)  # untouched
    groups = [
        group(old[16:20], old[16:20]),  # kept on the rebuilt page, Δ = 0
        group(old[40:50], 23 + np.arange(10)),  # Δ = -17
        group(old[3:7], 36 + np.arange(4)),  # Δ = +33
        group(old[30:], old[30:] + 13),  # downstream, Δ = len(rep) - 10
    ]
    for b, a, delta in groups:
        assert_moved(model, b, a, delta)
    # the check can fail: a rotation by the wrong Δ, or the wrong source slot
    b, a, delta = groups[1]
    with pytest.raises(AssertionError, match="rotated band"):
        assert_moved(model, b, a, delta + 1)
    with pytest.raises(AssertionError):
        assert_moved(model, [x[:, 1:] for x in b], [x[:, :-1] for x in a], delta[1:])


# ---- (2) identity; other pages --------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_move_in_place_is_identity(name, lm):
    """MOVE of [20, 30) onto itself leaves the next-token logits as without an edit; the same
    tokens moved from a copy at 44 (other preceding text) do not."""
    model = lm(name)
    toks = random_tokens(N, seed=2).tolist()
    toks[44:54] = toks[20:30]
    base = next_logits(model, fresh(model, toks))
    same = D(20, 30, toks[20:30], M.MOVE, sources=[S(0, 20, 10)])
    state, applied = ll.apply_directives(model, fresh(model, toks), 0, [same], report=True)
    assert ll.tokens(state, 0) == toks and applied.moved == 10
    assert_logits_match(next_logits(model, state), base)
    other = D(20, 30, toks[20:30], M.MOVE, sources=[S(0, 44, 10)])
    state = ll.apply_directives(model, fresh(model, toks), 0, [other])
    assert ll.tokens(state, 0) == toks
    assert rel_err(next_logits(model, state), base) > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_move_from_other_pages_equals_own(name, lm):
    """Sequence 1 holds the same prompt in its own pages (a separate prefill): a MOVE whose
    source names those pages gives sequence 0 the same KV and logits as one from its own."""
    model = lm(name)
    toks = random_tokens(N, seed=3).tolist()
    rep = [1, 1, 1] + toks[37:47] + [2, 2, 2]

    def edit(shift):  # source pages `shift` pages on from the ones holding 37..46
        state = fresh(model, toks, toks)
        first = 37 // PAGE + shift
        src = S(3, 37, 10, pages=tuple(state.page_table[1][first : first + 2]))
        other = read_slots(state, 1, np.arange(N))
        state, applied = ll.apply_directives(
            model, state, 0, [D(20, 30, rep, M.MOVE, sources=[src])], report=True
        )
        assert ll.tokens(state, 1) == toks  # the other sequence is left alone
        for a, b in zip(read_slots(state, 1, np.arange(N)), other, strict=True):
            np.testing.assert_array_equal(a, b)
        return state, applied

    state, applied = ll.apply_directives(
        model, fresh(model, toks), 0, [D(20, 30, rep, M.MOVE, sources=[S(3, 37, 10)])], report=True
    )
    want_kv, want = read_slots(state, 0, np.arange(N + 6)), next_logits(model, state)
    state, got_applied = edit(0)
    assert got_applied == applied and ll.tokens(state, 0) == apply_to_list(toks, [D(20, 30, rep)])
    for a, b in zip(read_slots(state, 0, np.arange(N + 6)), want_kv, strict=True):
        np.testing.assert_array_equal(a, b)
    assert_logits_match(next_logits(model, state), want)
    # the check can fail: the pages one page on hold other tokens' KV
    state, _ = edit(1)
    got = read_slots(state, 0, np.arange(23, 33))
    assert not np.array_equal(got[0], want_kv[0][:, 23:33])


# ---- (3) DECAY ------------------------------------------------------------------------------
def hf_attentions(hf, tokens):
    """HF's eager attention probabilities, one f64[N_heads, T, T] per layer."""
    with torch.no_grad():
        out = hf(torch.tensor(tokens)[None], output_attentions=True)
    assert len(out.attentions) == hf.config.num_hidden_layers
    return [a[0].double().numpy() for a in out.attentions]


@pytest.mark.parametrize("name", NAMES)
def test_scores_match_hf(name, lm, hf_ckpt, hf_model):
    """Independent rule 2: the probabilities of the last WINDOW query rows over every key,
    summed over rows, heads and layers."""
    model, hf = lm(name), hf_model(hf_ckpt(name))
    toks = random_tokens(N, seed=4).tolist()
    got = importance.scores(model, fresh(model, toks), 0)
    atts = hf_attentions(hf, toks)
    w = importance.WINDOW
    ref = sum(a[:, -w:].sum((0, 1)) for a in atts)
    assert got.shape == (N,) and rel_err(got, ref) <= 1e-4
    heads = hf.config.num_attention_heads * hf.config.num_hidden_layers
    assert got.sum() == pytest.approx(w * heads, rel=1e-5)  # each row sums to 1
    # the check can fail: the window one row earlier, or one layer left out, differs
    assert rel_err(sum(a[:, -w - 1 : -1].sum((0, 1)) for a in atts), ref) > 1e-2
    assert rel_err(ref - atts[-1][:, -w:].sum((0, 1)), ref) > 1e-2


def select_rule(span_scores, budget, pool=5):
    """Plain statement of rules 3-4: each score replaced by the mean of the `pool` around it
    (the span's end values repeated past its edges), then the `budget` best kept (equal means:
    the earlier token), in order. Exact arithmetic, so ties are ties."""
    n, h = len(span_scores), pool // 2
    vals = [Fraction(float(v)) for v in span_scores]
    mean = [sum(vals[min(max(i + j, 0), n - 1)] for j in range(-h, h + 1)) / pool for i in range(n)]
    best = sorted(range(n), key=lambda i: (-mean[i], i))
    return sorted(best[: max(0, min(budget, n))])


def test_select_follows_rules():
    """A hand-worked case, then random continuous scores (exact ties in their pooled means are
    vanishingly rare there; see the next test for ties)."""
    s = np.array([0.5, 1, 0.25, 8, 0, 0, 0, 0, 0, 3, 3, 3])
    # pooled sums (edge padded): 2.75 10.25 9.75 9.25 8.25 8 0 3 6 9 12 15
    assert importance.select(s, 3).tolist() == select_rule(s, 3) == [1, 10, 11]
    assert importance.select(s, 5).tolist() == select_rule(s, 5) == [1, 2, 3, 10, 11]
    assert importance.select(s, 40).tolist() == list(range(12))
    assert importance.select(s, 0).tolist() == importance.select(s[:0], 3).tolist() == []
    rng = np.random.default_rng(1)
    for _ in range(300):
        s = rng.random(int(rng.integers(1, 24))) * 10
        b = int(rng.integers(0, len(s) + 3))
        assert importance.select(s, b).tolist() == select_rule(s, b), (s.tolist(), b)


def test_select_breaks_exact_ties_by_position():
    """Rule 4 on exact ties: [2, 1, 2, 1, 1, 2] pools (edge padded: 2 2 | 2 1 2 1 1 2 | 2 2) to
    sums 9 8 7 7 8 8: the best is 0, then 1, 4 and 5 tie at 8 and the earlier, 1, wins."""
    assert select_rule([2, 1, 2, 1, 1, 2], 2) == [0, 1]
    assert importance.select(np.array([2.0, 1, 2, 1, 1, 2]), 2).tolist() == [0, 1]
    rng = np.random.default_rng(0)
    for _ in range(300):  # small integers: many exact ties
        s = rng.integers(0, 4, int(rng.integers(1, 16))).astype(np.float64)
        b = int(rng.integers(0, len(s) + 2))
        assert importance.select(s, b).tolist() == select_rule(s, b), (s.tolist(), b)


@pytest.mark.parametrize("name", NAMES)
def test_decay_keeps_all_or_nothing_like_amortize(name, lm):
    """budget >= width: the text and logits of an AMORTIZE insertion of the replacement at
    `end`; budget 0: those of an AMORTIZE deletion; in between: the tokens decay_selection
    picks, moved ahead of the replacement (Applied.kept)."""
    model = lm(name)
    toks = random_tokens(N, seed=5).tolist()
    rep = [7, 8, 9]
    for budget, like, kept in [
        (10, D(30, 30, rep), tuple(range(20, 30))),
        (15, D(30, 30, rep), tuple(range(20, 30))),
        (0, D(20, 30, rep), ()),
    ]:
        state, applied = ll.apply_directives(
            model, fresh(model, toks), 0, [D(20, 30, rep, M.DECAY, budget=budget)], report=True
        )
        assert applied.kept == kept and applied.moved == len(kept)
        assert ll.tokens(state, 0) == apply_to_list(toks, [like])
        want = next_logits(model, ll.apply_directives(model, fresh(model, toks), 0, [like]))
        assert_logits_match(next_logits(model, state), want)
    state = fresh(model, toks)
    pick = ll.decay_selection(model, state, 0, 20, 30, 4)
    assert len(pick) == 4 and pick == sorted(pick) and all(20 <= p < 30 for p in pick)
    state, applied = ll.apply_directives(
        model, state, 0, [D(20, 30, rep, M.DECAY, budget=4)], report=True
    )
    assert applied.kept == tuple(pick) and applied.moved == 4
    assert applied == Applied(20, 34 + 4, 3, N - 3, moved=4, kept=tuple(pick))
    assert ll.tokens(state, 0) == toks[:20] + [toks[p] for p in pick] + rep + toks[30:]
    # keeping 4 is not deleting (the check can tell them apart)
    assert rel_err(next_logits(model, state), want) > 1e-3


def test_decay_after_forget_resolves_as_text(lm):
    """A DECAY past the batch's FORGET is re-prefilled like everything after the cut: its text is
    the kept tokens and the replacement (no KV of it moves, so no source rule applies)."""
    model = lm(MLA)
    toks = random_tokens(N, seed=6).tolist()
    state = fresh(model, toks)
    pick = ll.decay_selection(model, state, 0, 30, 40, 3)
    batch = [D(5, 10, [1], M.FORGET), D(30, 40, [2], M.DECAY, budget=3)]
    state, applied = ll.apply_directives(model, state, 0, batch, report=True)
    text = toks[:5] + [1] + toks[10:30] + [toks[p] for p in pick] + [2] + toks[40:]
    assert ll.tokens(state, 0) == text and applied.kept == tuple(pick)
    assert_logits_match(next_logits(model, state), next_logits(model, fresh(model, text)))


# ---- (4) invalid input ----------------------------------------------------------------------
def test_invalid_verbs_raise_before_any_change(lm):
    model = lm(MLA)
    toks = random_tokens(N, seed=7).tolist()
    rep = toks[40:45]
    for make in [
        lambda: D(20, 30, [1], M.DECAY),  # DECAY without budget
        lambda: D(20, 30, [1], M.DECAY, budget=-1),
        lambda: D(20, 30, [1], M.DECAY, budget=2.0),
        lambda: D(20, 30, [1], M.DECAY, budget=True),
        lambda: D(20, 30, [1], budget=2),  # budget on AMORTIZE
        lambda: D(20, 30, rep, M.MOVE, budget=2, sources=[S(0, 40, 5)]),
        lambda: D(20, 30, rep, M.MOVE),  # MOVE without sources
        lambda: D(20, 30, rep, sources=[S(0, 40, 5)]),  # sources on AMORTIZE
        lambda: D(20, 30, rep, M.FORGET, sources=[S(0, 40, 5)]),
        lambda: D(20, 30, rep, M.MOVE, sources=[S(0, 40, 3), S(2, 42, 3)]),  # overlapping
        lambda: D(20, 30, rep, M.MOVE, sources=[S(3, 43, 2), S(0, 40, 2)]),  # out of order
        lambda: D(20, 30, rep, M.MOVE, sources=[S(1, 41, 5)]),  # leaves the replacement
        lambda: D(20, 30, rep, M.MOVE, sources=[S(0, 40, 0)]),  # empty
        lambda: D(20, 30, rep, M.MOVE, sources=[S(-1, 40, 2)]),
        lambda: D(20, 30, rep, M.MOVE, sources=[(0, 40, 5)]),  # not a Source
    ]:
        with pytest.raises(ll.DirectiveError):
            make()
    state = fresh(model, toks)
    snap = snapshot(state)
    free = int(np.flatnonzero(state.refcount == 0)[0])
    row = state.page_table[0]
    bad = [
        ("differ", [D(20, 30, [0] + rep, M.MOVE, sources=[S(1, 41, 5)])]),  # tokens[41:46]
        ("past", [D(20, 30, toks[N - 2 :] + [3, 4], M.MOVE, sources=[S(0, N - 2, 4)])]),
        ("FORGET", [D(5, 5, rep, M.MOVE, sources=[S(0, 40, 5)]), D(40, 50, [], M.FORGET)]),
        ("FORGET", [D(5, 5, rep, M.MOVE, sources=[S(0, 40, 5)]), D(42, 42, [1], M.FORGET)]),
        ("pages", [D(20, 30, rep, M.MOVE, sources=[S(0, 40, 5, pages=(free,))])]),
        ("pages", [D(20, 30, rep, M.MOVE, sources=[S(0, 40, 5, pages=(48,))])]),  # no such page
        ("pages", [D(20, 30, rep, M.MOVE, sources=[S(0, 38, 5, pages=(int(row[4]),))])]),  # 1 < 2
        (
            "overlap",
            [D(20, 30, rep, M.MOVE, sources=[S(0, 40, 5)]), D(25, 26, [], M.DECAY, budget=0)],
        ),
    ]
    for what, ds in bad:
        with pytest.raises(ll.DirectiveError) as e:
            ll.apply_directives(model, state, 0, ds)
        assert what in str(e.value), (what, e.value)
        assert_unchanged(state, snap)
    # a source in pages in use, as many as its positions span, applies
    ok = [D(20, 30, rep, M.MOVE, sources=[S(0, 40, 5, pages=(int(row[5]),))])]
    state = ll.apply_directives(model, state, 0, ok)
    assert ll.tokens(state, 0) == apply_to_list(toks, ok)


@pytest.mark.parametrize("pos", [44, 48])  # on the page the cut keeps in part / on one it frees
def test_own_pages_past_a_forget_are_not_read_zeroed(pos, lm):
    """A source naming the sequence's own pages past the batch's FORGET at 42: the FORGET frees
    (and zeroes) them before the splice reads them. Either the batch is refused, or the moved
    KV is the source's."""
    model = lm(MLA)
    toks = random_tokens(N, seed=8).tolist()
    state = fresh(model, toks)
    before = read_slots(state, 0, np.arange(pos, pos + 4))
    snap = snapshot(state)
    page = int(state.page_table[0][pos // PAGE])
    move = D(5, 5, toks[pos : pos + 4], M.MOVE, sources=[S(0, pos, 4, pages=(page,))])
    try:
        state = ll.apply_directives(model, state, 0, [move, D(42, N, [], M.FORGET)])
    except ll.DirectiveError:
        assert_unchanged(state, snap)
        return
    assert ll.tokens(state, 0) == toks[:5] + toks[pos : pos + 4] + toks[5:42]
    np.testing.assert_array_equal(read_slots(state, 0, np.arange(5, 9))[0], before[0])


# ---- (5) lineage ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_no_source_from_a_forget_on(name, lm):
    """After a FORGET of [20, 28), sources at >= 20 (inside the span, past it, straddling its
    start) are refused; one ending at 20 is taken, and the batch equals the MOVE then the FORGET
    one after the other (the FORGET shifted by the MOVE's Δ)."""
    model = lm(name)
    toks = random_tokens(N, seed=9).tolist()
    forget = D(20, 28, [1, 2, 3], M.FORGET)
    state = fresh(model, toks)
    snap = snapshot(state)
    for pos in (20, 24, 30, 18, 17):
        move = D(5, 7, toks[pos : pos + 4], M.MOVE, sources=[S(0, pos, 4)])
        with pytest.raises(ll.DirectiveError, match="FORGET"):
            ll.apply_directives(model, state, 0, [move, forget])
        assert_unchanged(state, snap)
    move = D(5, 7, toks[16:20], M.MOVE, sources=[S(0, 16, 4)])
    state, applied = ll.apply_directives(model, state, 0, [move, forget], report=True)
    assert ll.tokens(state, 0) == apply_to_list(toks, [move, forget]) and applied.moved == 4
    got = next_logits(model, state)
    state = ll.apply_directives(model, fresh(model, toks), 0, [move])
    state = ll.apply_directives(model, state, 0, [D(22, 30, [1, 2, 3], M.FORGET)])
    assert ll.tokens(state, 0) == apply_to_list(toks, [move, forget])
    assert_logits_match(got, next_logits(model, state))
