"""ragged_paged_attention's Mosaic GPU kernel (`pallas_kernels.ragged_paged_attention_gpu`):
under Mosaic GPU's interpreter here (simulated SMEM, barriers and copies; the wgmmas as jnp
products of the same bf16 terms) and compiled on a Hopper GPU (accelerator("gpu"): the device
suite runs those), against the float64 dense attention of test_ragged_paged_attention.py.

Tolerance: 1e-5 of the output's scale, as for the other implementations: the kernel's fp32
operands are split into three bf16 terms (24 bits), so its products are fp32's to within the
terms' last bit; measured 2-6e-7 here, 2.2e-6 on an H200. Every fixture NaN-poisons the slots no
row reads (unused slots of a row's last page, pages of other rows) and fills page-table entries
past a row's pages with garbage, out-of-range indices included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import ragged_paged_attention_gpu as gpu
from pallas_kernels import ragged_paged_gpu_plan
from pallas_kernels.dispatch import lowering_for
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.test_ragged_paged_attention import MIX, check, dense_attention, make_batch

WIDTH = dict(n=16, r=64, dr=64)  # the narrowest bands the kernel takes (rows of 64 bf16)
SCALE = 0.125


def run(batch, impl="gpu_interpret"):
    return ragged_paged_attention(*batch.args(), scale=SCALE, impl=impl)


def grouped_batch(rng, rows, *, page_size=16, groups=2, heads=8, d=64, k_dtype=np.float32):
    """A GQA batch built from an MLA one: V (bf16) and K of `groups` heads per slot, NaN where
    no row reads; returns (args, float64 reference)."""
    b = make_batch(rng, rows, page_size=page_size, n=groups * heads, r=8, dr=8)
    p = b.c_kv.shape[0]
    v = rng.standard_normal((p, page_size, groups, d)).astype(np.float32)
    k = rng.standard_normal((p, page_size, groups, d)).astype(np.float32)
    v[~b.used], k[~b.used] = np.nan, np.nan
    v = np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32))
    k = np.asarray(jnp.asarray(k, k_dtype).astype(jnp.float32))
    q = rng.standard_normal((b.q_pe.shape[0], groups * heads, d)).astype(np.float32)
    want = np.zeros(q.shape)
    for g in range(groups):
        h = slice(g * heads, (g + 1) * heads)
        want[:, h] = dense_grouped(b, q[:, h], k[:, :, g], v[:, :, g])
    args = (
        None,
        jnp.asarray(q),
        jnp.asarray(v, jnp.bfloat16),
        jnp.asarray(k, k_dtype),
        *b.args()[4:],
    )
    return args, want, b.padding


def dense_grouped(b, q, k, v):
    """f64[T, heads, D]: one KV head's attention (rows, causal mask and pages of batch b)."""
    q, out, ps = q.astype(np.float64), np.zeros((*q.shape[:2], v.shape[-1])), v.shape[1]
    for row in range(int(b.num_rows[0])):
        start, end, kv = b.cu_q_lens[row], b.cu_q_lens[row + 1], b.kv_lens[row]
        if start == end:
            continue
        s = np.arange(kv)
        pages = b.page_indices[row, s // ps]
        scores = SCALE * q[start:end] @ k[pages, s % ps].astype(np.float64).T
        pos = kv - (end - start) + np.arange(end - start)
        scores = np.where((s[None, :] <= pos[:, None])[:, None, :], scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[start:end] = (w / w.sum(-1, keepdims=True)) @ v[pages, s % ps].astype(np.float64)
    return out


@st.composite
def small_mixes(draw):
    """Up to 4 rows (decode, prefill chunk, no new tokens) of contexts up to 200 (the
    interpreter runs every program in turn), padding tokens."""
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        kv = draw(st.integers(1, 200))
        rows.append((draw(st.sampled_from([0, 1, min(kv, draw(st.integers(2, 20)))])), kv))
    return rows, draw(st.integers(0, 3))


class GpuKernelTest:
    IMPL = "gpu_interpret"

    @pytest.mark.parametrize("page_size", [8, 16, 64])
    def test_mix_against_dense(self, page_size):
        """Decode rows, a prefill chunk, an empty row, page-boundary lengths, padding tokens."""
        b = make_batch(
            np.random.default_rng(page_size),
            MIX,
            page_size=page_size,
            pad_tokens=3,
            c_dtype=jnp.bfloat16,
            **WIDTH,
        )
        check(run(b, self.IMPL), dense_attention(b, SCALE), b.padding)

    def test_latent_stored_as_bits(self):
        b = make_batch(
            np.random.default_rng(1), MIX[:3], page_size=16, c_dtype=jnp.bfloat16, **WIDTH
        )
        bits = jax.lax.bitcast_convert_type(jnp.asarray(b.c_kv), jnp.uint16)
        got = ragged_paged_attention(
            *b.args(c_kv=bits), scale=SCALE, kv_dtype=jnp.bfloat16, impl=self.IMPL
        )
        check(got, dense_attention(b, SCALE), b.padding)

    @pytest.mark.parametrize("k_dtype", [np.float32, jnp.bfloat16])
    def test_grouped_form(self, k_dtype):
        """GQA: 2 KV heads of 8 query heads each, K fp32 (three terms) or bf16 (one)."""
        args, want, padding = grouped_batch(np.random.default_rng(2), MIX, k_dtype=k_dtype)
        got = ragged_paged_attention(*args, scale=SCALE, impl=self.IMPL)
        check(got, want, padding)


class TestGpuInterpret(GpuKernelTest):
    @settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=small_mixes())
    def test_ragged_mixes(self, data):
        """hypothesis over ragged batches: row counts, query and kv lengths, empty rows."""
        rows, pad = data
        b = make_batch(
            np.random.default_rng(len(rows)),
            rows,
            page_size=16,
            pad_tokens=pad,
            c_dtype=jnp.bfloat16,
            **WIDTH,
        )
        check(run(b), dense_attention(b, SCALE), b.padding)

    def test_a_wrong_first_position_is_caught(self, monkeypatch):
        """Each item's first query position one slot later (a causal mask one off): the
        comparison fails."""
        b = make_batch(np.random.default_rng(3), MIX, page_size=16, c_dtype=jnp.bfloat16, **WIDTH)
        items = gpu.token_items
        monkeypatch.setattr(
            gpu, "token_items", lambda *a: items(*a)._replace(first=items(*a).first - 1)
        )
        with pytest.raises(AssertionError, match="relative error"):
            check(run(b), dense_attention(b, SCALE), b.padding)

    def test_supports_names_what_it_refuses(self):
        b = make_batch(
            np.random.default_rng(4), MIX[:2], page_size=4, c_dtype=jnp.bfloat16, **WIDTH
        )
        a = b.args()
        assert "page_size 4" in gpu.unsupported(*a[:4], a[5], jnp.bfloat16, jnp.float32)
        assert "float32, not bfloat16" in gpu.unsupported(*a[:4], a[5], jnp.float32, jnp.float32)
        with pytest.raises(ValueError, match="does not take"):
            run(make_batch(np.random.default_rng(4), MIX[:2], page_size=4, **WIDTH))

    def test_cuda_lowering_takes_the_kernel_where_supported(self):
        """impl None lowered for CUDA: the Mosaic GPU call for bf16 bands, jnp for fp32 ones."""
        for c_dtype, kernel in ((jnp.bfloat16, True), (np.float32, False)):
            b = make_batch(
                np.random.default_rng(5), MIX[:2], page_size=16, c_dtype=c_dtype, **WIDTH
            )
            with lowering_for("cuda"):
                f = jax.jit(lambda *a: ragged_paged_attention(*a, scale=SCALE))
                text = jax.export.export(f, platforms=["cuda"])(*b.args()).mlir_module()
            assert ("mosaic_gpu" in text) is kernel


def test_query_terms_are_exact_under_jit():
    """Q's three bf16 terms (split by masking bits, so no compiler may elide them) sum to the
    fp32 value exactly, jitted as in a step; each term is below the last's 2**-8."""
    scales = 10.0 ** np.arange(-4, 4).repeat(512)
    x = (np.random.default_rng(6).standard_normal(4096) * scales).astype(np.float32)
    split = jax.jit(ragged_paged_gpu_plan.split3_bits)
    terms = [np.asarray(t, np.float64) for t in split(jnp.asarray(x))]
    np.testing.assert_array_equal(sum(terms), x.astype(np.float64))
    for big, small in zip(terms, terms[1:], strict=False):
        assert (np.abs(small) <= np.abs(big) * 2.0**-7 + 1e-38).all()


@pytest.mark.accelerator("gpu")
class TestGpuCompiled(GpuKernelTest):
    IMPL = "pallas"

    def test_jitted_long_rows(self):
        """Jitted as the engine runs it, rows of 1-2k slots (many blocks, several kv splits): an
        H200 found XLA eliding the conversions of a rounding split here (3e-3 errors)."""
        rows = [(1, 2000), (1, 1500), (7, 1024)]
        b = make_batch(
            np.random.default_rng(7), rows, page_size=16, c_dtype=jnp.bfloat16, n=16, r=512, dr=64
        )
        f = jax.jit(lambda *a: ragged_paged_attention(*a, scale=SCALE, impl=self.IMPL))
        check(f(*b.args()), dense_attention(b, SCALE), b.padding)

    def test_model_width(self):
        """V2-Lite's bands (R 512, Dr 64, 16 heads) and V3's heads (128)."""
        for n in (16, 128):
            b = make_batch(
                np.random.default_rng(n), MIX, page_size=16, n=n, r=512, dr=64, c_dtype=jnp.bfloat16
            )
            check(run(b, self.IMPL), dense_attention(b, SCALE), b.padding)
