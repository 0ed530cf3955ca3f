"""`Directive.recompute`: a budget of downstream tokens run again after a splice, on tiny
checkpoints of every family (the three MLA families and GQA) and on SmolLM2.

(a) recompute 0 (an int or a float) is AMORTIZE, bit for bit (logits and KV);
(b) the whole downstream is FORGET: logits and every layer's KV within 1e-5 relative;
(c) a partial budget equals an independent Hugging Face PyTorch reference that starts from
    AMORTIZE's KV built in HF and float64 (tests/test_directives.py) and runs exactly the
    chosen tokens again, run by run, each over the cache before it; the same reference with
    the chosen tokens off by one at the border is told apart;
(d) the deviation CacheBlend's rule ranks by equals the distance between layer 1's KV after
    AMORTIZE and after FORGET (a fresh prefill's layer 1 reads the same layer 0);
(e) the choice: the border first, then whole blocks by score, exactly the budget;
(f) bad values refused by name before anything changes.
fp32 params and storage; tolerance 1e-4 of max|logit| for logits as everywhere.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import DECODERS, FAMILIES, random_tokens
from test_directives import hf_amortize_cache, hf_gqa_amortize_cache
from test_parity import assert_logits_match, rel_err

import leyline_jax as ll
from leyline_jax import paged, recompute
from leyline_jax.directives import DirectiveError

N = 300
NEW = [5, 6, 7]
EDIT = (37, 120, [1, 2, 3])  # tokens 37..120 replaced by 3: 180 downstream tokens


def state_for(model, pages=128):
    return ll.init_state(
        model.config, num_pages=pages, page_size=16, max_seqs=3, kv_dtype=jnp.float32
    )


def edited(model, tokens, directive, rule="deviation"):
    """(state after the edit, logits after NEW, Applied, the positions run again)."""
    seen = []
    real = paged.refill

    def spy(model, state, seq, runs, graph=None):
        seen.extend(p for a, b in runs for p in range(a, b))
        return real(model, state, seq, runs, graph)

    state, _ = ll.prefill(model, state_for(model), 0, tokens)
    paged.refill = spy
    try:
        state, done = ll.apply_directives(
            model, state, 0, [directive], report=True, recompute_rule=rule
        )
    finally:
        paged.refill = real
    kv = kv_of(state)
    state, logits = ll.prefill(model, state, 0, NEW)
    return kv, np.asarray(logits), done, seen


def kv_of(state, seq=0):
    """Every layer's two bands at the sequence's positions: (moved, rotated) [L, n, ...]."""
    n, ps = int(state.lengths[seq]), state.page_size
    pos = np.arange(n)
    pages, off = state.page_table[seq, pos // ps], pos % ps
    return tuple(np.asarray(band)[:, pages, off] for band in (state.moved, state.rotated))


def amortize(start, end, rep, recompute=0):
    return ll.Directive(start, end, rep, recompute=recompute)


# ---- (a) recompute 0 is AMORTIZE ------------------------------------------------------------
@pytest.mark.parametrize("zero", [0, 0.0])
def test_recompute_zero_is_amortize_bit_for_bit(zero, np_ckpt):
    model = ll.load_model(np_ckpt("deepseek_v3"))
    toks = random_tokens(N, seed=1).tolist()
    kv0, got0, done0, _ = edited(model, toks, amortize(*EDIT))
    kv1, got1, done1, seen = edited(model, toks, amortize(*EDIT, zero))
    assert not seen and done1.recomputed == 0 and done0 == done1
    assert np.array_equal(got0, got1)
    assert all(np.array_equal(a, b) for a, b in zip(kv0, kv1, strict=True))


# ---- (b) the whole downstream is FORGET -----------------------------------------------------
@pytest.mark.parametrize(
    "name, whole",
    [*((n, 1.0) for n in DECODERS), ("llama", 10_000)],  # a fraction, a count
)
def test_the_whole_downstream_is_forget(name, whole, np_ckpt):
    model = ll.load_model(np_ckpt(name))
    toks = random_tokens(N, seed=2).tolist()
    start, end, rep = EDIT
    kv, got, done, seen = edited(model, toks, amortize(*EDIT, whole))
    n = len(toks) - (end - start) + len(rep)
    assert seen == list(range(start + len(rep), n)) and done.recomputed == n - start - len(rep)
    forget = ll.Directive(start, end, rep, ll.Mode.FORGET)
    kv_f, want, _, _ = edited(model, toks, forget)
    assert rel_err(got, want) <= 1e-5
    for a, b in zip(kv, kv_f, strict=True):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    amortized = edited(model, toks, amortize(*EDIT))[1]
    assert rel_err(amortized, want) > 1e-3  # AMORTIZE differs here: the check can tell


# ---- (c) a partial budget against Hugging Face ----------------------------------------------
def hf_recomputed(hf, cache, tokens, positions, new):
    """HF logits after `new`, `cache` (AMORTIZE's, in HF) with the KV at `positions` of the
    edited `tokens` computed again: each contiguous run over the cache before it."""
    from transformers import DynamicCache

    for a, b in recompute.runs(sorted(positions)):
        head = DynamicCache(config=hf.config)
        for i, layer in enumerate(cache.layers):
            head.update(layer.keys[:, :, :a].clone(), layer.values[:, :, :a].clone(), i)
        with torch.no_grad():
            out = hf(torch.tensor(tokens[a:b])[None], cache=head, use_cache=True).cache
        for i, layer in enumerate(cache.layers):
            layer.keys[:, :, a:b] = out.layers[i].keys[:, :, a:b]
            layer.values[:, :, a:b] = out.layers[i].values[:, :, a:b]
    with torch.no_grad():
        return hf(torch.tensor(new)[None], cache=cache, use_cache=True).logits[0, -1].numpy()


def hf_cache(name, hf, toks):
    if name in FAMILIES:
        return hf_amortize_cache(hf, toks, *EDIT, interleaved=name == "deepseek_v2")
    return hf_gqa_amortize_cache(hf, toks, *EDIT)


@pytest.mark.parametrize(
    "name, rule",
    [*((n, "deviation") for n in DECODERS), ("deepseek_v2", "border"), ("llama", "border")],
)
def test_a_partial_budget_matches_hf(name, rule, hf_ckpt, hf_model):
    path = hf_ckpt(name)
    model, hf = ll.load_model(path), hf_model(path)
    toks = random_tokens(N, seed=4).tolist()
    start, end, rep = EDIT
    edited_toks = toks[:start] + rep + toks[end:]
    _, got, done, seen = edited(model, toks, amortize(*EDIT, 0.3), rule)
    first, k = start + len(rep), round(0.3 * (len(edited_toks) - start - len(rep)))
    assert len(seen) == k == done.recomputed and seen[: recompute.BORDER] == list(
        range(first, first + recompute.BORDER)
    )
    if rule == "border":
        assert seen == list(range(first, first + k))
    else:  # the blocks the deviation of AMORTIZE's KV ranks first
        state, _ = ll.prefill(model, state_for(model), 0, toks)
        state = ll.apply_directive(model, state, 0, amortize(*EDIT))
        state, dev = recompute.deviation(model, state, 0, first)
        assert seen == recompute.choose(first, len(edited_toks), k, dev)
    ref = hf_recomputed(hf, hf_cache(name, hf, toks), edited_toks, seen, NEW)
    assert_logits_match(got, ref)
    assert rel_err(got, hf_recomputed(hf, hf_cache(name, hf, toks), edited_toks, [], NEW)) > 1e-4


@pytest.mark.parametrize("name", ["deepseek_v2", "llama"])
def test_the_reference_tells_a_selection_off_by_one(name, hf_ckpt, hf_model):
    path = hf_ckpt(name)
    model, hf = ll.load_model(path), hf_model(path)
    toks = random_tokens(N, seed=4).tolist()
    start, end, rep = EDIT
    edited_toks = toks[:start] + rep + toks[end:]
    _, got, _, seen = edited(model, toks, amortize(*EDIT, 20), "border")
    assert seen == list(range(start + len(rep), start + len(rep) + 20))
    shifted = [p + 1 for p in seen]  # the border counted from the replacement's last token
    ref = hf_recomputed(hf, hf_cache(name, hf, toks), edited_toks, shifted, NEW)
    with pytest.raises(AssertionError):
        assert_logits_match(got, ref)
    assert_logits_match(got, hf_recomputed(hf, hf_cache(name, hf, toks), edited_toks, seen, NEW))


def test_smollm2_partial_budget_matches_hf(smollm2, smollm2_hf):
    """The trained model: 20% of the downstream by deviation against the HF reference."""
    toks = random_tokens(N, vocab=49152, seed=6).tolist()
    start, end, rep = EDIT
    edited_toks = toks[:start] + rep + toks[end:]
    _, got, _, seen = edited(smollm2, toks, amortize(*EDIT, 0.2))
    ref = hf_recomputed(
        smollm2_hf, hf_gqa_amortize_cache(smollm2_hf, toks, *EDIT), edited_toks, seen, NEW
    )
    assert_logits_match(got, ref)


# ---- (d) the deviation ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek_v3", "llama"])
def test_deviation_is_layer_ones_distance_from_forget(name, np_ckpt):
    model = ll.load_model(np_ckpt(name))
    toks = random_tokens(N, seed=3).tolist()
    start, end, rep = EDIT
    state, _ = ll.prefill(model, state_for(model), 0, toks)
    state = ll.apply_directive(model, state, 0, amortize(*EDIT))
    first = start + len(rep)
    state, dev = recompute.deviation(model, state, 0, first)
    spliced, fresh = kv_of(state), kv_of(_forget_state(model, toks))
    want = sum(
        ((x[1, first:] - y[1, first:]).reshape(len(dev), -1) ** 2).sum(-1)
        for x, y in zip(spliced, fresh, strict=True)
    )
    assert dev.shape == want.shape and np.all(want > 0)
    assert np.allclose(dev, want, rtol=1e-3, atol=1e-6 * want.max())
    assert not np.allclose(dev[1:], want[:-1], rtol=1e-3, atol=1e-6 * want.max())  # one off


def _forget_state(model, toks):
    state, _ = ll.prefill(model, state_for(model), 0, toks)
    return ll.apply_directive(model, state, 0, ll.Directive(*EDIT, ll.Mode.FORGET))


# ---- (e) the choice -------------------------------------------------------------------------
def test_the_border_then_whole_blocks_by_score_exactly_the_budget():
    b, blk = recompute.BORDER, recompute.BLOCK
    first, n = 100, 100 + b + 5 * blk
    scores = np.zeros(n - first)
    scores[b + 3 * blk + 2] = 5.0  # block 3 best
    scores[b + 1 * blk] = 1.0  # then block 1
    got = recompute.choose(first, n, b + blk + 4, scores)
    block3 = range(first + b + 3 * blk, first + b + 4 * blk)
    block1_part = range(first + b + blk, first + b + blk + 4)
    assert got == sorted([*range(first, first + b), *block3, *block1_part])
    assert recompute.choose(first, n, 10, scores) == list(range(first, first + 10))
    assert recompute.choose(first, n, 10_000, scores) == list(range(first, n))
    assert recompute.choose(first, n, b + 3, None) == list(range(first, first + b + 3))
    assert recompute.budget(0.15, 1000) == 150 and recompute.budget(1.0, 7) == 7
    assert recompute.budget(0.5, 3) == 2 and recompute.budget(40, 7) == 7


# ---- (f) bad values -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, why",
    [
        (-1, "recompute must be"),
        (1.5, "recompute as a fraction"),
        (float("nan"), "recompute as a fraction"),
        (True, "recompute must be"),
        ("10", "recompute must be"),
    ],
)
def test_bad_recompute_is_refused(bad, why):
    with pytest.raises(DirectiveError, match=why):
        ll.Directive(1, 2, [3], recompute=bad)


def test_recompute_is_amortize_and_moves_alone(np_ckpt):
    with pytest.raises(DirectiveError, match="recompute is AMORTIZE's and MOVE's"):
        ll.Directive(1, 2, [3], ll.Mode.FORGET, recompute=4)
    with pytest.raises(DirectiveError, match="recompute is AMORTIZE's"):
        ll.Directive(1, 2, [3], ll.Mode.DECAY, budget=1, recompute=0.5)
    model = ll.load_model(np_ckpt("llama"))
    toks = random_tokens(60, seed=5).tolist()
    state, _ = ll.prefill(model, state_for(model), 0, toks)
    batch = [amortize(1, 3, [4], 0.5), ll.Directive(20, 30, [], ll.Mode.FORGET)]
    with pytest.raises(DirectiveError, match="recompute in a batch with a FORGET"):
        ll.apply_directives(model, state, 0, batch)
    with pytest.raises(DirectiveError, match="recompute_rule must be one of"):
        ll.apply_directives(model, state, 0, [amortize(1, 3, [4], 0.5)], recompute_rule="x")
    assert ll.tokens(state, 0) == toks  # nothing changed


# ---- (g) the engine and HTTP ----------------------------------------------------------------
def engine_turns(model, recompute=None, mode=ll.Mode.AMORTIZE, default=0):
    """A session's two turns on an engine: 120 tokens, then the same history with tokens
    20..60 replaced by 3 and 4 new ones (`submit_prompt`: the edit is found by the diff).
    `default`: the engine's `recompute`. Returns (the history the session held before the
    edit, the second prompt, the second turn's first token's (log-probability, top 5), its
    stats)."""
    from serve.engine import Engine
    from serve.sampling import SamplingParams

    engine = Engine(
        model, num_pages=64, page_size=16, max_seqs=4, kv_dtype=jnp.float32, recompute=default
    )
    s = engine.open_session()
    first = random_tokens(120, seed=8).tolist()
    out = engine.submit(s, first, sampling=SamplingParams(3)).result()
    history = first + out
    prompt = history[:20] + [1, 2, 3] + history[60:] + [4, 5, 6, 7]
    r = engine.submit_prompt(
        s, prompt, mode=mode, sampling=SamplingParams(1, logprobs=5), recompute=recompute
    )
    r.result()
    return history, prompt, r.logprobs[0], r.stats


def library_top(model, history, prompt, recompute):
    """The library's answer to `engine_turns`' second turn: the cached history (its last
    output fed with the new tokens), the edit with `recompute`, then the rest: top-5 logprobs."""
    state, _ = ll.prefill(model, state_for(model), 0, history[:-1])
    state = ll.apply_directive(model, state, 0, amortize(20, 60, [1, 2, 3], recompute))
    rest = prompt[len(ll.tokens(state, 0)) :]
    _, logits = ll.prefill(model, state, 0, rest)
    lp = np.asarray(jax_log_softmax(np.asarray(logits, np.float64)))
    top = np.argsort(-lp, kind="stable")[:5]
    return [(int(t), float(lp[t])) for t in top]


def jax_log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.mark.parametrize("name", ["deepseek_v3", "llama"])
def test_an_engine_turn_recomputes_as_the_library(name, np_ckpt):
    model = ll.load_model(np_ckpt(name))
    history, prompt, (_, top), st = engine_turns(model, recompute=0.3)
    cached = len(history) - 1 - (60 - 20) + 3  # the edited history the KV holds
    assert st.recomputed_tokens == round(0.3 * (cached - 23)) > 0
    want = library_top(model, history, prompt, 0.3)
    assert [t for t, _ in top] == [t for t, _ in want]
    assert np.allclose([v for _, v in top], [v for _, v in want], atol=1e-4)
    plain = library_top(model, history, prompt, 0)
    assert not np.allclose([v for _, v in want], [v for _, v in plain], atol=1e-4)


def test_the_engine_default_and_the_whole_downstream(np_ckpt):
    model = ll.load_model(np_ckpt("llama"))
    _, _, by_turn, st = engine_turns(model, recompute=0.3)
    _, _, by_default, st_d = engine_turns(model, default=0.3)
    assert by_turn == by_default and st.recomputed_tokens == st_d.recomputed_tokens
    _, _, (_, whole), _ = engine_turns(model, recompute=1.0)
    _, _, (_, forget), _ = engine_turns(model, mode=ll.Mode.FORGET)
    assert [t for t, _ in whole] == [t for t, _ in forget]
    assert np.allclose([v for _, v in whole], [v for _, v in forget], atol=1e-5)
    with pytest.raises(DirectiveError, match="recompute as a fraction"):
        engine_turns(model, recompute=2.0)
    with pytest.raises(ValueError, match="recompute="):
        from serve.engine import EngineConfig

        EngineConfig(recompute=-1)


# ---- DECAY's reconstruct rule (KVzip) -------------------------------------------------------
REPEAT = [9, 8, 7, 6]  # the prompt asking for the repetition (any ids, for the reference)


@pytest.mark.parametrize("name", ["deepseek_v3", "llama"])
def test_reconstruct_scores_match_hf_attention(name, hf_ckpt, hf_model):
    """The reconstruct rule's scores equal Hugging Face's eager attention weights over the
    sequence, the prompt and the span repeated: per layer, the most any repeated token's
    query gives each span token (heads summed), summed over layers; the sequence's KV, pages
    and tokens as before."""
    from leyline_jax import importance

    path = hf_ckpt(name)
    model, hf = ll.load_model(path), hf_model(path)
    toks = random_tokens(120, seed=9).tolist()
    start, end = 30, 50
    state, _ = ll.prefill(model, state_for(model), 0, toks)
    before, refs = kv_of(state), np.asarray(state.refcount).copy()
    state, got = importance.reconstruction_scores(model, state, 0, start, end, REPEAT)
    assert ll.tokens(state, 0) == toks and np.array_equal(np.asarray(state.refcount), refs)
    assert all(np.array_equal(a, b) for a, b in zip(before, kv_of(state), strict=True))
    full = toks + REPEAT + toks[start:end]
    with torch.no_grad():
        att = hf(torch.tensor(full)[None], output_attentions=True).attentions
    q = slice(len(full) - (end - start), len(full))
    want = sum(a[0].sum(0)[q, start:end].max(0).values.double().numpy() for a in att)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-6)
    sums = sum(a[0].sum(0)[q, start:end].sum(0).double().numpy() for a in att)
    assert not np.allclose(got, sums, rtol=1e-2)  # the most, not the sum: the check can tell


def test_decay_by_reconstruction_keeps_what_the_scores_rank(np_ckpt):
    from leyline_jax import importance

    model = ll.load_model(np_ckpt("llama"))
    toks = random_tokens(120, seed=10).tolist()
    state, _ = ll.prefill(model, state_for(model), 0, toks)
    state, span = importance.reconstruction_scores(model, state, 0, 30, 50, REPEAT)
    want = [30 + int(i) for i in importance.select(span, 5)]
    d = ll.Directive(30, 50, [3], ll.Mode.DECAY, budget=5)
    state, done = ll.apply_directives(
        model, state, 0, [d], report=True, decay_rule="reconstruct", repeat=REPEAT
    )
    assert list(done.kept) == want
    assert ll.tokens(state, 0) == toks[:30] + [toks[p] for p in want] + [3] + toks[50:]
    with pytest.raises(DirectiveError, match="decay_rule must be one of"):
        ll.apply_directives(model, state, 0, [d], decay_rule="kvzip")


def test_reconstruct_checks_the_batch_before_it_scores(np_ckpt):
    """Everything the batch needs is checked before the reconstruct rule's fork runs on the
    device: a batch short of pages raises with the caller's state intact (usable after), and
    bad `repeat` ids are refused by name; a DECAY keeping all or none of its span is not
    scored."""
    model = ll.load_model(np_ckpt("llama"))
    toks = random_tokens(100, seed=11).tolist()
    state = ll.init_state(model.config, num_pages=9, page_size=16, max_seqs=3, kv_dtype=jnp.float32)
    state, _ = ll.prefill(model, state, 0, toks)  # 7 pages held, 2 free
    decay = ll.Directive(10, 20, [], ll.Mode.DECAY, budget=3)
    long = amortize(30, 31, list(range(40)))  # needs more pages than are free
    with pytest.raises(ll.OutOfPagesError):
        ll.apply_directives(model, state, 0, [decay, long], decay_rule="reconstruct", repeat=REPEAT)
    state, _ = ll.prefill(model, state, 0, [1, 2])  # the state was not donated: still usable
    with pytest.raises(DirectiveError, match="repeat must be token ids"):
        ll.apply_directives(model, state, 0, [decay], decay_rule="reconstruct", repeat=[10**6])
    for budget in (0, 10, 20):  # none, all, more than all: nothing to rank, nothing forked
        fresh, _ = ll.prefill(model, state_for(model), 0, toks)
        d = ll.Directive(40, 50, [3], ll.Mode.DECAY, budget=budget)
        _, done = ll.apply_directives(
            model, fresh, 0, [d], report=True, decay_rule="reconstruct", repeat=()
        )
        assert list(done.kept) == list(range(40, 40 + min(budget, 10)))
