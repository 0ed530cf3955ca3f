"""The two MLA attention forms on the paged cache: `ref_ragged_paged_mla` (long query tiles in the
expanded form, the rest absorbed) against a float64 dense attention, against the absorbed form
alone, and, through a model's paged prefill, against transformers; and the cost model
(`leyline_jax.mla.expanded_tiles`) that picks the expanded tiles.

The forms are one function: q_nope . (c W_kb^T) = (q_nope W_kb) . c, and the output
softmax(...) (c W_vb) = (softmax(...) c) W_vb. The float64 oracle is the absorbed dense attention
of `tests.test_ragged_paged_attention` with q_lat = q_nope W_kb, brought to value space by W_vb;
the tolerance is that file's (1e-5 of the output's scale).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import leyline_jax as ll
from leyline_jax import mla
from leyline_jax.loader import config_from_hf
from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention, ref_ragged_paged_mla
from tests.conftest import ALL_CONFIGS, random_tokens
from tests.test_parity import assert_logits_match
from tests.test_ragged_paged_attention import (
    MAX_CONTEXT,
    check,
    dense_attention,
    make_batch,
    mixes,
)

N, R, DR, DN, DV = 2, 8, 4, 6, 5


def weights(seed: int):
    rng = np.random.default_rng(seed)
    q_nope = rng.standard_normal((256, N, DN)).astype(np.float32)
    w_kb = rng.standard_normal((N, DN, R)).astype(np.float32) / np.sqrt(DN)
    w_vb = rng.standard_normal((N, R, DV)).astype(np.float32)
    return q_nope, w_kb, w_vb


def both_forms(batch, q_nope, w_kb, w_vb, scale, **kw):
    """f32[T, N, Dv]: `ref_ragged_paged_mla`'s two outputs combined as the model combines them."""
    q_lat = np.einsum("tnd,ndr->tnr", q_nope, w_kb)
    args = batch.args()
    o_v, o_lat = ref_ragged_paged_mla(
        q_nope, q_lat, *args[1:4], w_kb, w_vb, *args[4:], scale=scale, **kw
    )
    return np.asarray(o_v) + np.einsum("tnr,nrd->tnd", np.asarray(o_lat), w_vb), np.asarray(o_v)


def oracle(batch, q_nope, w_kb, w_vb, scale):
    """f64[T, N, Dv]: the dense absorbed attention of q_nope W_kb, through W_vb."""
    q_lat = np.einsum("tnd,ndr->tnr", q_nope.astype(np.float64), w_kb.astype(np.float64))
    out = dense_attention(dataclasses.replace(batch, q_lat=q_lat), scale)
    return np.einsum("tnr,nrd->tnd", out, w_vb.astype(np.float64))


@pytest.mark.parametrize("page_size", (1, 16))
@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_both_forms_match_dense_attention(page_size, data):
    """Ragged steps (decode rows, chunks of up to 40 queries, empty rows, padding) with tiles of
    16 and 8 queries expanded and the rest in absorbed tiles of 4 and 1."""
    rows, pad_tokens, scale, seed = data.draw(mixes(page_size))
    w, total = MAX_CONTEXT // page_size, sum(q for q, _ in rows) + pad_tokens
    t = 64 if total <= 64 else 256
    rng = np.random.default_rng(seed)
    kw = dict(page_size=page_size, n=N, r=R, dr=DR, t=t, w=w, p=6 * w + 4, pad_tokens=pad_tokens)
    batch = make_batch(rng, rows, **kw)
    q_nope, w_kb, w_vb = weights(seed)
    q_nope = q_nope[: batch.q_pe.shape[0]]
    got, o_v = both_forms(batch, q_nope, w_kb, w_vb, scale, expanded_tiles=(16, 8), q_tiles=(4, 1))
    event(f"an expanded tile: {bool(np.abs(o_v).max(initial=0) > 0)}")
    check(got, oracle(batch, q_nope, w_kb, w_vb, scale), batch.padding)


def test_expanded_and_absorbed_alone_equal_each_other():
    """Every query in expanded tiles (sizes 4 and 1, whole) against every query absorbed
    (`ref_ragged_paged_attention`, then W_vb): the two forms, 1e-5 apart; and the oracle."""
    rng = np.random.default_rng(3)
    batch = make_batch(
        rng,
        [(1, 300), (37, 900), (0, 40), (20, 20), (5, 513)],
        page_size=16,
        n=N,
        r=R,
        dr=DR,
        pad_tokens=3,
    )
    q_nope, w_kb, w_vb = weights(3)
    q_nope = q_nope[: batch.q_pe.shape[0]]
    expanded, o_v = both_forms(batch, q_nope, w_kb, w_vb, 0.5, expanded_tiles=(4, 1))
    q_lat = np.einsum("tnd,ndr->tnr", q_nope, w_kb)
    absorbed = ref_ragged_paged_attention(q_lat, *batch.args()[1:], scale=0.5)
    absorbed = np.einsum("tnr,nrd->tnd", np.asarray(absorbed), w_vb)
    assert (np.abs(o_v[~batch.padding]).max(axis=(1, 2)) > 0).all()  # every query expanded
    want = oracle(batch, q_nope, w_kb, w_vb, 0.5)
    check(expanded, want, batch.padding)
    check(absorbed, want, batch.padding)
    check(expanded, absorbed.astype(np.float64), batch.padding)


def test_a_wrong_expansion_fails():
    """The expanded tiles with two heads' K weights swapped (the absorbed tiles right) are caught
    by the same comparison: it can fail."""
    rng = np.random.default_rng(4)
    batch = make_batch(rng, [(24, 100), (1, 60)], page_size=4, n=N, r=R, dr=DR)
    q_nope, w_kb, w_vb = weights(4)
    q_nope = q_nope[: batch.q_pe.shape[0]]
    want = oracle(batch, q_nope, w_kb, w_vb, 1.0)
    check(both_forms(batch, q_nope, w_kb, w_vb, 1.0, expanded_tiles=(8,))[0], want, batch.padding)
    q_lat = np.einsum("tnd,ndr->tnr", q_nope, w_kb)
    args = batch.args()
    o_v, o_lat = ref_ragged_paged_mla(
        q_nope, q_lat, *args[1:4], w_kb[::-1], w_vb, *args[4:], scale=1.0, expanded_tiles=(8,)
    )
    wrong = np.asarray(o_v) + np.einsum("tnr,nrd->tnd", np.asarray(o_lat), w_vb)
    with pytest.raises(AssertionError, match="relative error"):
        check(wrong, want, batch.padding)


def test_the_cost_model():
    """Expanded where a tile's work per slot is lower: DeepSeek-V2/V3 widths (R 512, Dn = Dv =
    128) from 256 queries, never for decode or short chunks; at most two sizes, each within the
    step's tokens and the scores budget; larger ranks or head dims move the threshold."""
    v2 = config_from_hf(
        ALL_CONFIGS["deepseek_v2"]
        | dict(
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            v_head_dim=128,
            qk_rope_head_dim=64,
            num_attention_heads=16,
        )
    )
    assert [mla.expanded_tiles(t, v2) for t in (1, 8, 64, 128, 171)] == [()] * 5
    assert mla.expanded_tiles(256, v2) == (256,)
    assert mla.expanded_tiles(300, v2) == (256,)
    assert mla.expanded_tiles(1024, v2) == (1024, 512)
    assert mla.expanded_tiles(1 << 16, v2) == (2048, 1024)  # 16 heads x 2048 x 512 = 2**24
    many_heads = dataclasses.replace(v2, num_attention_heads=128)
    assert mla.expanded_tiles(4096, many_heads) == (256,)
    wide = dataclasses.replace(v2, qk_nope_head_dim=192, v_head_dim=256)  # GLM-4.7-Flash-like
    assert mla.expanded_tiles(256, wide) == () and mla.expanded_tiles(512, wide) == (512,)


def test_paged_prefill_takes_the_expanded_form_and_matches_transformers(
    hf_ckpt, hf_model, monkeypatch
):
    """A 150-token prompt in one step on the tiny DeepSeek-V2 (R 32, Dn 16, Dv 24: expanded
    from 64 queries) goes through expanded tiles and its logits equal transformers'."""
    import torch

    seen = []
    real = mla.ref_ragged_paged_mla

    def spy(*args, **kw):
        seen.append(kw["expanded_tiles"])
        return real(*args, **kw)

    monkeypatch.setattr(mla, "ref_ragged_paged_mla", spy)
    jax.clear_caches()
    path = hf_ckpt("deepseek_v2")
    model = ll.load_model(path)
    prompt = random_tokens(150, seed=6)
    state = ll.init_state(
        model.config,
        num_pages=20,
        page_size=16,
        max_seqs=1,
        max_step_tokens=256,
        kv_dtype=jnp.float32,
    )
    _, logits = ll.prefill(model, state, 0, prompt.tolist())
    jax.clear_caches()  # no program traced with the spy outlives the test
    assert seen and all(128 in t for t in seen), seen  # 150 queries: a tile of 128 expanded
    with torch.no_grad():
        want = hf_model(path)(torch.tensor(prompt, dtype=torch.long)[None]).logits[0, -1].numpy()
    assert_logits_match(np.asarray(logits), want)
