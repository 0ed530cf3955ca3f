"""Directives: validation, and exactness on tiny checkpoints of every family (MLA and GQA).

(a) AMORTIZE of a span by the same tokens leaves next-token logits as without an edit;
(b) FORGET equals a fresh prefill of the edited token list;
(c) AMORTIZE equals an independent reference built with Hugging Face PyTorch: its forward over
    prefix + replacement, plus the original run's cached downstream latent with the rope band
    re-rotated in float64 (exact Δ * inv_freq), fed back as its cache, then new tokens (GQA:
    the downstream K re-rotated per head in float64, V as cached);
(d) a splice of a forked sequence never changes the other sequence's logits.
fp32 params and storage; tolerance 1e-4 of max|logit| as everywhere (see test_parity.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import DECODERS, GQA_NAMES, MLA_NAMES, random_tokens
from test_parity import assert_logits_match, rel_err

import leyline_jax as ll
from leyline_jax import allocator
from leyline_jax.directives import apply_to_list, validate
from leyline_jax.splice import plan_splice

N = 300
NEW = [5, 6, 7]


def fresh_state(model, pages=128, page_size=16, seqs=3):
    return ll.init_state(
        model.config, num_pages=pages, page_size=page_size, max_seqs=seqs, kv_dtype=jnp.float32
    )


def run(model, tokens, directives, new=NEW, page_size=16, impl=None):
    state = fresh_state(model, page_size=page_size)
    state, _ = ll.prefill(model, state, 0, tokens)
    state = ll.apply_directives(model, state, 0, directives, impl=impl)
    edited = apply_to_list(tokens, directives)
    assert ll.tokens(state, 0) == edited
    state, logits = ll.prefill(model, state, 0, new)
    return state, np.asarray(logits)


# ---- (a) identity ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("page_size", [16, 7])
def test_amortize_same_tokens_is_identity(name, page_size, np_ckpt):
    model = ll.load_model(np_ckpt(name))
    toks = random_tokens(N, seed=1).tolist()
    base_state = fresh_state(model, page_size=page_size)
    base_state, _ = ll.prefill(model, base_state, 0, toks)
    _, base = ll.prefill(model, base_state, 0, NEW)
    _, got = run(model, toks, [ll.Directive(40, 90, toks[40:90])], page_size=page_size)
    # Δ = 0 rotations are the identity up to cos²+sin² rounding: a few ulps, far below 1e-4
    assert_logits_match(got, np.asarray(base))


def test_long_replacement_fills_in_chunks(np_ckpt):
    """A replacement longer than one step (the state's max_step_tokens, 128 here) is filled
    step by step; with nothing downstream, AMORTIZE then equals a fresh prefill of the edited
    list."""
    model = ll.load_model(np_ckpt("deepseek_v3"))
    toks = random_tokens(40, seed=4).tolist()
    rep = random_tokens(300, seed=5).tolist()
    state = ll.init_state(
        model.config,
        num_pages=40,
        page_size=16,
        max_seqs=1,
        kv_dtype=jnp.float32,
        max_seq_len=512,
        max_step_tokens=128,
    )
    state, _ = ll.prefill(model, state, 0, toks)
    state = ll.apply_directive(model, state, 0, ll.Directive(20, 40, rep))
    state, got = ll.prefill(model, state, 0, NEW)
    assert_logits_match(np.asarray(got), np.asarray(model(np.asarray(toks[:20] + rep + NEW)))[-1])


# ---- (b) FORGET -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize(
    "span", [(37, 120, [1, 2, 3]), (0, 10, []), (150, 150, [9] * 20), (290, 300, [4])]
)
def test_forget_equals_fresh_prefill(name, span, np_ckpt):
    model = ll.load_model(np_ckpt(name))
    toks = random_tokens(N, seed=2).tolist()
    start, end, rep = span
    _, got = run(model, toks, [ll.Directive(start, end, rep, ll.Mode.FORGET)])
    edited = toks[:start] + rep + toks[end:] + NEW
    assert_logits_match(got, np.asarray(model(np.asarray(edited)))[-1])


def test_forget_zeroes_released_pages(np_ckpt):
    model = ll.load_model(np_ckpt("deepseek_v2"))
    toks = random_tokens(100, seed=3).tolist()
    state = fresh_state(model, pages=16, page_size=16)
    state, _ = ll.prefill(model, state, 0, toks)
    old = np.asarray(state.page_table)[0, :7].copy()
    state = ll.apply_directive(model, state, 0, ll.Directive(20, 100, [], ll.Mode.FORGET))
    rc = np.asarray(state.refcount)
    released = old[2:]  # 20 tokens keep pages 0 and 1
    assert (rc[released] == 0).all()
    assert not np.asarray(state.moved)[:, released].any()
    assert not np.asarray(state.rotated)[:, released].any()
    # the kept partial page holds nothing past the cut either
    assert not np.asarray(state.moved)[:, old[1], 20 - 16 :].any()
    assert np.asarray(state.moved)[:, old[1], : 20 - 16].any()


# ---- (c) AMORTIZE against a Hugging Face reference ------------------------------------------
def hf_amortize_reference(hf, tokens, start, end, rep, new, interleaved):
    """HF logits after `new`, with a cache = HF's own prefix+replacement KV followed by the
    original run's downstream latent whose rope band is re-rotated in float64 by Δ."""
    cache = hf_amortize_cache(hf, tokens, start, end, rep, interleaved)
    with torch.no_grad():
        return hf(torch.tensor(new)[None], cache=cache, use_cache=True).logits[0, -1].numpy()


def hf_amortize_cache(hf, tokens, start, end, rep, interleaved):
    """The cache `hf_amortize_reference` reads: AMORTIZE's KV built in HF and float64."""
    from transformers import DynamicCache

    delta = len(rep) - (end - start)
    with torch.no_grad():
        orig = hf(torch.tensor(tokens)[None], use_cache=True).cache
        head = hf(torch.tensor(tokens[:start] + rep)[None], use_cache=True).cache
    inv = hf.model.rotary_emb.inv_freq.double().numpy()
    cache = DynamicCache(config=hf.config)
    for i in range(len(orig.layers)):
        c_down = orig.layers[i].keys[:, :, end:]
        k_down = orig.layers[i].values[:, :, end:].double().numpy()
        ang = delta * inv  # exact RoPE: R(p + Δ) = R(Δ) R(p)
        cos, sin = np.cos(ang), np.sin(ang)
        if interleaved:
            x1, x2 = k_down[..., 0::2], k_down[..., 1::2]
            rot = np.empty_like(k_down)
            rot[..., 0::2], rot[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        else:
            h = k_down.shape[-1] // 2
            x1, x2 = k_down[..., :h], k_down[..., h:]
            rot = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
        keys = torch.cat([head.layers[i].keys, c_down], 2)
        values = torch.cat([head.layers[i].values, torch.from_numpy(rot).float()], 2)
        cache.update(keys, values, i)
    return cache


@pytest.mark.parametrize("name", MLA_NAMES)
@pytest.mark.parametrize(
    "span",
    [(37, 120, [1, 2, 3]), (50, 60, list(range(100, 140))), (200, 200, [8] * 17), (10, 26, [])],
)
def test_amortize_matches_hf_reference(name, span, hf_ckpt, hf_model):
    path = hf_ckpt(name)
    model, hf = ll.load_model(path), hf_model(path)
    toks = random_tokens(N, seed=4).tolist()
    start, end, rep = span
    _, got = run(model, toks, [ll.Directive(start, end, rep)])
    ref = hf_amortize_reference(hf, toks, start, end, rep, NEW, interleaved=name == "deepseek_v2")
    assert_logits_match(got, ref)
    # and AMORTIZE is not FORGET here (the test can tell them apart)
    fresh = np.asarray(model(np.asarray(toks[:start] + rep + toks[end:] + NEW)))[-1]
    assert rel_err(got, fresh) > 1e-3


def hf_gqa_amortize_reference(hf, tokens, start, end, rep, new):
    """GQA: HF logits after `new`, with a cache = HF's own prefix+replacement K/V followed by
    the original run's downstream K re-rotated per head in float64 by Δ (halves pairs, as
    `rotate_half`) and its downstream V as cached."""
    cache = hf_gqa_amortize_cache(hf, tokens, start, end, rep)
    with torch.no_grad():
        return hf(torch.tensor(new)[None], cache=cache, use_cache=True).logits[0, -1].numpy()


def hf_gqa_amortize_cache(hf, tokens, start, end, rep):
    """The cache `hf_gqa_amortize_reference` reads."""
    from transformers import DynamicCache

    delta = len(rep) - (end - start)
    with torch.no_grad():
        orig = hf(torch.tensor(tokens)[None], use_cache=True).cache
        head = hf(torch.tensor(tokens[:start] + rep)[None], use_cache=True).cache
    ang = delta * hf.model.rotary_emb.inv_freq.double().numpy()
    cos, sin = np.cos(ang), np.sin(ang)
    cache = DynamicCache(config=hf.config)
    for i in range(len(orig.layers)):
        k_down = orig.layers[i].keys[:, :, end:].double().numpy()  # [1, G, S, D]
        h = k_down.shape[-1] // 2
        x1, x2 = k_down[..., :h], k_down[..., h:]
        rot = torch.from_numpy(np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1))
        keys = torch.cat([head.layers[i].keys, rot.float()], 2)
        values = torch.cat([head.layers[i].values, orig.layers[i].values[:, :, end:]], 2)
        cache.update(keys, values, i)
    return cache


@pytest.mark.parametrize("name", GQA_NAMES)
@pytest.mark.parametrize(
    "span",
    [(37, 120, [1, 2, 3]), (50, 60, list(range(100, 140))), (200, 200, [8] * 17), (10, 26, [])],
)
def test_gqa_amortize_matches_hf_reference(name, span, hf_ckpt, hf_model):
    path = hf_ckpt(name)
    model, hf = ll.load_model(path), hf_model(path)
    toks = random_tokens(N, seed=4).tolist()
    start, end, rep = span
    _, got = run(model, toks, [ll.Directive(start, end, rep)])
    assert_logits_match(got, hf_gqa_amortize_reference(hf, toks, start, end, rep, NEW))
    fresh = np.asarray(model(np.asarray(toks[:start] + rep + toks[end:] + NEW)))[-1]
    assert rel_err(got, fresh) > 1e-3  # AMORTIZE is not FORGET here: the test can tell


def test_gqa_reference_catches_an_unrotated_splice(hf_ckpt, hf_model, monkeypatch):
    """The GQA check can fail: a splice that moves K without rotating it (Δ ignored) is
    flagged by the reference."""
    from leyline_jax import splice

    path = hf_ckpt("llama")
    model, hf = ll.load_model(path), hf_model(path)
    toks = random_tokens(N, seed=4).tolist()
    ref = hf_gqa_amortize_reference(hf, toks, 37, 120, [1, 2, 3], NEW)
    real = splice.splice_pools
    monkeypatch.setattr(
        splice,
        "splice_pools",
        lambda pools, runs, *a, **k: real(pools, runs._replace(pos_to=runs.pos_from), *a, **k),
    )
    _, got = run(model, toks, [ll.Directive(37, 120, [1, 2, 3])])
    with pytest.raises(AssertionError):
        assert_logits_match(got, ref)


def test_batch_equals_sequential_left_to_right(np_ckpt):
    """An atomic batch in pre-batch coordinates = the same edits applied one by one from left
    to right (each in the coordinates the earlier ones left): every replacement attends to the
    edited text before it."""
    model = ll.load_model(np_ckpt("deepseek_v3"))
    toks = random_tokens(N, seed=5).tolist()
    batch = [
        ll.Directive(20, 30, [1, 2]),
        ll.Directive(100, 100, [3] * 9),
        ll.Directive(250, 290, []),
    ]
    _, together = run(model, toks, batch)
    state = fresh_state(model)
    state, _ = ll.prefill(model, state, 0, toks)
    shift = 0
    for d in batch:
        state = ll.apply_directive(
            model, state, 0, ll.Directive(d.start + shift, d.end + shift, d.replacement)
        )
        shift += d.delta
    state, apart = ll.prefill(model, state, 0, NEW)
    # downstream keys are rotated once by the summed Δ, or several times: rounding only
    assert rel_err(apart, together) <= 1e-5
    # right to left is a different edit (replacements would see unedited text before them)
    state = fresh_state(model)
    state, _ = ll.prefill(model, state, 0, toks)
    for d in reversed(batch):
        state = ll.apply_directive(model, state, 0, d)
    state, other = ll.prefill(model, state, 0, NEW)
    assert rel_err(other, together) > 1e-3


def test_kernel_interpret_path_matches_jnp(np_ckpt):
    model = ll.load_model(np_ckpt("glm4_moe_lite"))
    toks = random_tokens(80, seed=6).tolist()
    d = [ll.Directive(9, 30, [4, 4, 4])]
    s1, a = run(model, toks, d, impl="jnp")
    s2, b = run(model, toks, d, impl="interpret")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(s1.rotated), np.asarray(s2.rotated))


# ---- (d) forks ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [ll.Mode.AMORTIZE, ll.Mode.FORGET])
def test_splicing_a_fork_leaves_the_other_alone(mode, np_ckpt):
    model = ll.load_model(np_ckpt("deepseek_v2"))
    toks = random_tokens(150, seed=7).tolist()
    state = fresh_state(model)
    state, _ = ll.prefill(model, state, 0, toks)
    state = ll.fork(state, 0, 1)
    pages0 = np.asarray(state.page_table)[0, :10].copy()
    kv0 = np.asarray(state.moved)[:, pages0].copy(), np.asarray(state.rotated)[:, pages0].copy()
    state = ll.apply_directive(model, state, 1, ll.Directive(30, 60, [1, 2], mode))
    np.testing.assert_array_equal(np.asarray(state.page_table)[0, :10], pages0)
    np.testing.assert_array_equal(np.asarray(state.moved)[:, pages0], kv0[0])
    np.testing.assert_array_equal(np.asarray(state.rotated)[:, pages0], kv0[1])
    state, a = ll.decode(model, state, [0], [5])
    want = np.asarray(model(np.asarray(toks + [5])))[-1]
    assert_logits_match(np.asarray(a)[0], want)


# ---- bad input ------------------------------------------------------------------------------
def test_invalid_directives_leave_state_untouched(np_ckpt):
    model = ll.load_model(np_ckpt("deepseek_v2"))
    state = ll.init_state(
        model.config, num_pages=8, page_size=16, max_seqs=2, kv_dtype=jnp.float32, max_seq_len=512
    )
    state, _ = ll.prefill(model, state, 0, random_tokens(60).tolist())
    snap = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
    D = ll.Directive
    bad = [
        (ll.DirectiveError, 0, [D(10, 70)]),  # end past the sequence
        (ll.DirectiveError, 0, [D(-1, 3)]),
        (ll.DirectiveError, 0, [D(20, 10)]),  # inverted
        (ll.DirectiveError, 0, [D(5, 20), D(15, 30)]),  # overlapping
        (ll.DirectiveError, 0, [D(5, 5, [1]), D(5, 5, [2])]),  # ambiguous order
        (ll.DirectiveError, 1, [D(0, 1)]),  # not open
        (ll.DirectiveError, 9, [D(0, 1)]),  # out of range
        (ll.DirectiveError, 0, [D(0, 1, [256])]),  # outside the vocabulary
        (ll.DirectiveError, 0, [D(0, 1, [-2])]),
        (ll.DirectiveError, 0, ["not a directive"]),
        (ll.DirectiveError, 0, [D(0, 60, [])]),  # would empty the sequence
        (ll.DirectiveError, 0, [D(0, 1, [3] * 460)]),  # longer than max_seq_len
        (ll.OutOfPagesError, 0, [D(1, 2, [3] * 100)]),  # 4 pages + 7 fresh > 8
        (ll.OutOfPagesError, 0, [D(1, 2, [3] * 100, ll.Mode.FORGET)]),
    ]
    for err, seq, ds in bad:
        with pytest.raises(err):
            ll.apply_directives(model, state, seq, ds)
        for a, b in zip(jax.tree.leaves(state), snap, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.raises(ll.DirectiveError, match="mode"):
        D(0, 1, [], "amortize")
    with pytest.raises(ll.DirectiveError, match="int"):
        D(0.5, 1)
    with pytest.raises(ll.DirectiveError, match="replacement"):
        D(0, 1, [1.5])
    assert issubclass(ll.DirectiveError, ValueError)
    # no-ops change nothing and need no pages
    state = ll.apply_directives(model, state, 0, [D(3, 3)])
    for a, b in zip(jax.tree.leaves(state), snap, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def _host_state(model, row, used, p, length):
    """A 1-sequence state of `p` pages (page size 8) holding `length` tokens in `row`, with
    `used` pages referenced (the rest free); its pools are never read."""
    state = ll.init_state(model.config, num_pages=p, page_size=8, max_seqs=1, max_seq_len=56)
    refcount = np.zeros(p, np.int32)
    refcount[used] = 1
    state = state.replace(refcount=refcount)
    return allocator.set_sequence(state, 0, row, list(range(length)))


def test_plan_is_consistent(np_ckpt):
    """Host planning on its own: prefix pages kept, fresh pages the lowest free ones, every
    kept token moved to its new index."""
    model = ll.load_model(np_ckpt("deepseek_v3"))
    toks = list(range(40))  # page size 8: five pages
    ds = validate([ll.Directive(13, 17, [100, 101]), ll.Directive(20, 20, [7, 7, 7])], 40, 1000)
    p = 12  # pool size: "nowhere"
    row = np.array([3, 1, 4, 5, 11, p, p], np.int32)
    new = apply_to_list(toks, ds)
    free = [0, 2, 6, 7, 8, 10]
    state = _host_state(model, row, [q for q in range(p) if q not in free], p, 40)
    edit = allocator.plan_edit(state, 0, new, 40, 13, len(new))
    assert len(new) == 41 and allocator.seq_pages(edit.state, 0).tolist() == [3, 0, 2, 6, 7, 8]
    assert list(edit.row) == [3, 0, 2, 6, 7, 8, p]  # page 0 (tokens 0..7) is kept
    assert edit.state.refcount[[1, 4, 5, 11, 10]].tolist() == [0] * 5  # released; 10 unused
    plan = plan_splice(toks, row, edit.row, ds, 8)
    assert list(plan.pos_from) == [i for i in range(8, 40) if not 13 <= i < 17]
    for i, j, s, d in zip(plan.pos_from, plan.pos_to, plan.src, plan.dst, strict=True):
        assert new[j] == toks[i]
        assert s == row[i // 8] * 8 + i % 8 and d == edit.row[j // 8] * 8 + j % 8
    assert plan.fills == [(13, (100, 101)), (18, (7, 7, 7))]
    short = _host_state(model, row, [q for q in range(p) if q not in (0, 2)], p, 40)
    with pytest.raises(ll.OutOfPagesError):
        allocator.plan_edit(short, 0, new, 40, 13, len(new))


def test_apply_to_list_skips_a_noop_inside_another_span():
    """Found by the property test: validation drops no-ops before its overlap check, so a no-op
    inside a deletion is valid; the list semantics must ignore it too."""
    toks = list(range(10))
    ds = [ll.Directive(1, 1, []), ll.Directive(0, 2, [])]
    assert validate(ds, 10, 256) == [ll.Directive(0, 2, [])]
    assert apply_to_list(toks, ds) == list(range(2, 10))
