"""Prefill in the expanded form on the accelerators (`pallas_kernels.expanded_attention`): the
attention calls' contract on a hand-worked case, jax's splash attention (the TPU path's call)
under Pallas' interpreter against the jnp call, the whole path (long tiles expanded chunk by
chunk, the rest absorbed over compacted rows) against `ref_ragged_paged_mla` and the float64
oracle of test_mla_forms.py over ragged rows, a model's paged prefill through the TPU path's
composition against transformers, and the cost model per platform. tokamax's Mosaic GPU kernel
does not run under Mosaic GPU's interpreter ("Higher-order primitive run_state"): on CPU the
GPU path is proven with the jnp call in its place (same code around it), and the compiled calls
are compared on a device (accelerator("gpu") / accelerator("tpu"): the device suite runs them).

Tolerance: 1e-5 of the output's scale (test_ragged_paged_attention.py derives it) for every
fp32 path here; the compiled calls take bf16 operands, compared at 1e-2 (module of those tests).
Fixtures NaN-poison every slot no row reads and fill page-table entries past a row's pages with
garbage, out-of-range indices included (test_ragged_paged_attention.make_batch).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import leyline_jax as ll
from leyline_jax import mla
from leyline_jax.loader import config_from_hf
from pallas_kernels import expanded_attention as ea
from pallas_kernels.expanded_attention import attend_xla, expanded_ragged_paged_mla, unsupported
from pallas_kernels.ragged_paged_ref import ref_ragged_paged_mla
from tests.conftest import ALL_CONFIGS, random_tokens
from tests.test_lowering_engine import V2_LITE, V3
from tests.test_mla_forms import oracle
from tests.test_parity import assert_logits_match
from tests.test_ragged_paged_attention import check, make_batch

N, R, DR, DN, DV = 2, 8, 4, 6, 5
CONTEXT = 1024  # longest row of the property test


def weights(rng, t: int):
    """q_nope f32[T, N, Dn], w_kb [N, Dn, R], w_vb [N, R, Dv]."""
    q_nope = rng.standard_normal((t, N, DN)).astype(np.float32)
    w_kb = rng.standard_normal((N, DN, R)).astype(np.float32) / np.sqrt(DN)
    w_vb = rng.standard_normal((N, R, DV)).astype(np.float32)
    return q_nope, w_kb, w_vb


def run(batch, q_nope, w_kb, w_vb, scale, fn=expanded_ragged_paged_mla, **kw):
    """(f32[T, N, Dv] every query's output, f32[T, N, Dv] the expanded tiles' part)."""
    q_lat = np.einsum("tnd,ndr->tnr", q_nope, w_kb)
    args = batch.args()
    o_v, o_lat = fn(q_nope, q_lat, *args[1:4], w_kb, w_vb, *args[4:], scale=scale, **kw)
    return np.asarray(o_v) + np.einsum("tnr,nrd->tnd", np.asarray(o_lat), w_vb), np.asarray(o_v)


def expanded_queries(o_v) -> int:
    return int((np.abs(o_v).max(axis=(1, 2)) > 0).sum())


# ---- the attention calls ------------------------------------------------------------------------
def test_the_jnp_call_hand_worked():
    # N = 1 head, Dk = Dv = 1, scale 1, E = 2 queries of value 1, C = 3 keys [0, ln 2, ln 3]
    # with values [10, 20, 30]. causal, k_start 1: query i sees keys 1 .. i + C - E = i + 1.
    # Query 0 sees key 1 alone: output 20, lse ln 2. Query 1 sees keys 1, 2 (scores ln 2, ln 3,
    # weights 2/5, 3/5): output (40 + 90) / 5 = 26, lse ln 5. Not causal, k_start 0: every key,
    # weights 1/6, 2/6, 3/6: output (10 + 40 + 90) / 6, lse ln 6.
    q = jnp.ones((2, 1, 1), jnp.float32)
    k = jnp.log(jnp.array([1.0, 2.0, 3.0]))[:, None, None]
    v = jnp.array([10.0, 20.0, 30.0])[:, None, None]
    o, lse = attend_xla(q, k, v, jnp.int32(1), causal=True, scale=1.0)
    np.testing.assert_allclose(o[:, 0, 0], [20.0, 26.0], rtol=1e-6)
    np.testing.assert_allclose(lse[:, 0], [math.log(2), math.log(5)], rtol=1e-6)
    o, lse = attend_xla(q, k, v, jnp.int32(0), causal=False, scale=1.0)
    np.testing.assert_allclose(o[:, 0, 0], [140 / 6] * 2, rtol=1e-6)
    np.testing.assert_allclose(lse[:, 0], [math.log(6)] * 2, rtol=1e-6)


def call_operands(rng, e, c, n, dk, dv):
    q = rng.standard_normal((e, n, dk)).astype(np.float32)
    k = rng.standard_normal((c, n, dk)).astype(np.float32)
    return q, k, rng.standard_normal((c, n, dv)).astype(np.float32)


def compare_calls(got, want, tol):
    """Outputs within `tol` of `want`'s scale, log-sum-exps within `tol` absolute."""
    (o, lse), (o_want, lse_want) = got, want
    o, o_want = np.asarray(o, np.float64), np.asarray(o_want, np.float64)
    assert np.isfinite(o).all() and np.isfinite(np.asarray(lse)).all()
    err = np.abs(o - o_want).max() / np.abs(o_want).max()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"
    lse_err = np.abs(np.asarray(lse, np.float64) - np.asarray(lse_want)).max()
    assert lse_err <= tol, f"log-sum-exp error {lse_err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("causal", [True, False])
def test_splash_under_the_interpreter_equals_the_jnp_call(causal):
    """The TPU path's call (jax's splash attention: static causal offset, segment ids for
    k_start, the log-sum-exp as a residual), interpreted, against the jnp call: a tile of 128
    queries and a chunk of 256 keys, k_start 0, mid-chunk and on a block boundary; one key more
    (k_start 127) is told apart."""
    rng = np.random.default_rng(int(causal))
    q, k, v = call_operands(rng, 128, 256, 2, 24, 16)
    for k_start in (0, 77, 128):
        args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.int32(k_start))
        want = attend_xla(*args, causal=causal, scale=0.3)
        got = ea.ATTENDS["splash_interpret"](*args, causal=causal, scale=0.3)
        compare_calls(got, want, 1e-5)
    one_more = attend_xla(*args[:3], jnp.int32(127), causal=causal, scale=0.3)  # a key too many
    with pytest.raises(AssertionError, match="error"):
        compare_calls(got, one_more, 1e-5)


# ---- the whole path ----------------------------------------------------------------------------
@st.composite
def prefill_mixes(draw, page_size: int):
    """A step of up to 6 rows: prefill chunks starting mid-context (8-60 queries), fresh
    prefills (the whole row new), decode rows and rows with no new queries, in contexts of
    1..1024 slots (page boundaries likely); padding rows and tokens."""
    near_boundary = st.builds(
        lambda k, d: min(max(k * page_size + d, 1), CONTEXT),
        st.integers(0, CONTEXT // page_size),
        st.integers(-1, 1),
    )
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        kv = draw(st.integers(1, CONTEXT) | near_boundary)
        kind = draw(st.sampled_from(["chunk", "chunk", "fresh", "decode", "empty"]))
        queries = {
            "chunk": st.integers(min(8, kv), min(60, kv)),
            "fresh": st.integers(1, min(60, kv)),
            "decode": st.just(1),
            "empty": st.just(0),
        }
        q = draw(queries[kind])
        rows.append((q, q if kind == "fresh" else kv))
    pad_tokens = draw(st.integers(0, 5))
    scale = draw(st.sampled_from([0.3, 1.0, 2.0]))
    return rows, pad_tokens, scale, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("page_size", (4, 16))
@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_the_path_matches_the_jnp_reference_and_float64(page_size, data):
    """Tiles of 16 and 8 queries expanded in chunks of 32 slots (so a tile's slots span up to
    33 chunks, merged by their log-sum-exp), the rest absorbed over compacted rows; against
    `ref_ragged_paged_mla` with the same tiles and the float64 oracle."""
    rows, pad_tokens, scale, seed = data.draw(prefill_mixes(page_size))
    w, total = CONTEXT // page_size, sum(q for q, _ in rows) + pad_tokens
    rng = np.random.default_rng(seed)
    kw = dict(page_size=page_size, n=N, r=R, dr=DR, w=w, p=6 * w + 4, pad_tokens=pad_tokens)
    batch = make_batch(rng, rows, t=64 if total <= 64 else 512, **kw)
    q_nope, w_kb, w_vb = weights(rng, batch.q_pe.shape[0])
    tiles = dict(expanded_tiles=(16, 8))
    got, o_v = run(batch, q_nope, w_kb, w_vb, scale, chunk=32, absorbed_impl="jnp", **tiles)
    want = oracle(batch, q_nope, w_kb, w_vb, scale)
    event(f"an expanded tile: {expanded_queries(o_v) > 0}")
    event(f"a tile past its first chunk: {any(q >= 8 and kv > 32 for q, kv in rows)}")
    check(got, want, batch.padding)
    jnp_path, _ = run(batch, q_nope, w_kb, w_vb, scale, fn=ref_ragged_paged_mla, **tiles)
    check(got, jnp_path.astype(np.float64), batch.padding)


# a prefill chunk of 200 queries starting at slot 500 (crossing pages), a fresh prefill of 130,
# decode rows, a short chunk, an empty row
KERNEL_ROWS = [(200, 700), (1, 300), (130, 130), (0, 40), (5, 513), (1, 1)]


@pytest.mark.parametrize(
    "attend, absorbed_impl", [("splash_interpret", "interpret"), ("xla", "jnp")]
)
def test_kernel_sized_tiles(attend, absorbed_impl):
    """Tiles of 128 queries (the kernels' block) in chunks of 128 slots: the TPU path's
    composition under interpreters (splash for the tiles, the absorbed TPU kernel for the rest)
    and the GPU path's with the jnp call, against the float64 oracle and the jnp reference."""
    rng = np.random.default_rng(5)
    batch = make_batch(rng, KERNEL_ROWS, page_size=16, n=N, r=R, dr=DR, pad_tokens=3)
    q_nope, w_kb, w_vb = weights(rng, batch.q_pe.shape[0])
    kw = dict(expanded_tiles=(128,), chunk=128, attend=attend, absorbed_impl=absorbed_impl)
    got, o_v = run(batch, q_nope, w_kb, w_vb, 0.5, **kw)
    assert expanded_queries(o_v) == 256  # one tile of the chunk, one of the fresh prefill
    check(got, oracle(batch, q_nope, w_kb, w_vb, 0.5), batch.padding)
    want, _ = run(batch, q_nope, w_kb, w_vb, 0.5, fn=ref_ragged_paged_mla, expanded_tiles=(128,))
    check(got, want.astype(np.float64), batch.padding)


def test_a_wrong_call_fails(monkeypatch):
    """The jnp call letting each query see one slot past its own (a causal diagonal one to the
    right) is caught by the same comparison: it can fail."""

    def shifted(q, k, v, k_start, *, causal, scale):
        if not causal:
            return attend_xla(q, k, v, k_start, causal=False, scale=scale)
        pad = [(0, 1), (0, 0), (0, 0)]  # one more key after the chunk: the diagonal moves right
        k, v = jnp.pad(k[1:], pad, mode="edge"), jnp.pad(v[1:], pad, mode="edge")
        return attend_xla(q, k, v, jnp.maximum(k_start - 1, 0), causal=True, scale=scale)

    rng = np.random.default_rng(6)
    batch = make_batch(rng, [(24, 100), (1, 60)], page_size=4, n=N, r=R, dr=DR)
    q_nope, w_kb, w_vb = weights(rng, batch.q_pe.shape[0])
    want = oracle(batch, q_nope, w_kb, w_vb, 1.0)
    kw = dict(expanded_tiles=(8,), chunk=16, absorbed_impl="jnp")
    check(run(batch, q_nope, w_kb, w_vb, 1.0, **kw)[0], want, batch.padding)
    monkeypatch.setitem(ea.ATTENDS, "xla", shifted)
    jax.clear_caches()  # the jitted path traced the real call above
    try:
        wrong = run(batch, q_nope, w_kb, w_vb, 1.0, **kw)[0]
    finally:
        jax.clear_caches()
    with pytest.raises(AssertionError, match="relative error"):
        check(wrong, want, batch.padding)


def test_the_calls_refuse_what_they_cannot_take():
    kw = dict(heads=16, dk=192, dv=128)
    assert unsupported("xla", tiles=(16, 8), chunk=32, **kw) is None
    assert "shorter" in unsupported("xla", tiles=(64,), chunk=32, **kw)
    assert "multiples of 128" in unsupported("splash", tiles=(256, 64), chunk=256, **kw)
    assert "multiples of 128" in unsupported("tokamax", tiles=(256,), chunk=320, **kw)
    assert "shared memory" in unsupported(
        "tokamax", tiles=(128,), chunk=128, heads=16, dk=1024, dv=1024
    )
    assert "float32 or bfloat16" in unsupported(
        "tokamax", tiles=(128,), chunk=128, dtype=jnp.float16, **kw
    )
    assert "unknown" in unsupported("cudnn", tiles=(128,), chunk=128, **kw)
    with pytest.raises(ValueError, match="multiples of 128"):
        rng = np.random.default_rng(0)
        batch = make_batch(rng, [(4, 9)], page_size=4, n=N, r=R, dr=DR)
        run(batch, *weights(rng, batch.q_pe.shape[0]), 1.0, expanded_tiles=(4,), attend="splash")


# ---- through the model ---------------------------------------------------------------------------
def test_paged_prefill_through_the_tpu_composition_matches_transformers(
    hf_ckpt, hf_model, monkeypatch
):
    """A 150-token prompt in one step on the tiny DeepSeek-V2, its attention through the TPU
    branch of `MLAAttention.paged` (taken here, on CPU, with splash interpreted and the
    absorbed rest on jnp): one tile of 128 expanded, 22 queries absorbed; its logits equal
    transformers' and the CPU path's."""
    import torch

    path = hf_ckpt("deepseek_v2")
    model = ll.load_model(path)
    prompt = random_tokens(150, seed=6).tolist()

    def state():
        return ll.init_state(
            model.config, num_pages=20, page_size=16, max_seqs=1, max_step_tokens=256,
            kv_dtype=jnp.float32,
        )  # fmt: skip

    _, cpu_logits = ll.prefill(model, state(), 0, prompt)
    seen = []
    real = mla.expanded_ragged_paged_mla

    def spy(*args, **kw):
        seen.append((kw["expanded_tiles"], kw["attend"]))
        return real(*args, **kw)

    monkeypatch.setattr(mla, "expanded_ragged_paged_mla", spy)
    monkeypatch.setitem(ea.PLATFORM_ATTEND, "tpu", "splash_interpret")
    monkeypatch.setattr(mla, "lowering_platforms", lambda: frozenset({"cpu", "tpu"}))
    monkeypatch.setattr(mla, "on_platform", lambda ref, args, **kernels: kernels["tpu"](*args))
    jax.clear_caches()
    try:
        _, logits = ll.prefill(model, state(), 0, prompt)
    finally:
        jax.clear_caches()  # no program traced with the patches outlives the test
    assert seen and all(s == ((256, 128), "splash_interpret") for s in seen), seen
    with torch.no_grad():
        want = hf_model(path)(torch.tensor(prompt, dtype=torch.long)[None]).logits[0, -1].numpy()
    assert_logits_match(np.asarray(logits), want)
    assert_logits_match(np.asarray(logits), np.asarray(cpu_logits))


# ---- the cost model ----------------------------------------------------------------------------
def test_the_cost_model_per_platform():
    """On an accelerator the expanded form starts at smaller tiles than on CPU: V2-Lite's widths
    (16 heads, bound by the pages the absorbed kernel re-reads) from 128 queries (the kernels'
    block), V3's (128 heads, bound by flops) from 256; decode steps and short chunks absorbed;
    at most three sizes; the CPU's choice is unchanged (test_mla_forms.py)."""
    v2, v3 = config_from_hf(V2_LITE), config_from_hf(V3)
    for platform in ("tpu", "cuda"):
        tiles = [mla.expanded_tiles(t, v2, platform=platform) for t in (1, 64, 127, 128, 300)]
        assert tiles == [(), (), (), (128,), (256, 128)]
        assert mla.expanded_tiles(1024, v2, platform=platform) == (1024, 256, 128)
        assert mla.expanded_tiles(1 << 16, v2, platform=platform) == (2048, 512, 128)
        assert mla.expanded_tiles(255, v3, platform=platform) == ()
        assert mla.expanded_tiles(1024, v3, platform=platform) == (1024, 512, 256)
    assert mla.expanded_tiles(1024, v2) == (1024, 512) and mla.expanded_tiles(128, v2) == ()
    # k_pe stored bf16 (R + Dr bf16 a slot): the absorbed kernel reads less, still worse at 128
    assert mla.expanded_tiles(128, v2, platform="cuda", slot_bytes=2 * (512 + 64)) == (128,)
    tiny = config_from_hf(ALL_CONFIGS["deepseek_v2"])
    assert mla.expanded_tiles(256, tiny, platform="tpu") == (256, 128)
    with pytest.raises(ValueError, match="platform"):
        mla.expanded_tiles(1024, v2, platform="rocm")


def test_the_threshold_follows_the_arithmetic():
    """The smallest tile is the first power of two from 128 where the per-query cost of the
    expanded form (matmul flops plus the expansion shared by the tile) is below the absorbed
    form's (its flops or its page reads at the machine balance, whichever is larger)."""
    v3 = config_from_hf(V3)
    n, r, dr, dn, dv = 128, 512, 64, 128, 128
    read = mla.ACCELERATOR_BALANCE * (2 * r + 4 * dr)
    absorbed = max(2 * n * (2 * r + dr), read)

    def expanded(e):
        return 2 * n * (dn + dr + dv) + (2 * n * r * (dn + dv) + read) / e

    assert expanded(256) < absorbed < expanded(128)
    wide = dataclasses.replace(v3, qk_nope_head_dim=192, v_head_dim=256)  # GLM-4.7-Flash-like
    small = min(mla.expanded_tiles(4096, wide, platform="cuda"))
    assert small == 512  # more expansion per slot: a larger tile before it pays


# ---- compiled, on a device ---------------------------------------------------------------------
BF16_TOL = 1e-2  # bf16 operands (8 bits): scores and weights carry ~4e-3 relative error


@pytest.mark.accelerator("gpu")
def test_tokamax_call_on_a_hopper():
    """tokamax's Mosaic GPU kernel against the jnp call on the same bf16-rounded operands, at
    V2-Lite's widths (N 16, Dk 192, Dv 128), a 256-query tile in a 1024-slot chunk."""
    assert unsupported("tokamax", tiles=(256,), chunk=1024, heads=16, dk=192, dv=128) is None
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in call_operands(rng, 256, 1024, 16, 192, 128))
    for causal in (True, False):
        for k_start in (0, 300, 768):
            args = (q, k, v, jnp.int32(k_start))
            got = jax.jit(ea.attend_tokamax, static_argnames=("causal", "scale"))(
                *args, causal=causal, scale=0.07
            )
            compare_calls(got, attend_xla(*args, causal=causal, scale=0.07), BF16_TOL)


@pytest.mark.accelerator("tpu")
def test_splash_call_on_a_tpu():
    """jax's splash attention, compiled, against the jnp call (V2-Lite's widths)."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in call_operands(rng, 256, 1024, 16, 192, 128))
    for causal in (True, False):
        for k_start in (0, 300, 768):
            args = (q, k, v, jnp.int32(k_start))
            got = ea.attend_splash(*args, causal=causal, scale=0.07)
            compare_calls(got, attend_xla(*args, causal=causal, scale=0.07), BF16_TOL)


@pytest.mark.accelerator
def test_the_platform_path_on_the_device():
    """The platform's whole path (its call for tiles of 128 and 256 in 256-slot chunks, its
    absorbed kernel for the rest) at V2-Lite's widths, bf16 latent, against float64."""
    attend = ea.PLATFORM_ATTEND["cuda" if jax.default_backend() == "gpu" else "tpu"]
    rng = np.random.default_rng(3)
    rows = [(300, 900), (1, 2000), (256, 256), (7, 1024)]
    batch = make_batch(rng, rows, page_size=16, n=16, r=512, dr=64, c_dtype=jnp.bfloat16)
    t = batch.q_pe.shape[0]
    q_nope = rng.standard_normal((t, 16, 128)).astype(np.float32)
    w_kb = (rng.standard_normal((16, 128, 512)) / np.sqrt(128)).astype(np.float32)
    w_vb = (rng.standard_normal((16, 512, 128)) / np.sqrt(512)).astype(np.float32)
    kw = dict(expanded_tiles=(256, 128), chunk=256, attend=attend, kv_dtype=jnp.bfloat16)
    got, o_v = run(batch, q_nope, w_kb, w_vb, 0.06, **kw)
    assert expanded_queries(o_v) == 512
    check(got, oracle(batch, q_nope, w_kb, w_vb, 0.06), batch.padding, tol=BF16_TOL)
