"""splice_rotate: the jnp reference and the Pallas kernel, against hand-worked cases and a
float64 numpy model.

Every test runs for each implementation: `SpliceRotateRefTest` (jnp), `SpliceRotateKernelTest`
(compiled Pallas, TPU only), and its interpret-mode twins `...InterpretTest` (Pallas' generic
interpreter) and `...TpuInterpretTest` (the TPU-semantics interpreter, which executes the
in-place aliasing as hardware would).

Tolerances. `c` is moved bit-exact (rtol=atol=0). Rotated `k`: the math is fp32 — cos/sin of
phases up to ~1e5 rad (fp32 argument reduction is exact for an fp32 input, result within ~1 ulp),
four products and two sums for the rotation, four more for the vector: a few fp32 ulps relative
to the vector's norm. Bound: 2e-6 x |k| for fp32 storage; bf16 storage adds one rounding of the
result, 2**-8 relative: 4e-3 x |k|.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.splice_rotate import (
    as_bits,
    phase_table,
    splice_rotate,
    splice_rotate_kernel,
    splice_rotate_ref,
    validate_dynamic,
    validate_static,
)

PAGE = 16


def rotate64(k_rows: np.ndarray, pos_from, pos_to, inv_freq) -> np.ndarray:
    """float64 model: rotate halves-layout rows from phase pos_from*inv (fp32, as the model
    computes it) to phase pos_to*inv, exactly."""
    inv = np.asarray(inv_freq, np.float32)
    a = (np.asarray(pos_from, np.float32)[:, None] * inv).astype(np.float64)
    b = (np.asarray(pos_to, np.float32)[:, None] * inv).astype(np.float64)
    ang = b - a
    x = np.asarray(k_rows, np.float64)
    h = x.shape[-1] // 2
    c, s = np.cos(ang), np.sin(ang)
    return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)


def inv_freq(d: int, base: float = 10000.0) -> jnp.ndarray:
    return jnp.asarray(1.0 / base ** (np.arange(0, d, 2) / d), jnp.float32)


class SpliceRotateRefTest:
    IMPL = "jnp"

    def run(self, c, k, src, dst, pos_from, pos_to, inv, **kw):
        args = [jnp.asarray(a, jnp.int32) for a in (src, dst, pos_from, pos_to)]
        # copies: the kernel path donates its pool arrays
        out = splice_rotate(
            jnp.array(c), jnp.array(k), *args, jnp.asarray(inv), impl=self.IMPL, **kw
        )
        return [np.asarray(x) for x in out]

    def test_hand_worked_quarter_turn(self):
        # head_dim 2, inv_freq pi/2, from position 0 to 1: angle pi/2 maps (x, y) to (-y, x)
        c = np.arange(1 * 4 * 3, dtype=np.float32).reshape(1, 4, 3)
        k = np.array([[[3.0, 5.0], [0, 0], [0, 0], [0, 0]]], np.float32)
        out_c, out_k = self.run(c, k, [0], [2], [0], [1], [math.pi / 2])
        np.testing.assert_allclose(out_k[0, 2], [-5.0, 3.0], atol=1e-6)
        np.testing.assert_array_equal(out_c[0, 2], c[0, 0])
        # from 1 back to 0 is the inverse quarter turn: (x, y) -> (y, -x)
        _, out_k = self.run(c, k, [0], [3], [1], [0], [math.pi / 2])
        np.testing.assert_allclose(out_k[0, 3], [5.0, -3.0], atol=1e-6)

    @pytest.mark.parametrize("k_dtype, rel", [(jnp.float32, 2e-6), (jnp.bfloat16, 4e-3)])
    @pytest.mark.parametrize("table", [False, True], ids=["trig", "table"])
    def test_deltas_and_long_positions(self, k_dtype, rel, table):
        """Δ in {0, ±1, ±(page-1), ±page, ±(page+1), ±1024}, positions up to 100k."""
        rng = np.random.default_rng(0)
        layers, slots, r, d = 2, 64 * PAGE, 24, 16
        deltas = [0, 1, -1, PAGE - 1, -(PAGE - 1), PAGE, -PAGE, PAGE + 1, -(PAGE + 1), 1024, -1024]
        base = [0, 5, 1500, 37_000, 99_000]
        pos_from, pos_to = [], []
        for b in base:
            for dl in deltas:
                if b + dl >= 0 and b >= 0:
                    pos_from.append(b)
                    pos_to.append(min(b + dl, 100_000))
        m = len(pos_from)
        src = rng.permutation(slots // 2)[:m]
        dst = slots // 2 + rng.permutation(slots // 2)[:m]
        c = rng.standard_normal((layers, slots, r)).astype(np.float32)
        k = jnp.asarray(rng.standard_normal((layers, slots, d)), k_dtype)
        inv = inv_freq(d)
        kw = dict(table=phase_table(inv, 100_001)) if table else {}
        out_c, out_k = self.run(c, k, src, dst, pos_from, pos_to, inv, **kw)
        np.testing.assert_array_equal(out_c[:, dst], c[:, src])  # moved bit-exact
        want = rotate64(np.asarray(k, np.float32)[:, src], pos_from, pos_to, inv)
        err = np.abs(out_k[:, dst].astype(np.float64) - want).max(-1)
        norm = np.linalg.norm(want, axis=-1)
        assert (err <= rel * norm).all(), (err / norm).max()
        # Δ = 0 is the identity up to cos^2 + sin^2 rounding
        zero = np.array(pos_from) == np.array(pos_to)
        np.testing.assert_allclose(
            out_k[:, dst[zero]].astype(np.float32),
            np.asarray(k, np.float32)[:, src[zero]],
            rtol=rel,
            atol=rel,
        )

    def test_pools_stored_as_bits(self):
        """A bf16 band stored as raw uint16 bits (how the paged state keeps it) with k_dtype
        naming what the bits mean gives bit for bit the result of the typed bf16 band."""
        rng = np.random.default_rng(4)
        c = jnp.asarray(rng.standard_normal((2, 4 * PAGE, 8)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((2, 4 * PAGE, 6)), jnp.bfloat16)
        src, dst = np.arange(5, 25), np.arange(40, 60)
        pos_from, pos_to = np.arange(20) + 900, np.arange(20) + 17
        typed = self.run(c, k, src, dst, pos_from, pos_to, inv_freq(6))
        bits = self.run(
            as_bits(c), as_bits(k), src, dst, pos_from, pos_to, inv_freq(6), k_dtype=jnp.bfloat16
        )
        assert bits[0].dtype == np.uint16 and bits[1].dtype == np.uint16
        np.testing.assert_array_equal(bits[0], typed[0].view(np.uint16))
        np.testing.assert_array_equal(bits[1], typed[1].view(np.uint16))
        assert (typed[1][:, dst] != np.asarray(k)[:, src]).any()  # it did rotate

    def test_untouched_rows_are_bit_identical_and_poison_is_not_read(self):
        rng = np.random.default_rng(1)
        layers, slots = 2, 8 * PAGE
        c = rng.standard_normal((layers, slots, 8)).astype(np.float32)
        k = rng.standard_normal((layers, slots, 4)).astype(np.float32)
        src = np.arange(PAGE, 2 * PAGE)  # page 1 moves to page 5
        dst = np.arange(5 * PAGE, 6 * PAGE)
        poison = np.ones(slots, bool)
        poison[src] = False
        poison[np.arange(2 * PAGE, 3 * PAGE)] = False  # page 2 stays as real data
        c[:, poison], k[:, poison] = np.nan, np.nan
        out_c, out_k = self.run(c, k, src, dst, src, src + 3, inv_freq(4))
        assert np.isfinite(out_c[:, dst]).all() and np.isfinite(out_k[:, dst]).all()
        untouched = np.setdiff1d(np.arange(slots), dst)
        np.testing.assert_array_equal(out_c[:, untouched], c[:, untouched])  # NaN == NaN here
        np.testing.assert_array_equal(out_k[:, untouched], k[:, untouched])

    def test_padding_rows_write_nothing(self):
        rng = np.random.default_rng(2)
        c = rng.standard_normal((1, 4 * PAGE, 8)).astype(np.float32)
        k = rng.standard_normal((1, 4 * PAGE, 4)).astype(np.float32)
        slots = 4 * PAGE
        out_c, out_k = self.run(c, k, [0, 1, 2], [40, slots, 42], [0, 1, 2], [9, 9, 9], inv_freq(4))
        np.testing.assert_array_equal(out_c[:, 41], c[:, 41])
        np.testing.assert_array_equal(out_c[:, [40, 42]], c[:, [0, 2]])


class SpliceRotateKernelTest(SpliceRotateRefTest):
    IMPL = "pallas"

    @pytest.fixture(autouse=True)
    def _needs_tpu(self):
        if jax.default_backend() != "tpu":
            pytest.skip("the compiled kernel targets TPU; its interpret twins run here")


class SpliceRotateKernelInterpretTest(SpliceRotateKernelTest):
    IMPL = "interpret"

    @pytest.fixture(autouse=True)
    def _needs_tpu(self):
        return None


class SpliceRotateKernelTpuInterpretTest(SpliceRotateKernelInterpretTest):
    IMPL = "tpu_interpret"


# collected by pytest (names start with Test)
TestSpliceRotateRef = SpliceRotateRefTest
TestSpliceRotateKernel = SpliceRotateKernelTest
TestSpliceRotateKernelInterpret = SpliceRotateKernelInterpretTest
TestSpliceRotateKernelTpuInterpret = SpliceRotateKernelTpuInterpretTest


# ---- the hazard the no-overlap rule prevents ------------------------------------------------
def test_overlapping_moves_are_rejected_and_would_be_caught():
    """Destinations that are also sources are a read-after-write hazard for the in-place kernel.
    The dynamic validator rejects them; and run anyway under the TPU-semantics interpreter, the
    in-place kernel disagrees with the reference: the comparison above would catch a kernel that
    read after writing."""
    rng = np.random.default_rng(3)
    c = jnp.asarray(rng.standard_normal((1, 64, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 64, 4)), jnp.float32)
    src = jnp.arange(20)
    dst = src + 3  # shifting within one region: later reads see earlier writes
    pos = jnp.zeros(20, jnp.int32)
    with pytest.raises(ValueError, match="hazard"):
        validate_dynamic(c, src, dst)
    ref = splice_rotate_ref(c, k, src, dst, pos, pos, inv_freq(4))
    import jax.experimental.pallas.tpu as pltpu

    out = splice_rotate_kernel(
        jnp.array(c),
        jnp.array(k),
        src,
        dst,
        pos,
        pos,
        inv_freq(4),
        interpret=pltpu.InterpretParams(),
    )
    assert np.abs(np.asarray(out[0]) - np.asarray(ref[0])).max() > 0.1


def test_ref_block_loop_matches_one_block():
    """The jnp path moves in a loop of blocks: block sizes that do not divide M (padding in the
    last block) give bit for bit the one-block result, and it differs from the input there."""
    rng = np.random.default_rng(5)
    c = jnp.asarray(rng.standard_normal((2, 128, 8)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 128, 4)), jnp.float32)
    src, dst = jnp.arange(0, 45), jnp.arange(60, 105)
    pf, pt = jnp.arange(45) + 3, jnp.arange(45) + 1000
    one = splice_rotate_ref(c, k, src, dst, pf, pt, inv_freq(4), block=1024)
    for block in (1, 7, 16):
        out = splice_rotate_ref(c, k, src, dst, pf, pt, inv_freq(4), block=block)
        for a, b in zip(out, one, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(one[1])[:, 60:105], np.asarray(k)[:, 60:105])


def test_phase_table_is_the_models_phases():
    """The looked-up cos/sin are the model's RoPE cos/sin at each position (same fp32 phase,
    same backend functions), so a table splice and a trig splice agree bit for bit."""
    from leyline_jax import rope

    inv = inv_freq(8)
    table = np.asarray(phase_table(inv, 5000))
    pos = jnp.asarray([0, 1, 17, 4095, 4999])
    ph = jax.jit(rope.phases)(pos, inv)  # the model's phase, then its cos/sin under jit
    cos, sin = jax.jit(lambda p: (jnp.cos(p), jnp.sin(p)))(ph)
    np.testing.assert_array_equal(table[np.asarray(pos)], np.concatenate([cos, sin], -1))
    # a table one position off would be caught
    off = table[np.asarray(pos)[:-1] + 1]
    assert not np.array_equal(off, np.concatenate([cos, sin], -1)[:-1])


def test_validators():
    c, k = jnp.zeros((2, 32, 8)), jnp.zeros((2, 32, 4))
    i = jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match="even"):
        validate_static(c, jnp.zeros((2, 32, 3)), i, i, i, i, jnp.zeros(1))
    with pytest.raises(ValueError, match="inv_freq"):
        validate_static(c, k, i, i, i, i, jnp.zeros(3))
    with pytest.raises(ValueError, match="pos_to"):
        validate_static(c, k, i, i, i, jnp.zeros(2, jnp.int32), jnp.zeros(2))
    with pytest.raises(ValueError, match="integer"):
        validate_static(c, k, i, i, i, jnp.zeros(3), jnp.zeros(2))
    with pytest.raises(ValueError, match="distinct"):
        validate_dynamic(c, np.array([0, 1]), np.array([5, 5]))
    with pytest.raises(ValueError, match="source slot is out of range"):
        validate_dynamic(c, np.array([40]), np.array([5]))
    validate_dynamic(c, np.array([0, 1]), np.array([5, 32]))  # 32 = padding: fine
    with pytest.raises(ValueError, match="unknown impl"):
        splice_rotate(c, k, i, i, i, i, jnp.zeros(2), impl="cuda")
    with pytest.raises(ValueError, match="hazard"):  # the dispatch validates concrete inputs
        splice_rotate(c, k, jnp.arange(3), jnp.arange(3) + 1, i, i, jnp.zeros(2))
