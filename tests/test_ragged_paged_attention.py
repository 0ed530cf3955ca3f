"""ragged_paged_attention: the jnp reference and the Pallas kernel, against hand-worked cases and a
dense attention written plainly here (per row: gather its slots, causal mask, softmax).

Shared tests run for each implementation: `RaggedPagedAttentionRefTest` (jnp),
`...KernelTest` (compiled Pallas, TPU only) and its interpret-mode twins `...InterpretTest`
(Pallas' generic interpreter) and `...TpuInterpretTest` (the TPU-semantics interpreter, which
runs the DMAs and semaphores as hardware would). The hypothesis property test, the R = 512 case
and the compile count exercise the jnp path, the production path on CPU.

Tolerance. The oracle is float64 math on the fp32 inputs. An output is a convex combination of
`c_kv` rows, so errors are measured against the output's largest magnitude. The fp32 path rounds
each score (a dot of R + Dr terms: ~sqrt(R + Dr) * 2**-24 relative to |q||c|, a few 1e-7 for
scores of order 1-10) and each exp and rescaling of the online softmax (a few ulps), so weights
carry ~1e-6 relative error: 1e-5 leaves a margin without hiding a wrong slot, which moves outputs
by O(1) (see `test_the_comparison_catches_a_wrong_mask_or_page`). Unused slots are NaN-poisoned in
every fixture, so a stray read shows up as NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax import export

from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_kernel,
    ref_ragged_paged_attention,
    validate_dynamic,
    validate_static,
)

TOL = 1e-5  # relative to the output's scale; derivation in the module docstring
ROWS = 8  # B of every fixture: rows past the mix are padding


# ---- fixtures -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's inputs as numpy arrays, plus what the fixture knows about them."""

    q_lat: np.ndarray  # f32[T, N, R]
    q_pe: np.ndarray  # f32[T, N, Dr]
    c_kv: np.ndarray  # [P, page_size, R], f32 or bf16
    k_pe: np.ndarray  # f32[P, page_size, Dr]
    kv_lens: np.ndarray  # i32[B]
    page_indices: np.ndarray  # i32[B, W]
    cu_q_lens: np.ndarray  # i32[B + 1]
    num_rows: np.ndarray  # i32[1]
    used: np.ndarray  # bool[P, page_size]: slots some row attends
    padding: np.ndarray  # bool[T]: tokens past cu_q_lens[num_rows]

    def args(self, c_kv=None, k_pe=None, page_indices=None):
        c_kv = self.c_kv if c_kv is None else c_kv
        k_pe = self.k_pe if k_pe is None else k_pe
        page_indices = self.page_indices if page_indices is None else page_indices
        return tuple(
            jnp.asarray(a)
            for a in (
                self.q_lat,
                self.q_pe,
                c_kv,
                k_pe,
                self.kv_lens,
                page_indices,
                self.cu_q_lens,
                self.num_rows,
            )
        )

    def clean(self, rng) -> Batch:
        """The same batch with finite random values where the poison was."""
        c, k = self.c_kv.copy(), self.k_pe.copy()
        c[~self.used] = rng.standard_normal(c[~self.used].shape).astype(c.dtype)
        k[~self.used] = rng.standard_normal(k[~self.used].shape).astype(k.dtype)
        return dataclasses.replace(self, c_kv=c, k_pe=k)


def make_batch(
    rng,
    rows,  # [(q_len, kv_len)] of the rows in use
    *,
    page_size: int,
    n: int = 2,
    r: int = 8,
    dr: int = 4,
    t: int | None = None,
    w: int | None = None,
    p: int | None = None,
    pad_tokens: int = 0,
    c_dtype=np.float32,
) -> Batch:
    """Rows on distinct random pages; everything no row reads is garbage: page-table entries past
    a row's pages (out-of-range ones too), padding rows' metadata, and NaN in unused slots."""
    q_lens = np.array([q for q, _ in rows], np.int32)
    kvs = np.array([kv for _, kv in rows], np.int32)
    n_pages = -(-kvs // page_size)
    w = w or max(1, int(n_pages.max(initial=1)))
    p = p or int(n_pages.sum()) + 4
    t = t or int(q_lens.sum()) + pad_tokens
    assert len(rows) <= ROWS and n_pages.max(initial=0) <= w and n_pages.sum() <= p
    assert q_lens.sum() <= t
    page_indices = rng.integers(-3, p + 3, (ROWS, w)).astype(np.int32)
    order = rng.permutation(p)
    for b, first in enumerate(np.cumsum(n_pages) - n_pages):
        page_indices[b, : n_pages[b]] = order[first : first + n_pages[b]]
    kv_lens = rng.integers(0, 10**6, ROWS).astype(np.int32)
    kv_lens[: len(rows)] = kvs
    cu_q_lens = rng.integers(0, t + 1, ROWS + 1).astype(np.int32)  # garbage past num_rows
    cu_q_lens[: len(rows) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    used = np.zeros((p, page_size), bool)
    for b, kv in enumerate(kvs):
        s = np.arange(kv)
        used[page_indices[b, s // page_size], s % page_size] = True
    c_kv = rng.standard_normal((p, page_size, r)).astype(np.float32)
    k_pe = rng.standard_normal((p, page_size, dr)).astype(np.float32)
    c_kv[~used], k_pe[~used] = np.nan, np.nan
    return Batch(
        q_lat=rng.standard_normal((t, n, r)).astype(np.float32),
        q_pe=rng.standard_normal((t, n, dr)).astype(np.float32),
        c_kv=np.asarray(jnp.asarray(c_kv, c_dtype)),
        k_pe=k_pe,
        kv_lens=kv_lens,
        page_indices=page_indices,
        cu_q_lens=cu_q_lens,
        num_rows=np.array([len(rows)], np.int32),
        used=used,
        padding=np.arange(t) >= q_lens.sum(),
    )


def dense_attention(batch: Batch, scale: float, *, causal_shift: int = 0, page_indices=None):
    """f64[T, N, R]: per row, gather its kv_len slots, mask s <= position (+ causal_shift, to
    build a deliberately wrong mask), softmax, weighted sum of c_kv."""
    page_indices = batch.page_indices if page_indices is None else page_indices
    q_lat, q_pe = batch.q_lat.astype(np.float64), batch.q_pe.astype(np.float64)
    c_kv = np.asarray(batch.c_kv, np.float64)
    k_pe = batch.k_pe.astype(np.float64)
    page_size = c_kv.shape[1]
    out = np.zeros(q_lat.shape)
    for b in range(int(batch.num_rows[0])):
        start, end, kv = batch.cu_q_lens[b], batch.cu_q_lens[b + 1], batch.kv_lens[b]
        if start == end:
            continue
        s = np.arange(kv)
        pages = page_indices[b, s // page_size]
        c, k = c_kv[pages, s % page_size], k_pe[pages, s % page_size]  # [kv, R], [kv, Dr]
        scores = scale * (q_lat[start:end] @ c.T + q_pe[start:end] @ k.T)  # [q, N, kv]
        pos = kv - (end - start) + np.arange(end - start)
        allowed = s[None, :] <= pos[:, None] + causal_shift
        scores = np.where(allowed[:, None, :], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[start:end] = (weights / weights.sum(-1, keepdims=True)) @ c
    return out


def check(got, want, padding, tol=TOL):
    """Fails unless `got` is finite, exactly 0 on padding tokens and within `tol` of `want`
    relative to the output's scale."""
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.isfinite(got).all(), "non-finite output"
    assert not got[padding].any(), "padding tokens must be 0"
    err = np.abs(got - want).max(initial=0) / max(np.abs(want).max(initial=0), 1e-30)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


# a serving-like mix: decode rows, a prefill chunk crossing query blocks, an empty row, a short
# chunk, and the page-boundary lengths page - 1, page, page + 1 (page = 4)
MIX = [(1, 37), (9, 23), (0, 12), (1, 3), (3, 4), (2, 5), (1, 1)]


# ---- shared tests, one class per implementation ---------------------------------------------
class RaggedPagedAttentionRefTest:
    IMPL = "jnp"
    KNOBS = dict(q_tiles=(4, 2, 1), block_kv=8)  # several tiles and kv blocks per row
    # a last tile size > 1 (padded tiles), one slot per block, a block wider than any row
    OTHER_KNOBS = (dict(q_tiles=(3,), block_kv=1), dict(q_tiles=(16, 5), block_kv=100))

    def run(self, batch: Batch, scale: float, **kw):
        return np.asarray(
            ragged_paged_attention(*batch.args(**kw), scale=scale, impl=self.IMPL, **self.KNOBS)
        )

    def test_hand_worked(self):
        # N = 1 head, R = 2, Dr = 1, page_size 2, scale 1. One row: kv_len 3, two new queries
        # at positions 3 - 2 + 0 = 1 and 2. Its page table is [1, 0]: slots 0, 1 on page 1,
        # slot 2 on page 0; slot 1 of page 0 and all of page 2 are unused (NaN).
        nan = np.nan
        c_kv = np.array([[[1, 1], [nan, nan]], [[1, 0], [0, 1]], [[nan, nan]] * 2], np.float32)
        k_pe = np.array([[[math.log(2)], [nan]], [[0], [0]], [[nan], [nan]]], np.float32)
        # query 0 (position 1) sees slots 0, 1: scores ln3 * 1 + 0 = ln 3 and 0, weights 3/4,
        # 1/4; output 3/4 (1, 0) + 1/4 (0, 1) = (0.75, 0.25).
        # query 1 (position 2) sees slots 0, 1, 2: q_lat 0, q_pe 1 against k_pe (0, 0, ln 2):
        # scores 0, 0, ln 2, weights 1/4, 1/4, 1/2; output 1/4 (1, 0) + 1/4 (0, 1) +
        # 1/2 (1, 1) = (0.75, 0.75).
        # token 2 is padding (past cu_q_lens[num_rows] = 2): output 0. Row 1 is a padding row
        # (num_rows = 1) whose garbage metadata must be ignored.
        q_lat = np.array([[[math.log(3), 0]], [[0, 0]], [[5, 5]]], np.float32)
        q_pe = np.array([[[0]], [[1]], [[5]]], np.float32)
        batch = Batch(
            q_lat=q_lat,
            q_pe=q_pe,
            c_kv=c_kv,
            k_pe=k_pe,
            kv_lens=np.array([3, 99], np.int32),
            page_indices=np.array([[1, 0], [2, 7]], np.int32),
            cu_q_lens=np.array([0, 2, 1], np.int32),
            num_rows=np.array([1], np.int32),
            used=np.array([[True, False], [True, True], [False, False]]),
            padding=np.array([False, False, True]),
        )
        out = self.run(batch, 1.0)
        want = np.array([[[0.75, 0.25]], [[0.75, 0.75]], [[0, 0]]], np.float32)
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(out[2], 0.0)

    @pytest.mark.parametrize("page_size", [1, 4])
    def test_mix_against_dense(self, page_size):
        rng = np.random.default_rng(page_size)
        batch = make_batch(rng, MIX, page_size=page_size, pad_tokens=3)
        want = dense_attention(batch, 0.4)
        check(self.run(batch, 0.4), want, batch.padding)

    def test_other_tiles_and_blocks(self):
        rng = np.random.default_rng(4)
        batch = make_batch(rng, MIX, page_size=4, pad_tokens=3)
        want = dense_attention(batch, 0.7)
        for knobs in self.OTHER_KNOBS:
            got = ragged_paged_attention(*batch.args(), scale=0.7, impl=self.IMPL, **knobs)
            check(got, want, batch.padding)

    def test_poisoned_pages_are_never_read(self):
        """NaN in unused pages and in the unused slots of each row's last page: the output is
        finite and bit-identical to the output over a pool with finite values there."""
        rng = np.random.default_rng(7)
        batch = make_batch(rng, MIX, page_size=4, pad_tokens=2)
        used_pages = batch.used.any(axis=1, keepdims=True)  # bool[P, 1]
        assert (~used_pages).any() and (used_pages & ~batch.used).any()  # both kinds of poison
        assert np.isnan(batch.c_kv[~batch.used]).all()
        poisoned = self.run(batch, 0.5)
        clean = self.run(batch.clean(rng), 0.5)
        assert np.isfinite(poisoned).all()
        np.testing.assert_array_equal(poisoned, clean)

    def test_bf16_latent_stored_as_bits(self):
        """bf16 c_kv stored as raw uint16 bits (as the paged state keeps it) with fp32 k_pe:
        bit for bit the result of the typed bf16 array, and the attention of the bf16 values."""
        rng = np.random.default_rng(3)
        batch = make_batch(rng, MIX, page_size=4, c_dtype=jnp.bfloat16)
        bits = np.asarray(batch.c_kv).view(np.uint16)
        typed = self.run(batch, 0.5)
        got = np.asarray(
            ragged_paged_attention(
                *batch.args(c_kv=bits),
                scale=0.5,
                kv_dtype=jnp.bfloat16,
                impl=self.IMPL,
                **self.KNOBS,
            )
        )
        np.testing.assert_array_equal(got, typed)
        check(got, dense_attention(batch, 0.5), batch.padding)  # the oracle decodes bf16 exactly


class RaggedPagedAttentionKernelTest(RaggedPagedAttentionRefTest):
    IMPL = "pallas"
    KNOBS = dict(block_q=4, block_kv=8)  # rows share query blocks; several kv blocks per row
    # one token per query block and one kv block per row; one page per kv block
    OTHER_KNOBS = (dict(block_q=1, block_kv=64), dict(block_q=16, block_kv=2))

    @pytest.fixture(autouse=True)
    def _needs_tpu(self):
        if jax.default_backend() != "tpu":
            pytest.skip("the compiled kernel targets TPU; its interpret twins run here")

    def test_matches_reference(self):
        rng = np.random.default_rng(11)
        batch = make_batch(rng, MIX, page_size=4, pad_tokens=5)
        ref = ref_ragged_paged_attention(*batch.args(), scale=0.3)
        check(self.run(batch, 0.3), np.asarray(ref, np.float64), batch.padding)


class RaggedPagedAttentionKernelInterpretTest(RaggedPagedAttentionKernelTest):
    IMPL = "interpret"

    @pytest.fixture(autouse=True)
    def _needs_tpu(self):
        return None


class RaggedPagedAttentionKernelTpuInterpretTest(RaggedPagedAttentionKernelInterpretTest):
    IMPL = "tpu_interpret"


# collected by pytest (names start with Test)
TestRaggedPagedAttentionRef = RaggedPagedAttentionRefTest
TestRaggedPagedAttentionKernel = RaggedPagedAttentionKernelTest
TestRaggedPagedAttentionKernelInterpret = RaggedPagedAttentionKernelInterpretTest
TestRaggedPagedAttentionKernelTpuInterpret = RaggedPagedAttentionKernelTpuInterpretTest


# ---- the jnp path: property test, model-sized shapes, compile count ---------------------------
PAGE_SIZES = (1, 8, 16, 64)
MAX_CONTEXT = 4096


@st.composite
def mixes(draw, page_size: int):
    """A step: up to 6 rows (decode, multi-token decode, prefill chunk, no new tokens) with
    contexts 1..4096 (page boundaries likely), padding rows and padding tokens."""
    near_boundary = st.builds(
        lambda k, d: min(max(k * page_size + d, 1), MAX_CONTEXT),
        st.integers(0, MAX_CONTEXT // page_size),
        st.integers(-1, 1),
    )
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        kv = draw(st.integers(1, MAX_CONTEXT) | near_boundary)
        kind = draw(st.sampled_from(["decode", "multi", "chunk", "empty"]))
        queries = {
            "decode": st.just(1),
            "empty": st.just(0),
            "multi": st.integers(2, 4).map(lambda q, kv=kv: min(q, kv)),
            "chunk": st.integers(1, min(kv, 40)),
        }
        q = draw(queries[kind])
        rows.append((q, kv))
    pad_tokens = draw(st.integers(0, 5))
    scale = draw(st.sampled_from([0.3, 1.0, 2.0]))  # 2.0: peaked softmax
    seed = draw(st.integers(0, 2**16))
    return rows, pad_tokens, scale, seed


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_reference_matches_dense_attention(page_size, data):
    """Shapes are bucketed (W, P fixed per page size; T 64 or 256) so few programs compile."""
    rows, pad_tokens, scale, seed = data.draw(mixes(page_size))
    total = sum(q for q, _ in rows) + pad_tokens
    w = MAX_CONTEXT // page_size
    batch = make_batch(
        np.random.default_rng(seed),
        rows,
        page_size=page_size,
        t=64 if total <= 64 else 256,
        w=w,
        p=6 * w + 4,
    )
    event(f"longest context > 1024: {max(kv for _, kv in rows) > 1024}")
    event(f"has a chunk of > 8 queries: {any(q > 8 for q, _ in rows)}")
    event(f"has a row with no queries: {any(q == 0 for q, _ in rows)}")
    got = ref_ragged_paged_attention(*batch.args(), scale=scale)
    check(got, dense_attention(batch, scale), batch.padding)


@pytest.mark.parametrize("c_dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_reference_at_model_width(c_dtype):
    """R = 512, Dr = 64 (DeepSeek's MLA widths), N = 4, page 16: long decode rows, a chunk, a
    row with no new tokens, padding rows and tokens, default tiles and blocks."""
    rng = np.random.default_rng(5)
    rows = [(1, 4096), (1, 1000), (37, 1200), (0, 50), (2, 17), (1, 513)]
    batch = make_batch(rng, rows, page_size=16, n=4, r=512, dr=64, pad_tokens=4, c_dtype=c_dtype)
    scale = 1 / math.sqrt(512 + 64)
    got = ragged_paged_attention(*batch.args(), scale=scale, kv_dtype=c_dtype, impl="jnp")
    check(got, dense_attention(batch, scale), batch.padding)


def test_the_comparison_catches_a_wrong_mask_or_page():
    """The comparison used throughout fails on an off-by-one causal bound and on one wrong page
    index: it can fail."""
    rng = np.random.default_rng(2)
    batch = make_batch(rng, MIX, page_size=4)
    want = dense_attention(batch, 0.5)
    check(ref_ragged_paged_attention(*batch.args(), scale=0.5), want, batch.padding)
    # each query also sees the slot after it
    with pytest.raises(AssertionError, match="relative error"):
        check(dense_attention(batch, 0.5, causal_shift=1).astype(np.float32), want, batch.padding)
    # row 1's first page swapped for a page of row 0 (finite data, wrong slots)
    wrong = batch.page_indices.copy()
    wrong[1, 0] = batch.page_indices[0, 0]
    got = ref_ragged_paged_attention(*batch.args(page_indices=wrong), scale=0.5)
    with pytest.raises(AssertionError, match="relative error"):
        check(got, want, batch.padding)


def _count_compiles():
    """A list that grows by one entry per XLA compilation while the listener is registered."""
    seen = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    return seen, listener


def test_compiles_once_per_shape():
    """Different mixes with the same (bucketed) shapes reuse one program."""
    rng = np.random.default_rng(9)
    mixes_ = [MIX, [(1, 60)] * 6, [(20, 20), (0, 3)], [(5, 40), (1, 1), (1, 2), (30, 33)]]
    batches = [make_batch(rng, m, page_size=4, t=48, w=16, p=128) for m in mixes_]
    f = functools.partial(ref_ragged_paged_attention, scale=0.5)
    jax.block_until_ready(f(*batches[0].args()))
    seen, listener = _count_compiles()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for batch in batches:
            args = batch.args()
            jax.block_until_ready(args)
            check(f(*args), dense_attention(batch, 0.5), batch.padding)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not seen, f"{len(seen)} compilations"


# ---- the kernel lowers for TPU ---------------------------------------------------------------
@pytest.mark.parametrize("stored, meaning", [(jnp.float32, None), (jnp.uint16, jnp.bfloat16)])
def test_kernel_lowers_to_mosaic_for_tpu(stored, meaning):
    """Exporting for TPU runs Pallas' Mosaic lowering of the kernel at model widths (the Mosaic
    compiler itself needs a TPU): no primitive without a TPU lowering rule."""
    shape = jax.ShapeDtypeStruct
    t, n, r, dr, p, page, b, w = 32, 16, 512, 64, 64, 16, 8, 16
    args = (
        shape((t, n, r), jnp.float32),
        shape((t, n, dr), jnp.float32),
        shape((p, page, r), stored),
        shape((p, page, dr), jnp.float32),
        shape((b,), jnp.int32),
        shape((b, w), jnp.int32),
        shape((b + 1,), jnp.int32),
        shape((1,), jnp.int32),
    )
    kernel = jax.jit(functools.partial(ragged_paged_attention_kernel, scale=0.04, kv_dtype=meaning))
    exported = export.export(kernel, platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()


# ---- validators ------------------------------------------------------------------------------
def _arrays(t=4, n=2, r=8, dr=4, p=6, page=4, b=2, w=3):
    return dict(
        q_lat=jnp.zeros((t, n, r)),
        q_pe=jnp.zeros((t, n, dr)),
        c_kv=jnp.zeros((p, page, r)),
        k_pe=jnp.zeros((p, page, dr)),
        kv_lens=jnp.array([5, 2], jnp.int32)[:b],
        page_indices=jnp.zeros((b, w), jnp.int32),
        cu_q_lens=jnp.array([0, 3, 4], jnp.int32)[: b + 1],
        num_rows=jnp.array([b], jnp.int32),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q_lat=jnp.zeros((4, 2))), "q_lat"),
        (dict(q_pe=jnp.zeros((4, 3, 4))), "q_pe"),
        (dict(k_pe=jnp.zeros((6, 2, 4))), "k_pe"),
        (dict(c_kv=jnp.zeros((6, 4, 9))), "c_kv width"),
        (dict(k_pe=jnp.zeros((6, 4, 5))), "k_pe width"),
        (dict(page_indices=jnp.zeros((2,), jnp.int32)), "page_indices"),
        (dict(kv_lens=jnp.zeros((3,), jnp.int32)), "kv_lens"),
        (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), "cu_q_lens"),
        (dict(num_rows=jnp.zeros((), jnp.int32)), "num_rows"),
        (dict(kv_lens=jnp.zeros((2,), jnp.int16)), "kv_lens must be int32"),
        (dict(page_indices=jnp.zeros((2, 3))), "page_indices must be int32"),
        (dict(q_lat=jnp.zeros((4, 2, 8), jnp.int32)), "q_lat must be a float"),
        (dict(c_kv=jnp.zeros((6, 4, 8), jnp.uint16)), "c_kv holds uint16 bits"),
        (dict(k_pe=jnp.zeros((6, 4, 4), jnp.uint8)), "k_pe holds uint8"),
    ],
)
def test_static_validator(change, match):
    a = _arrays() | change
    with pytest.raises(ValueError, match=match):
        validate_static(*a.values())
    with pytest.raises(ValueError, match=match):  # the dispatch checks too
        ragged_paged_attention(*a.values(), scale=1.0, impl="jnp")


def test_static_validator_dtypes_and_kernel_layout():
    a = _arrays()
    validate_static(*a.values())  # the fixture itself is fine
    bits = a | dict(c_kv=jnp.zeros((6, 4, 8), jnp.uint16))
    validate_static(*bits.values(), kv_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="c_kv stored as uint16 cannot hold float32"):
        validate_static(*bits.values(), kv_dtype=jnp.float32)
    with pytest.raises(ValueError, match="k_pe's dtype must name a float"):
        validate_static(*a.values(), k_pe_dtype=jnp.int32)
    # the compiled kernel's layout: R lanes, page sublanes, heads
    with pytest.raises(ValueError, match="R .* multiple of 128"):
        validate_static(*a.values(), compiled=True)
    wide = _arrays(n=8, r=128, page=16)
    validate_static(*wide.values(), compiled=True)
    with pytest.raises(ValueError, match="page_size 8 a multiple of 16 \\(c_kv stored as uint16"):
        narrow = _arrays(n=8, r=128, page=8) | dict(c_kv=jnp.zeros((6, 8, 128), jnp.uint16))
        validate_static(*narrow.values(), kv_dtype=jnp.bfloat16, compiled=True)
    with pytest.raises(ValueError, match="N \\(heads, 4\\) a multiple of 8"):
        validate_static(*_arrays(n=4, r=128, page=16).values(), compiled=True)
    with pytest.raises(ValueError, match="q_tiles"):
        ref_ragged_paged_attention(*a.values(), scale=1.0, q_tiles=(1, 8))
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention_kernel(*a.values(), scale=1.0, block_q=0, interpret=True)
    with pytest.raises(ValueError, match="unknown impl"):
        ragged_paged_attention(*a.values(), scale=1.0, impl="cuda")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_rows=[3]), "num_rows"),
        (dict(cu_q_lens=[0, 3, 2]), "cu_q_lens must be non-negative and non-decreasing"),
        (dict(cu_q_lens=[-1, 3, 4]), "cu_q_lens must be non-negative"),
        (dict(cu_q_lens=[0, 3, 5]), "cu_q_lens\\[num_rows\\]"),
        (dict(kv_lens=[13, 2]), "kv_lens must be in"),  # W * page = 12
        (dict(kv_lens=[-1, 2]), "kv_lens must be in"),
        (dict(kv_lens=[2, 2]), "row 0 has 3 queries but kv_lens 2"),
        (dict(page_indices=[[0, 6, 0], [0, 0, 0]]), "page_indices of row 0"),  # P = 6
        (dict(page_indices=[[0, 0, 0], [-1, 0, 0]]), "page_indices of row 1"),
    ],
)
def test_dynamic_validator(change, match):
    a = _arrays() | {k: jnp.asarray(v, jnp.int32) for k, v in change.items()}
    with pytest.raises(ValueError, match=match):
        validate_dynamic(a["q_lat"], a["c_kv"], *list(a.values())[4:])
    with pytest.raises(ValueError, match=match):  # the dispatch checks concrete metadata
        ragged_paged_attention(*a.values(), scale=1.0, impl="jnp")


def test_dynamic_validator_ignores_what_no_row_reads():
    """Page-table entries past a row's pages and padding rows' metadata may hold anything."""
    a = _arrays() | dict(
        kv_lens=jnp.array([5, -7], jnp.int32),  # row 1 is padding (num_rows = 1)
        page_indices=jnp.array([[0, 1, -4], [99, -1, 7]], jnp.int32),  # row 0 uses 2 pages
        cu_q_lens=jnp.array([0, 3, 1], jnp.int32),
        num_rows=jnp.array([1], jnp.int32),
    )
    validate_dynamic(a["q_lat"], a["c_kv"], *list(a.values())[4:])
