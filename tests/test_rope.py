"""RoPE/YaRN: hand-worked cases, float64 numpy references, HF layouts, composition laws."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import ALL_CONFIGS, ALL_NAMES

import leyline_jax as ll
from leyline_jax import rope
from leyline_jax.loader import config_from_hf
from pallas_kernels.splice_rotate import splice_rotate_ref


def rope64_phase(x: np.ndarray, ph: np.ndarray, scale: float = 1.0):
    """float64 reference in the halves layout: pair (i, i + D/2) rotated by ph[..., i]."""
    x, ph = np.asarray(x, np.float64), np.asarray(ph, np.float64)
    c, s = np.cos(ph) * scale, np.sin(ph) * scale
    h = x.shape[-1] // 2
    return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)


def rope64(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0):
    ph = np.asarray(pos, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    return rope64_phase(x, ph, scale)


def test_hand_worked_quarter_turn():
    # head_dim 2, angle pi/2: (x, y) -> (x cos - y sin, y cos + x sin) = (-y, x)
    x = jnp.asarray([[3.0, 5.0]], jnp.float32)
    got = np.asarray(rope.rotate(x, jnp.asarray([[math.pi / 2]], jnp.float32)))
    np.testing.assert_allclose(got, [[-5.0, 3.0]], atol=1e-6)
    # apply_rope at position 1 with inv_freq pi/2 is the same quarter turn
    got = np.asarray(rope.apply_rope(x, jnp.asarray([1]), jnp.asarray([math.pi / 2])))
    np.testing.assert_allclose(got, [[-5.0, 3.0]], atol=1e-6)
    # the scale multiplies: a YaRN attention factor of 2 doubles the length
    got = np.asarray(rope.apply_rope(x, jnp.asarray([1]), jnp.asarray([math.pi / 2]), 2.0))
    np.testing.assert_allclose(got, [[-10.0, 6.0]], atol=1e-5)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_inv_freq_matches_hf(name, hf_ckpt, hf_model):
    model = hf_model(hf_ckpt(name))
    ours = config_from_hf(ALL_CONFIGS[name]).rope_inv_freq()
    ref = model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(ours, ref, rtol=2e-7)  # same fp32 ops: at most an ulp apart


def test_yarn_inv_freq_against_float64_formula():
    """The YaRN ramp written out independently in float64 (YaRN paper, eq. for theta'_d)."""
    cfg = ll.MLAConfig.from_hf(ALL_CONFIGS["deepseek_v2"])
    d, base, f, omax = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn_factor, 256
    theta = base ** -(np.arange(0, d, 2) / d)
    wavelen_rot = lambda r: d * math.log(omax / (r * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    lo, hi = max(math.floor(wavelen_rot(32)), 0), min(math.ceil(wavelen_rot(1)), d - 1)
    gamma = np.clip((np.arange(d // 2) - lo) / (hi - lo), 0, 1)  # 0: keep, 1: interpolate
    want = theta * (1 - gamma) + theta / f * gamma
    np.testing.assert_allclose(cfg.rope_inv_freq(), want, rtol=1e-6)
    assert (cfg.rope_inv_freq() < theta.astype(np.float32) * 0.99).any()  # YaRN changed something


@pytest.mark.parametrize("positions", [[0, 1, 7], [511, 4096, 100_000]])
def test_apply_rope_matches_float64(positions):
    cfg = ll.MLAConfig.from_hf(ALL_CONFIGS["deepseek_v3"])
    inv = cfg.rope_inv_freq()
    x = np.random.default_rng(0).standard_normal((len(positions), 16)).astype(np.float32)
    got = np.asarray(rope.apply_rope(jnp.asarray(x), jnp.asarray(positions), inv, cfg.rope_scale))
    # float64 reference evaluated at the fp32 phases the reference model uses
    ph32 = np.asarray(positions, np.float32)[:, None] * inv
    want = rope64_phase(x, ph32, cfg.rope_scale)
    # fp32 cos/sin at |phase| up to 1e5 rad: error ~ ulp(phase) reduction, well under 1e-5
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(x).max() * cfg.rope_scale)


def test_composition_laws():
    """R(a)R(b) = R(a+b) and R(a)R(-a) = I, with phases of both signs."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    a = jnp.asarray(rng.uniform(-50, 50, (64, 8)), jnp.float32)
    b = jnp.asarray(rng.uniform(-50, 50, (64, 8)), jnp.float32)
    ab = rope.rotate(rope.rotate(x, a), b)
    np.testing.assert_allclose(ab, rope.rotate(x, a + b), atol=2e-5)
    np.testing.assert_allclose(rope.rotate(rope.rotate(x, a), -a), x, atol=2e-5)
    # rotation is unit magnitude: pair norms are kept
    y = np.asarray(rope.rotate(x, a))
    np.testing.assert_allclose(
        np.hypot(y[:, :8], y[:, 8:]), np.hypot(x[:, :8], x[:, 8:]), rtol=1e-5
    )
    # and a wrong composition is detected (the check can fail)
    assert np.abs(np.asarray(ab) - np.asarray(rope.rotate(x, a - b))).max() > 1e-1


def test_splice_move_equals_embedding_at_new_position():
    """The model's embedding at p, moved p -> q by the splice kernel's reference, equals the
    model's embedding at q, with YaRN's attention factor applied once (the move is unit
    magnitude).

    "Embedding at q" is what the model caches: cos/sin of the fp32 phase q * inv_freq (at
    q ~ 9e4 that phase is itself ~4e-3 rad off the exact one; matching the model, not the exact
    value, is the point). Reference: float64 rotation by those fp32 phases."""
    cfg = ll.MLAConfig.from_hf(ALL_CONFIGS["deepseek_v2"])
    inv = cfg.rope_inv_freq()
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    p = jnp.asarray([0, 5, 300, 1000, 4000, 90_000])
    q = jnp.asarray([7, 0, 1324, 999, 2976, 91_024])
    at_p = rope.apply_rope(x, p, inv, cfg.rope_scale)
    zeros = jnp.zeros((1, 6, 1), jnp.float32)  # the band that moves unrotated: unused here
    _, moved = splice_rotate_ref(zeros, at_p[None], jnp.arange(6), jnp.arange(6), p, q, inv)
    moved = moved[0]
    want = rope64_phase(np.asarray(x), np.asarray(rope.phases(q, inv)), cfg.rope_scale)
    # fp32 cos/sin and products on O(1) values: a few 1e-7 relative, bound 1e-5
    np.testing.assert_allclose(moved, want, atol=1e-5 * cfg.rope_scale * float(jnp.abs(x).max()))
    # the shortcuts are not the same at long positions: rotating by delta * inv_freq, or by the
    # fp32 difference of the two phases, both miss the fp32 phase the model would have used
    for phase in (
        (q - p).astype(jnp.float32)[:, None] * inv,
        rope.phases(q, inv) - rope.phases(p, inv),
    ):
        shortcut = np.asarray(rope.rotate(at_p, phase))
        assert np.abs(shortcut - want).max() > 1e-5 * float(jnp.abs(x).max())


def test_deinterleave_matches_hf_layouts():
    """Our halves layout on permuted inputs equals HF's V2 complex (interleaved in, interleaved
    out) and V3 interleave (interleaved in, halves out) paths; without the permutation it does
    not."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    d, t = 16, 40
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 1, t, d)).astype(np.float32)  # [B, heads, T, D], interleaved
    inv = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    pos = np.arange(t) * 13
    ph = pos[:, None].astype(np.float32) * inv  # [T, D/2]
    perm = rope.deinterleave_perm(d)
    ours = np.asarray(rope.apply_rope(jnp.asarray(x[0, 0][:, perm]), jnp.asarray(pos), inv))

    freqs_cis = torch.polar(torch.ones(1, t, d // 2), torch.from_numpy(ph)[None])
    v2, _ = apply_rotary_emb(torch.from_numpy(x), torch.from_numpy(x), freqs_cis)
    np.testing.assert_allclose(ours, v2[0, 0].numpy()[:, perm], atol=1e-5)

    emb = torch.from_numpy(np.concatenate([ph, ph], -1))[None]
    v3, _ = apply_rotary_pos_emb_interleave(
        torch.from_numpy(x), torch.from_numpy(x), emb.cos(), emb.sin()
    )
    np.testing.assert_allclose(ours, v3[0, 0].numpy(), atol=1e-5)

    wrong = np.asarray(rope.apply_rope(jnp.asarray(x[0, 0]), jnp.asarray(pos), inv))
    assert np.abs(wrong - v3[0, 0].numpy()).max() > 1e-1
