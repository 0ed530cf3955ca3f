"""The splice's Mosaic GPU kernel (`pallas_kernels.splice_rotate_gpu`): under Mosaic GPU's
interpreter here (simulated SMEM, barriers and copies) and compiled on a Hopper GPU (the device
suite runs those: accelerator only), against the float64 model and the jnp path.

Shapes are ones the kernel takes (`unsupported` is None: rows of both bands of 128 bytes,
window x D/2 a multiple of 256), each band both typed and stored as raw bits. A program takes a
block of runs and walks their (run, layer) items through two SMEM buffers: the tests run one run
a program (the default at these sizes), several, a block larger than the runs, and a last block
padded with empty runs, over odd and even numbers of layers (the buffers' alternation then
carries across runs or restarts with each). Mosaic GPU's interpreter runs each copy at once, so
an item read from the buffer the next item's copies land in reads the next item's rows: the
value checks see a wrong buffer (shown by a broken variant). Tolerances as
in test_splice_rotate.py: `c` bit-exact; rotated `k` within 2e-6 x |k| of the float64 model for
fp32 storage (4e-3 for bf16), and within 1e-6 x |k| of the jnp path, which computes cos/sin by
the same identities."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import splice_rotate_gpu as gpu
from pallas_kernels.dispatch import lowering_for
from pallas_kernels.splice_rotate import Runs, as_bits, splice_rotate
from tests.test_splice_rotate import PAGE, f32, inv_freq, make_runs, model64, runs_of, spliced

SLOTS = 64 * PAGE


def pools(rng, layers=2, c_width=128, k_width=64, c_dtype=jnp.bfloat16, k_dtype=jnp.float32):
    c = jnp.asarray(rng.standard_normal((layers, SLOTS, c_width)), c_dtype)
    k = jnp.asarray(rng.standard_normal((layers, SLOTS, k_width)), k_dtype)
    return np.array(c), np.array(k)


class GpuKernelTest:
    IMPL = "gpu_interpret"

    def run(self, c, k, runs, inv, block=None, **kw):
        """The kernel on stacked [L, S, D] arrays: through the dispatch (`splice_rotate`), or
        with `block` runs a program (the kernel's own entry)."""
        if block is None:
            return spliced(self.IMPL, c, k, runs, inv, **kw)
        out = gpu.splice_rotate_gpu(
            tuple(jnp.array(x) for x in c),
            tuple(jnp.array(x) for x in k),
            Runs(*(jnp.asarray(a, jnp.int32) for a in runs)),
            jnp.asarray(inv),
            block=block,
            interpret=self.IMPL == "gpu_interpret",
            **kw,
        )
        return [np.stack([np.asarray(x) for x in band]) for band in out]

    def check(self, c, k, runs, inv, rel, block=None, **kw):
        """c bit-exact at the destinations and untouched elsewhere (bits: NaN == NaN); k within
        rel x |k| of the float64 model and 1e-6 x |k| of the jnp path, row by row."""
        out_c, out_k = self.run(c, k, runs, inv, block, **kw)
        jnp_c, jnp_k = spliced("jnp", c, k, runs, inv, **kw)
        typed = kw.get("k_dtype", k.dtype)
        as_typed = lambda x: f32(jax.lax.bitcast_convert_type(jnp.asarray(x), typed))  # noqa: E731
        want_c, want_k = model64(c, as_typed(k), runs, inv)
        np.testing.assert_array_equal(np.asarray(as_bits(out_c)), np.asarray(as_bits(want_c)))
        dst = np.concatenate([np.arange(d, d + n) for d, n in zip(*runs[1:3], strict=True)])
        untouched = np.setdiff1d(np.arange(SLOTS), dst)
        np.testing.assert_array_equal(as_bits(out_k[:, untouched]), as_bits(k[:, untouched]))
        got, want = as_typed(out_k)[:, dst], want_k[:, dst]
        near = as_typed(jnp_k)[:, dst]
        norm = np.linalg.norm(want, axis=-1)
        assert (np.abs(got - want).max(-1) <= rel * norm).all()
        assert (np.abs(got - near).max(-1) <= 1e-6 * norm).all()
        np.testing.assert_array_equal(out_c, jnp_c)
        return out_c, out_k

    def test_every_length_both_signs_long_positions(self):
        """Every run length 0..16 (every set of pieces), Δ of both signs across pages up to
        ±1024, positions up to 100k: MLA's band (fp32 `k_pe` of 64, bf16 latent)."""
        rng = np.random.default_rng(0)
        lengths = [*range(PAGE + 1), 13]
        deltas = [0, 1, -1, PAGE - 1, -PAGE, PAGE + 1, 1024, -1024, 7, -3]
        base = [1500, 37_000, 99_000, 1030, 5000]
        pairs = [(b, b + deltas[i % len(deltas)]) for i, b in enumerate(base * 4)][: len(lengths)]
        pairs[1] = (0, 5)  # position 0, where RoPE is the identity
        c, k = pools(rng)
        self.check(c, k, make_runs(rng, lengths, SLOTS, pairs), inv_freq(64), 2e-6)

    def test_bits_and_several_vectors_per_row(self):
        """Both bands stored as raw uint16 bits of bf16, a k row of two vectors (GQA's heads),
        each rotated in its own halves."""
        rng = np.random.default_rng(4)
        c, k = pools(rng, c_width=128, k_width=128, k_dtype=jnp.bfloat16)
        runs = make_runs(rng, [5, 16, 11, 0, 1, 3], SLOTS, [(900, 17), (3, 40)] * 3)
        out = self.check(as_bits(c), as_bits(k), runs, inv_freq(64), 4e-3, k_dtype=jnp.bfloat16)
        assert out[1].dtype == np.uint16 and (out[1] != np.asarray(as_bits(k))).any()

    @pytest.mark.parametrize("block", [None, 3])
    def test_poisoned_rows_are_never_read(self, block):
        """Every row no run reads is NaN (unused pages, the window past a run's end): the moved
        rows stay finite; runs read the pool's first and last slots; one run a program and three
        (a last block of one run and two empty ones)."""
        rng = np.random.default_rng(1)
        c, k = pools(rng, layers=3, c_dtype=jnp.float32)
        runs = runs_of(
            [0, 20, SLOTS - 3, 56],
            [SLOTS - 16, 80, 100, 200],
            [9, 12, 3, 0],
            [0, 20, 4, 1],
            [6, 30, 9, 9],
        )
        live = np.zeros(SLOTS, bool)
        for s, n in zip(runs.src, runs.length, strict=True):
            live[s : s + n] = True
        c[:, ~live], k[:, ~live] = np.nan, np.nan
        out_c, out_k = self.check(c, k, runs, inv_freq(64), 2e-6, block)
        dst = np.concatenate([np.arange(d, d + n) for d, n in zip(*runs[1:3], strict=True)])
        assert np.isfinite(out_c[:, dst]).all() and np.isfinite(out_k[:, dst]).all()

    @pytest.mark.parametrize("layers", [2, 3])
    @pytest.mark.parametrize("block", [1, 2, 4, 8])
    def test_blocks_of_runs(self, block, layers):
        """Six runs (two empty) one, two, four (a last block of two runs and two of padding) and
        eight (one program, two padding runs) a program, over an even and an odd number of
        layers: every run's rows land, from wherever in their pages, at any positions."""
        rng = np.random.default_rng(7 + layers)
        c, k = pools(rng, layers=layers)
        lengths = [16, 0, 5, 13, 0, 1]
        pairs = [(1500, 1490), (0, 0), (37_000, 38_024), (3, 20), (9, 9), (99_000, 97_976)]
        self.check(c, k, make_runs(rng, lengths, SLOTS, pairs), inv_freq(64), 2e-6, block)

    @pytest.mark.parametrize("length", [0, 1, 11, PAGE])
    def test_one_run(self, length):
        """A splice of one run (a program of one item a layer; of no rows: nothing moves)."""
        rng = np.random.default_rng(length)
        c, k = pools(rng)
        runs = make_runs(rng, [length], SLOTS, [(4000, 17)])
        out_c, out_k = self.check(c, k, runs, inv_freq(64), 2e-6)
        if length == 0:
            np.testing.assert_array_equal(as_bits(out_c), as_bits(c))
            np.testing.assert_array_equal(as_bits(out_k), as_bits(k))

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        lengths=st.lists(st.integers(0, PAGE), min_size=8, max_size=8),
        shifts=st.lists(st.integers(-2048, 2048), min_size=8, max_size=8),
        seed=st.integers(0, 2**16),
    )
    def test_ragged_runs(self, lengths, shifts, seed):
        """Any lengths (empty runs included), anywhere in their pages, at any positions."""
        rng = np.random.default_rng(seed)
        pairs = [
            (p, max(0, p + d)) for p, d in zip(rng.integers(0, 50_000, 8), shifts, strict=True)
        ]
        c, k = pools(rng)
        self.check(c, k, make_runs(rng, lengths, SLOTS, pairs), inv_freq(64), 2e-6)


class TestGpuInterpret(GpuKernelTest):
    pass


class TestGpuCompiled(GpuKernelTest):
    """The compiled kernel on a Hopper GPU (the device suite runs these)."""

    IMPL = "pallas"
    pytestmark = pytest.mark.accelerator("gpu")


def test_a_wrong_slot_is_caught(monkeypatch):
    """Pieces of one run sharing window rows (the 2-row piece moved onto the 1-row one's): a
    run of 3 rows then moves a wrong row, and the check sees it."""
    rng = np.random.default_rng(2)
    c, k = pools(rng)
    runs = make_runs(rng, [3, 7, 16], SLOTS, [(10, 12)] * 3)
    right = gpu.slot
    monkeypatch.setattr(
        gpu, "slot", lambda size, w: right(size, w) if size != 2 else gpu.pl.ds(13, 2)
    )
    jax.clear_caches()
    with pytest.raises(AssertionError):
        TestGpuInterpret().check(c, k, runs, inv_freq(64), 2e-6)
    monkeypatch.undo()
    jax.clear_caches()
    TestGpuInterpret().check(c, k, runs, inv_freq(64), 2e-6)


def test_a_wrong_buffer_is_caught(monkeypatch):
    """Every item through one buffer: the next item's copies, issued before an item is stored,
    land in the rows it is about to rotate and store (the next layer's rows, or at a run's end
    the next run's), and the check sees it; with the two buffers the same splice passes."""
    rng = np.random.default_rng(3)
    c, k = pools(rng, layers=3)
    runs = make_runs(rng, [7, 16, 0, 3], SLOTS, [(10, 300), (500, 40), (0, 0), (77, 7)])
    monkeypatch.setattr(gpu, "buffer", lambda item: 0 * item)
    jax.clear_caches()
    with pytest.raises(AssertionError):
        TestGpuInterpret().check(c, k, runs, inv_freq(64), 2e-6, 2)
    monkeypatch.undo()
    jax.clear_caches()
    TestGpuInterpret().check(c, k, runs, inv_freq(64), 2e-6, 2)


def test_runs_per_program():
    """One run a program until there are two programs an SM of a 132-SM Hopper, then more, up
    to MAX_BLOCK; a bad block is refused."""
    runs = (1, 16, 512, 527, 528, 1024, 4096, 1 << 16)
    many = gpu.MAX_BLOCK
    assert [gpu.runs_per_program(r) for r in runs] == [1, 1, 1, 1, 2, 3, many, many]
    c, k = (jnp.zeros((SLOTS, 128), jnp.bfloat16),), (jnp.zeros((SLOTS, 64)),)
    with pytest.raises(ValueError, match="block 0 must be positive"):
        gpu.splice_rotate_gpu(c, k, runs_of([0], [40], [3], [0], [1]), inv_freq(64), block=0)


def test_shapes_it_does_not_take_are_refused():
    """A c or k row off 128 bytes, a window x D/2 under two values a lane or buffers past
    shared memory: a clear error, and the default dispatch keeps such pools on the jnp
    path."""
    c, k = np.zeros((1, SLOTS, 8), np.float32), np.zeros((1, SLOTS, 64), np.float32)
    runs = runs_of([0], [40], [3], [0], [1])
    odd_k = [jnp.zeros((4, 40), jnp.bfloat16)]  # 80 bytes
    assert "k row (40 x bfloat16)" in gpu.unsupported([jnp.zeros((4, 128))], odd_k, inv_freq(20))
    assert "shared memory" in gpu.unsupported(
        [jnp.zeros((4, 128))], [jnp.zeros((4, 4096), jnp.bfloat16)], inv_freq(64)
    )
    assert "c row (40 x bfloat16)" in gpu.unsupported(
        [jnp.zeros((4, 40), jnp.bfloat16)], [jnp.zeros((4, 64))], inv_freq(32)
    )
    with pytest.raises(ValueError, match=r"c row \(8 x float32\) is not a multiple of 128 bytes"):
        gpu.splice_rotate_gpu(
            tuple(map(jnp.asarray, c)), tuple(map(jnp.asarray, k)), runs, inv_freq(64)
        )
    assert "window 16 x D/2 4" in gpu.unsupported(
        [jnp.zeros((4, 128))], [jnp.zeros((4, 64))], inv_freq(8)
    )
    assert (
        gpu.unsupported([jnp.zeros((4, 512), jnp.bfloat16)], [jnp.zeros((4, 64))], inv_freq(64))
        is None
    )

    def lowered_for_cuda(c_width):
        c = (jnp.zeros((SLOTS, c_width), jnp.float32),)
        k = (jnp.zeros((SLOTS, 64), jnp.float32),)
        fn = jax.jit(lambda c, k, r, i: splice_rotate(c, k, r, i))
        with lowering_for("cuda"):
            return jax.export.export(fn, platforms=["cuda"])(c, k, runs, inv_freq(64))

    assert "mosaic_gpu" not in lowered_for_cuda(8).mlir_module()  # such pools: jnp on CUDA too
    assert "mosaic_gpu" in lowered_for_cuda(128).mlir_module()  # pools it takes: the kernel
