"""splice_rotate: the row reference, the runs implementations (jnp, Pallas TPU) and the planning
of runs, against hand-worked cases and a float64 numpy model (the Mosaic GPU kernel, which
takes c rows of 128 elements and k rows of 128 bytes and up: tests/test_splice_rotate_gpu.py).

The row reference (`splice_rotate_ref`) is tested on its own first. Every runs test then runs
for each implementation and compares it with both the reference (fed the same moves as rows by
`runs_to_rows`) and the float64 model: `RunsJnpTest` (the CPU path), `RunsKernelTest` (the
compiled TPU kernel; TPU only), and its interpret-mode twin `RunsTpuSemanticsTest` (the TPU
kernel under the TPU-semantics interpreter, which executes the in-place aliasing as hardware
would; the same kernel under Pallas' generic interpreter adds nothing it checks and took ~70 s
here).

Tolerances. `c` is moved bit-exact (rtol=atol=0). Rotated `k`: the math is fp32 — cos/sin of
phases up to ~1e5 rad (fp32 argument reduction is exact for an fp32 input, result within ~1 ulp),
four products and two sums for the rotation, four more for the vector: a few fp32 ulps relative
to the vector's norm. Bound: 2e-6 x |k| for fp32 storage; bf16 storage adds one rounding of the
result, 2**-8 relative: 4e-3 x |k|. Two implementations within that of the model are within
twice it of each other.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.splice_rotate import (
    TARGETS,
    Runs,
    as_bits,
    phase_table,
    plan_runs,
    runs_to_rows,
    splice_rotate,
    splice_rotate_jnp,
    splice_rotate_ref,
    splice_rotate_tpu,
    validate_dynamic,
    validate_runs_dynamic,
    validate_static,
)

PAGE = 16


def rotate64(k_rows: np.ndarray, pos_from, pos_to, inv_freq) -> np.ndarray:
    """float64 model: rotate halves-layout vectors (the last axis holds Dk / D of them) from
    phase pos_from*inv (fp32, as the model computes it) to phase pos_to*inv, exactly."""
    inv = np.asarray(inv_freq, np.float32)
    a = (np.asarray(pos_from, np.float32)[:, None] * inv).astype(np.float64)
    b = (np.asarray(pos_to, np.float32)[:, None] * inv).astype(np.float64)
    ang = b - a
    x = np.asarray(k_rows, np.float64)
    shape, d = x.shape, 2 * len(inv)
    x = x.reshape(*shape[:-1], shape[-1] // d, d)
    h = d // 2
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    y = np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)
    return y.reshape(shape)


def inv_freq(d: int, base: float = 10000.0) -> jnp.ndarray:
    return jnp.asarray(1.0 / base ** (np.arange(0, d, 2) / d), jnp.float32)


def f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


# ---- the row reference ----------------------------------------------------------------------
def test_ref_hand_worked_quarter_turn():
    # head_dim 2, inv_freq pi/2, from position 0 to 1: angle pi/2 maps (x, y) to (-y, x)
    c = np.arange(1 * 4 * 3, dtype=np.float32).reshape(1, 4, 3)
    k = np.array([[[3.0, 5.0], [0, 0], [0, 0], [0, 0]]], np.float32)
    i = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731
    out_c, out_k = splice_rotate_ref(c, k, i(0), i(2), i(0), i(1), jnp.asarray([math.pi / 2]))
    np.testing.assert_allclose(out_k[0, 2], [-5.0, 3.0], atol=1e-6)
    np.testing.assert_array_equal(out_c[0, 2], c[0, 0])
    # from 1 back to 0 is the inverse quarter turn: (x, y) -> (y, -x)
    _, out_k = splice_rotate_ref(c, k, i(0), i(3), i(1), i(0), jnp.asarray([math.pi / 2]))
    np.testing.assert_allclose(out_k[0, 3], [5.0, -3.0], atol=1e-6)


@pytest.mark.parametrize("k_dtype, rel", [(jnp.float32, 2e-6), (jnp.bfloat16, 4e-3)])
@pytest.mark.parametrize("table", [False, True], ids=["trig", "table"])
def test_ref_deltas_and_long_positions(k_dtype, rel, table):
    """Δ in {0, ±1, ±(page-1), ±page, ±(page+1), ±1024}, positions up to 100k, rows in no
    order; against the float64 model."""
    rng = np.random.default_rng(0)
    layers, slots, r, d = 2, 64 * PAGE, 24, 16
    deltas = [0, 1, -1, PAGE - 1, -(PAGE - 1), PAGE, -PAGE, PAGE + 1, -(PAGE + 1), 1024, -1024]
    pairs = [(b, min(b + dl, 100_000)) for b in [0, 5, 1500, 37_000, 99_000] for dl in deltas]
    pos_from, pos_to = (np.array(p) for p in zip(*[p for p in pairs if p[1] >= 0], strict=True))
    m = len(pos_from)
    src = rng.permutation(slots // 2)[:m]
    dst = slots // 2 + rng.permutation(slots // 2)[:m]
    c = rng.standard_normal((layers, slots, r)).astype(np.float32)
    k = jnp.asarray(rng.standard_normal((layers, slots, d)), k_dtype)
    inv = inv_freq(d)
    kw = dict(table=phase_table(inv, 100_001)) if table else {}
    idx = [jnp.asarray(a, jnp.int32) for a in (src, dst, pos_from, pos_to)]
    out_c, out_k = splice_rotate_ref(jnp.asarray(c), k, *idx, inv, **kw)
    np.testing.assert_array_equal(np.asarray(out_c)[:, dst], c[:, src])  # moved bit-exact
    want = rotate64(f32(k)[:, src], pos_from, pos_to, inv)
    err = np.abs(f32(out_k)[:, dst] - want).max(-1)
    assert (err <= rel * np.linalg.norm(want, axis=-1)).all()
    zero = pos_from == pos_to  # Δ = 0 is the identity up to cos^2 + sin^2 rounding
    np.testing.assert_allclose(f32(out_k)[:, dst[zero]], f32(k)[:, src[zero]], rtol=rel, atol=rel)


@pytest.mark.xla_default
def test_ref_block_loop_matches_one_block():
    """The reference moves in a loop of blocks: block sizes that do not divide M (padding in
    the last block) give bit for bit the one-block result, and it differs from the input."""
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


# ---- planning runs --------------------------------------------------------------------------
def test_plan_runs_hand_worked():
    """Runs break where source, destination or a position stops advancing by one, and every
    `max_run` rows; expanded back (`runs_to_rows`) they are the rows, padding after."""
    src = np.array([0, 1, 2, 3, 4, 5, 9, 10, 20, 21, 22])
    dst = np.array([50, 51, 52, 60, 61, 62, 63, 64, 70, 71, 72])  # breaks after row 2
    pos_from = np.array([0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 14])  # and before the last
    pos_to = pos_from + 7
    runs = plan_runs(src, dst, pos_from, pos_to, max_run=4)
    assert runs.src.tolist() == [0, 3, 9, 20, 22]  # src breaks after 5 and after 10
    assert runs.dst.tolist() == [50, 60, 63, 70, 72]
    assert runs.length.tolist() == [3, 3, 2, 2, 1]
    assert runs.pos_from.tolist() == [0, 3, 9, 11, 14]
    assert runs.pos_to.tolist() == [7, 10, 16, 18, 21]
    long = plan_runs(np.arange(10), np.arange(10) + 20, np.arange(10), np.arange(10), max_run=4)
    assert long.length.tolist() == [4, 4, 2] and long.src.tolist() == [0, 4, 8]
    s, d, pf, pt = (np.asarray(a) for a in runs_to_rows(runs, max_run=4, slots=99))
    real = d != 99
    for got, want in zip((s, d, pf, pt), (src, dst, pos_from, pos_to), strict=True):
        np.testing.assert_array_equal(got[real], want)
    assert real.sum() == 11 and len(d) == 5 * 4
    empty = plan_runs(*[np.zeros(0, np.int32)] * 4)
    assert all(len(a) == 0 for a in empty)


# ---- the runs implementations ---------------------------------------------------------------
def runs_of(src, dst, length, pos_from, pos_to) -> Runs:
    return Runs(*(np.asarray(a, np.int32) for a in (src, dst, length, pos_from, pos_to)))


def make_runs(rng, lengths, slots, pos_pairs, max_run=PAGE):
    """Runs of the given lengths (0: padding), sources in the first half of the pool and
    destinations in the second, each run's rows inside one page-aligned window of `max_run`
    rows at a random offset (so runs end anywhere in a page), at the given positions."""
    n, windows = len(lengths), slots // 2 // max_run
    ws, wd = (rng.permutation(windows)[:n] for _ in range(2))
    src, dst = [], []
    for length, a, b in zip(lengths, ws, wd, strict=True):
        src.append(a * max_run + rng.integers(0, max_run - length + 1))
        dst.append(slots // 2 + b * max_run + rng.integers(0, max_run - length + 1))
    return runs_of(src, dst, lengths, *zip(*pos_pairs, strict=True))


def spliced(impl, c, k, runs, inv, **kw):
    """Stacked [L, S, D] arrays -> per-layer pools (copies: the kernels donate them) ->
    splice_rotate(impl=impl) -> stacked numpy arrays."""
    out = splice_rotate(
        tuple(jnp.array(x) for x in c),
        tuple(jnp.array(x) for x in k),
        Runs(*(jnp.asarray(a, jnp.int32) for a in runs)),
        jnp.asarray(inv),
        impl=impl,
        **kw,
    )
    return [np.stack([np.asarray(x) for x in band]) for band in out]


def model64(c, k, runs, inv):
    """What the run contract says: expected (c, k) in float64, from the runs directly."""
    want_c, want_k = np.array(c), f32(k).astype(np.float64)
    for s, d, n, pf, pt in zip(*runs, strict=True):
        t = np.arange(n)
        want_c[:, d + t] = c[:, s + t]
        for layer in range(k.shape[0]):
            want_k[layer, d + t] = rotate64(f32(k)[layer, s + t], pf + t, pt + t, inv)
    return want_c, want_k


class RunsJnpTest:
    IMPL = "jnp"

    def run(self, c, k, runs, inv, **kw):
        return spliced(self.IMPL, c, k, runs, inv, **kw)

    def check(self, c, k, runs, inv, rel, **kw):
        """The implementation against the row reference and the float64 model (c bit-exact;
        k within rel x |k| of the model and 2 rel x |k| of the reference, row by row)."""
        out_c, out_k = self.run(c, k, runs, inv, **kw)
        rows = runs_to_rows(runs, max_run=PAGE, slots=c.shape[1])
        ref_c, ref_k = splice_rotate_ref(jnp.asarray(c), jnp.asarray(k), *rows, inv, **kw)
        want_c, want_k = model64(c, k, runs, inv)
        np.testing.assert_array_equal(np.asarray(ref_c), want_c)
        np.testing.assert_array_equal(out_c, want_c)
        dst = np.concatenate([np.arange(d, d + n) for d, n in zip(*runs[1:3], strict=True)])
        untouched = np.setdiff1d(np.arange(c.shape[1]), dst)  # bit-identical, NaN == NaN here
        np.testing.assert_array_equal(out_k[:, untouched], np.asarray(k)[:, untouched])
        got, ref, want = f32(out_k)[:, dst], f32(ref_k)[:, dst], want_k[:, dst]
        norm = np.linalg.norm(want, axis=-1)
        assert (np.abs(got - want).max(-1) <= rel * norm).all()
        assert (np.abs(ref - want).max(-1) <= rel * norm).all()
        assert (np.abs(got - ref).max(-1) <= 2 * rel * norm).all()
        return out_c, out_k

    def test_hand_worked_quarter_turn(self):
        # head_dim 2, inv_freq pi/2, from position 0 to 1: angle pi/2 maps (x, y) to (-y, x)
        c = np.arange(1 * 4 * 3, dtype=np.float32).reshape(1, 4, 3)
        k = np.array([[[3.0, 5.0], [0, 0], [0, 0], [0, 0]]], np.float32)
        out_c, out_k = self.run(c, k, runs_of([0], [2], [1], [0], [1]), [math.pi / 2])
        np.testing.assert_allclose(out_k[0, 2], [-5.0, 3.0], atol=1e-6)
        np.testing.assert_array_equal(out_c[0, 2], c[0, 0])
        np.testing.assert_array_equal(out_k[0, 3], k[0, 3])  # one row: its neighbour stays

    @pytest.mark.parametrize(
        "k_dtype, rel, table",
        [(jnp.float32, 2e-6, False), (jnp.float32, 2e-6, True), (jnp.bfloat16, 4e-3, False)],
        ids=["f32-trig", "f32-table", "bf16-trig"],
    )
    def test_lengths_deltas_and_long_positions(self, k_dtype, rel, table):
        """Every run length 1..16 (all the TPU kernel's power-of-two piece sets), padding runs,
        Δ of both signs across page boundaries up to ±1024, positions up to 100k; cos/sin
        computed or looked up in a phase table (the jnp path's; the kernels compute them)."""
        rng = np.random.default_rng(0)
        lengths = [*range(1, PAGE + 1), 0, 13, 0]
        deltas = [0, 1, -1, PAGE - 1, -PAGE, PAGE + 1, 1024, -1024, 7, -3]
        base = [1500, 37_000, 99_000, 1030, 5000]
        pairs = [(b, b + deltas[i % len(deltas)]) for i, b in enumerate(base * 4)][: len(lengths)]
        pairs[0] = (0, 5)  # position 0, where RoPE is the identity
        slots = 64 * PAGE
        runs = make_runs(rng, lengths, slots, pairs)
        c = rng.standard_normal((2, slots, 24)).astype(np.float32)
        k = jnp.asarray(rng.standard_normal((2, slots, 16)), k_dtype)
        if table and self.IMPL != "jnp":
            pytest.skip("only the jnp path looks cos/sin up; the kernels compute them")
        kw = dict(table=phase_table(inv_freq(16), 100_100)) if table else {}
        self.check(c, k, runs, inv_freq(16), rel, **kw)

    def test_pools_stored_as_bits_and_several_vectors_per_row(self):
        """bf16 bands stored as raw uint16 bits (how the paged state keeps them) with k_dtype
        naming what the bits mean give bit for bit the result of the typed bf16 bands; a k row
        of two vectors (GQA: a slot's KV heads) rotates each in its own halves layout."""
        rng = np.random.default_rng(4)
        c = jnp.asarray(rng.standard_normal((2, 8 * PAGE, 12)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((2, 8 * PAGE, 12)), jnp.bfloat16)  # 2 x D = 6
        runs = make_runs(rng, [5, 16, 11, 0], 8 * PAGE, [(900, 17), (3, 40), (20, 20), (0, 0)])
        typed = self.check(np.asarray(c), k, runs, inv_freq(6), 4e-3)
        bits = self.run(as_bits(c), as_bits(k), runs, inv_freq(6), k_dtype=jnp.bfloat16)
        assert bits[0].dtype == np.uint16 and bits[1].dtype == np.uint16
        np.testing.assert_array_equal(bits[0], np.asarray(as_bits(jnp.asarray(typed[0]))))
        np.testing.assert_array_equal(bits[1], np.asarray(as_bits(jnp.asarray(typed[1]))))
        assert (typed[1] != np.asarray(k)).any()  # it did rotate

    def test_untouched_rows_poison_padding_and_the_pool_ends(self):
        """Rows no run names keep their bits (`check`); rows past a run's end (inside the window
        a kernel loads) and past the pool's end are never read: NaN there stays out of the
        result; length-0 runs write nothing wherever they point (here: into real data); a run
        may read from the pool's first slot and up to its last."""
        rng = np.random.default_rng(1)
        slots = 8 * PAGE
        c = rng.standard_normal((2, slots, 8)).astype(np.float32)
        k = rng.standard_normal((2, slots, 4)).astype(np.float32)
        runs = runs_of(  # run 3 reads the pool's last slots: a loaded window would overrun
            [0, 20, 56, slots - 3, 0, 5],
            [80, slots - 16, 96, 104, 20, 33],  # the last two: padding into sources and page 2
            [9, 12, 8, 3, 0, 0],
            [0, 20, 56, slots - 3, 1, 2],
            [6, 30, 50, 100, 9, 9],
        )
        live = np.zeros(slots, bool)
        for s, n in zip(runs.src, runs.length, strict=True):
            live[s : s + n] = True
        live[2 * PAGE : 3 * PAGE] = True  # a page of real data nothing moves
        c[:, ~live], k[:, ~live] = np.nan, np.nan
        out_c, out_k = self.check(c, k, runs, inv_freq(4), 2e-6)
        dst = np.concatenate([np.arange(d, d + n) for d, n in zip(*runs[1:3], strict=True)])
        assert np.isfinite(out_c[:, dst]).all() and np.isfinite(out_k[:, dst]).all()

    def test_hazards_are_rejected(self):
        """The dispatch validates concrete runs: a destination that is a source, destinations
        named twice, a run longer than max_run or past the pool's end."""
        c, k = np.zeros((1, 64, 8), np.float32), np.zeros((1, 64, 4), np.float32)
        with pytest.raises(ValueError, match="hazard"):  # run 1 writes run 2's sources
            self.run(c, k, runs_of([0, 20], [20, 40], [8, 4], [0, 0], [0, 0]), inv_freq(4))
        with pytest.raises(ValueError, match="distinct"):
            self.run(c, k, runs_of([0, 10], [40, 45], [8, 4], [0, 0], [0, 0]), inv_freq(4))
        with pytest.raises(ValueError, match="length"):
            self.run(c, k, runs_of([0], [40], [17], [0], [0]), inv_freq(4))
        with pytest.raises(ValueError, match="destination slot is out of range"):
            self.run(c, k, runs_of([0], [60], [8], [0], [0]), inv_freq(4))


class RunsKernelTest(RunsJnpTest):
    """The compiled TPU kernel, on a TPU (the device suite runs it there)."""

    IMPL = "pallas"
    pytestmark = pytest.mark.accelerator("tpu")  # GPU: test_splice_rotate_gpu.py


class RunsTpuSemanticsTest(RunsJnpTest):
    IMPL = "tpu_interpret"


# collected by pytest (names start with Test)
TestRunsJnp = RunsJnpTest
TestRunsKernel = RunsKernelTest
TestRunsTpuSemantics = RunsTpuSemanticsTest


@pytest.mark.xla_default
def test_jnp_block_loop_matches_one_block():
    """The jnp path moves the runs' rows in a loop of blocks: blocks that do not divide the
    rows (padding in the last block, some blocks past the last real row) give bit for bit the
    one-block result, which equals the reference."""
    rng = np.random.default_rng(6)
    c = jnp.asarray(rng.standard_normal((2, 16 * PAGE, 8)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 16 * PAGE, 4)), jnp.float32)
    runs = make_runs(
        rng, [16, 5, 0, 11, 13], 16 * PAGE, [(3, 900), (40, 7), (0, 0), (5, 6), (99, 2)]
    )
    rows = runs_to_rows(runs, max_run=PAGE, slots=16 * PAGE)
    ref = splice_rotate_ref(c, k, *rows, inv_freq(4))
    for block in (1, 7, 16, 256):
        out = splice_rotate_jnp(
            tuple(jnp.array(x) for x in c),
            tuple(jnp.array(x) for x in k),
            runs,
            inv_freq(4),
            block=block,
        )
        for got, want in zip(out, ref, strict=True):
            np.testing.assert_array_equal(np.stack([np.asarray(x) for x in got]), np.asarray(want))


def test_block_loops_at_xla_default_settings():
    """The two block-loop tests above at XLA's own settings, in a process of their own (under
    the suite's cheap settings the loop emitters round the rotation's last bit differently
    from one block size to another)."""
    env = {**os.environ, "LEYLINE_TEST_XLA_OPT": "default", "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    run = subprocess.run(
        [*cmd, "-k", "block_loop_matches"], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-3000:]


# ---- the hazard the no-overlap rule prevents ------------------------------------------------
def test_overlapping_moves_are_rejected_and_would_be_caught():
    """Destinations that are also sources are a read-after-write hazard for the in-place
    kernels. The validators reject them; and run anyway under the TPU-semantics interpreter,
    the in-place TPU kernel disagrees with the reference: the comparisons above would catch a
    kernel that read after writing."""
    rng = np.random.default_rng(3)
    c = jnp.asarray(rng.standard_normal((1, 64, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 64, 4)), jnp.float32)
    src = jnp.arange(20)
    dst = src + 3  # shifting within one region: later reads see earlier writes
    pos = jnp.zeros(20, jnp.int32)
    with pytest.raises(ValueError, match="hazard"):
        validate_dynamic(c, src, dst)
    runs = plan_runs(np.arange(20), np.arange(20) + 3, np.zeros(20), np.zeros(20), max_run=4)
    with pytest.raises(ValueError, match="hazard"):
        validate_runs_dynamic(64, runs, 4)
    ref = splice_rotate_ref(c, k, src, dst, pos, pos, inv_freq(4))
    import jax.experimental.pallas.tpu as pltpu

    out = splice_rotate_tpu(
        (jnp.array(c[0]),),
        (jnp.array(k[0]),),
        runs,
        inv_freq(4),
        max_run=4,
        interpret=pltpu.InterpretParams(),
    )
    assert np.abs(np.asarray(out[0][0]) - np.asarray(ref[0][0])).max() > 0.1


# ---- validators and the dispatch ------------------------------------------------------------
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
    validate_static(c, jnp.zeros((2, 32, 12)), i, i, i, i, jnp.zeros(3))  # two vectors a row
    with pytest.raises(ValueError, match="distinct"):
        validate_dynamic(c, np.array([0, 1]), np.array([5, 5]))
    with pytest.raises(ValueError, match="source slot is out of range"):
        validate_dynamic(c, np.array([40]), np.array([5]))
    validate_dynamic(c, np.array([0, 1]), np.array([5, 32]))  # 32 = padding: fine
    cs, ks, inv = (jnp.zeros((32, 8)),), (jnp.zeros((32, 4)),), jnp.zeros(2)
    runs = Runs(i, i, i, i, i)
    with pytest.raises(ValueError, match="unknown impl"):
        splice_rotate(cs, ks, runs, inv, impl="cuda")
    with pytest.raises(ValueError, match="runs.length"):
        splice_rotate(cs, ks, runs._replace(length=jnp.zeros(2, jnp.int32)), inv)
    with pytest.raises(ValueError, match="one c and one k pool per layer"):
        splice_rotate(cs, ks * 2, runs, inv)
    with pytest.raises(ValueError, match="source slot is out of range"):
        validate_runs_dynamic(32, runs_of([30], [0], [3], [0], [0]), 16)
    validate_runs_dynamic(32, runs_of([40], [99], [0], [0], [0]), 16)  # padding: fine


def test_dispatch_picks_the_kernel_per_backend(monkeypatch):
    """impl=None: jnp on CPU; on a GPU or a TPU each kernel's version for it (both kernels have
    both). Interpreters exist for the targets a kernel has."""
    from pallas_kernels import ragged_paged_attention as rpa

    assert dispatch.resolve(None, TARGETS) == ("jnp", None, None)
    assert dispatch.resolve("interpret", TARGETS)[:2] == ("interpret", "tpu")
    assert dispatch.resolve("gpu_interpret", TARGETS) == ("gpu_interpret", "gpu", True)
    with pytest.raises(ValueError, match="unknown impl 'gpu_interpret'"):
        dispatch.resolve("gpu_interpret", ("tpu",))
    assert dispatch.resolve("gpu_interpret", rpa.TARGETS) == ("gpu_interpret", "gpu", True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dispatch.resolve(None, TARGETS) == ("pallas", "gpu", False)
    assert dispatch.resolve("interpret", TARGETS) == ("interpret", "gpu", True)
    assert dispatch.resolve(None, rpa.TARGETS) == ("pallas", "gpu", False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert dispatch.resolve(None, TARGETS) == ("pallas", "tpu", False)
    assert dispatch.resolve(None, rpa.TARGETS) == ("pallas", "tpu", False)
