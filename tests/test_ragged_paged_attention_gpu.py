"""ragged_paged_attention's Mosaic GPU kernel (`pallas_kernels.ragged_paged_attention_gpu`):
under Mosaic GPU's interpreter here (simulated SMEM, barriers and copies; the wgmmas as jnp
products of the same bf16 terms) and compiled on a Hopper GPU (accelerator("gpu"): the device
suite runs those), against the float64 dense attention of test_ragged_paged_attention.py and the
jnp reference; its split schedule and combine (`pallas_kernels.ragged_paged_gpu_plan`) on their
own, each against a hand-worked case or a float64 model, and each shown to fail when broken.

Tolerance: 1e-5 of the output's scale, as for the other implementations: the kernel's fp32
operands are split into three bf16 terms (24 bits), so its products are fp32's to within the
terms' last bit; measured 2-6e-7 here, 2.2e-6 on an H200. Every fixture NaN-poisons the slots no
row reads (unused slots of a row's last page, pages of other rows) and fills page-table entries
past a row's pages with garbage, out-of-range indices included.

Splits. The kernel's programs are `num_sms` * (programs an SM holds) persistent parts per head
block; its tests here run with 1-8 SMs, so rows of a few hundred slots already take several
units (splits) and the combine merges them. Kernel calls are jitted with fixed shapes so that
hypothesis' examples reuse one interpreted program."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pallas_kernels import ragged_paged_attention_gpu as gpu
from pallas_kernels import ragged_paged_gpu_plan as gp
from pallas_kernels.dispatch import lowering_for, mosaic_gpu_interpret
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.test_ragged_paged_attention import MIX, check, dense_attention, make_batch

WIDTH = dict(n=16, r=64, dr=64)  # the narrowest bands the kernel takes (rows of 64 bf16)
SCALE = 0.125


def run(batch, impl="gpu_interpret"):
    return ragged_paged_attention(*batch.args(), scale=SCALE, impl=impl)


@functools.cache
def kernel(interpret, num_sms: int, k_type=jnp.float32, schedule=None, combine=None):
    """The kernel jitted at these knobs (one program per shape, reused across examples)."""
    kw = dict(schedule=schedule or gp.split_schedule, combine=combine or gp.combine_units)
    return jax.jit(
        functools.partial(
            gpu.ragged_paged_attention_gpu,
            scale=SCALE,
            kv_type=jnp.bfloat16,
            k_type=k_type,
            interpret=interpret,
            num_sms=num_sms,
            **kw,
        )
    )


def units_per_row(args, num_sms: int, k_type=jnp.float32) -> np.ndarray:
    """i64[B]: how many units (kv splits) of one head block each row's items take."""
    q_lat, q_pe, c_kv, k_pe, kv_lens, page_indices, cu_q_lens, num_rows = args
    plan = gp.plan_for(q_lat, q_pe, c_kv, k_pe, page_indices, jnp.dtype(k_type), num_sms=num_sms)
    items = gp.token_items(kv_lens, cu_q_lens, num_rows, plan)
    sched = gp.split_schedule(items, plan)
    item = np.asarray(sched.item)
    rows = np.asarray(items.row)[item[item < plan.items]]
    return np.bincount(rows, minlength=kv_lens.shape[0])


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


SPLIT_T, SPLIT_KV, SPLIT_PAGE = 16, 700, 16  # the fixed shapes of the split property test


@st.composite
def split_mixes(draw):
    """Up to 5 rows of contexts 0..700 (up to 11 kv blocks) with 0, 1 or a few queries (none
    when the row is empty), padding tokens, and 1, 2 or 5 SMs: one split and many, rows
    shorter than a split, empty rows."""
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        kv = draw(st.integers(0, SPLIT_KV) | st.sampled_from([1, 63, 64, 65, 128, SPLIT_KV]))
        q = draw(st.sampled_from([0, 1, 3])) if kv else 0
        rows.append((min(q, kv), kv))
    pad = draw(st.integers(0, SPLIT_T - 3 * len(rows) - 1))
    return rows, pad, draw(st.sampled_from([1, 2, 5])), draw(st.integers(0, 2**16))


# ---- the kernel, interpreted and compiled ----------------------------------------------------
class GpuKernelTest:
    IMPL = "gpu_interpret"

    @property
    def interpret(self) -> bool:
        return self.IMPL == "gpu_interpret"

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

    def test_one_split_and_many(self):
        """Over 3 SMs: a long row cut into several units, rows shorter than a split (one unit),
        a row without queries (none), a 3-token row (three items of one token, a unit each),
        page-boundary lengths; the kernel against float64 and against the jnp reference."""
        rows = [(1, 900), (1, 40), (0, 300), (3, 70), (1, 64), (1, 1)]
        b = make_batch(np.random.default_rng(8), rows, page_size=16, c_dtype=jnp.bfloat16, **WIDTH)
        units = units_per_row(b.args(), 3)
        assert units[0] >= 3 and list(units[1:6]) == [1, 0, 3, 1, 1], units
        got = kernel(self.interpret, 3)(*b.args())
        check(got, dense_attention(b, SCALE), b.padding)
        ref = ragged_paged_attention(*b.args(), scale=SCALE, impl="jnp")
        check(got, np.asarray(ref, np.float64), b.padding)

    @pytest.mark.parametrize("k_dtype", [np.float32, jnp.bfloat16])
    def test_grouped_splits(self, k_dtype):
        """GQA over 2 SMs: each KV group's programs run the same split schedule."""
        rows = [(1, 700), (2, 300), (0, 20), (1, 5)]
        args, want, padding = grouped_batch(np.random.default_rng(3), rows, k_dtype=k_dtype)
        k_type = jnp.dtype(k_dtype)
        assert units_per_row(args, 2, k_type)[0] >= 2
        check(kernel(self.interpret, 2, k_type)(*args), want, padding)


class TestGpuInterpret(GpuKernelTest):
    @settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=small_mixes())
    def test_ragged_mixes(self, data):
        """hypothesis over ragged batches through the dispatch (all 132 SMs' parts): row counts,
        query and kv lengths, empty rows; fixed shapes, so one program."""
        rows, pad = data
        b = make_batch(
            np.random.default_rng(len(rows)),
            rows,
            page_size=16,
            t=84,
            w=13,
            p=56,
            pad_tokens=pad,
            c_dtype=jnp.bfloat16,
            **WIDTH,
        )
        check(_dispatch_jitted(*b.args()), dense_attention(b, SCALE), b.padding)

    @settings(
        max_examples=12,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=split_mixes())
    def test_split_mixes(self, data):
        """hypothesis over ragged rows and SM counts (fixed shapes: three programs in all): the
        kernel against float64 and the jnp reference, NaN in every slot no row reads."""
        rows, pad, sms, seed = data
        w = -(-SPLIT_KV // SPLIT_PAGE)
        b = make_batch(
            np.random.default_rng(seed),
            rows,
            page_size=SPLIT_PAGE,
            t=SPLIT_T,
            w=w,
            p=5 * w + 4,
            pad_tokens=pad,
            c_dtype=jnp.bfloat16,
            **WIDTH,
        )
        units = units_per_row(b.args(), sms)[: len(rows)]
        event(f"a row split in several units: {units.max() > 1}")
        event(f"a row of one unit: {(units == 1).any()}")
        event(f"a row without queries: {any(q == 0 for q, _ in rows)}")
        got = kernel(True, sms)(*b.args())
        check(got, dense_attention(b, SCALE), b.padding)
        ref = ragged_paged_attention(*b.args(), scale=SCALE, impl="jnp")
        check(got, np.asarray(ref, np.float64), b.padding)

    def test_one_program_per_shape(self):
        """The schedule is data: two steps of different rows (one split and many) at the same
        shapes run one compiled program."""
        shapes = dict(page_size=16, t=8, w=60, p=70, c_dtype=jnp.bfloat16, **WIDTH)
        steps = [[(1, 900), (2, 40)], [(1, 30), (1, 31), (3, 500), (0, 9)]]
        batches = [
            make_batch(np.random.default_rng(i), rows, **shapes) for i, rows in enumerate(steps)
        ]
        f = kernel(True, 2)
        jax.block_until_ready(f(*batches[0].args()))
        compiles = []

        def listener(name, duration, **_):
            if name == "/jax/core/compile/backend_compile_duration":
                compiles.append(duration)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            got = f(*batches[1].args())
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert not compiles
        check(got, dense_attention(batches[1], SCALE), batches[1].padding)

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

    @pytest.mark.parametrize("bound", ["lo", "hi"], ids=["counted_twice", "skipped"])
    def test_a_wrong_split_boundary_is_caught(self, bound):
        """The second unit of the long row starting one block early (that block counted in two
        units) or the first unit ending one block early (a block in none): the comparison
        fails; the schedule as made passes on the same batch."""
        rows = [(1, 900), (1, 40)]
        b = make_batch(np.random.default_rng(4), rows, page_size=16, c_dtype=jnp.bfloat16, **WIDTH)

        assert units_per_row(b.args(), 3)[0] >= 2  # row 0 (item 0) holds units 0 and 1

        def broken(items, plan):
            s = gp.split_schedule(items, plan)
            u = 1 if bound == "lo" else 0  # units 0 and 1 are row 0's first two
            return s._replace(**{bound: getattr(s, bound).at[u].add(-1)})

        want = dense_attention(b, SCALE)
        check(kernel(True, 3)(*b.args()), want, b.padding)
        with pytest.raises(AssertionError, match="relative error"):
            check(kernel(True, 3, schedule=broken)(*b.args()), want, b.padding)

    def test_a_combine_without_normalised_weights_is_caught(self):
        """Units merged with weights exp(lse - max) but not divided by their sum: fails."""
        b = make_batch(
            np.random.default_rng(5), [(1, 900)], page_size=16, c_dtype=jnp.bfloat16, **WIDTH
        )
        got = kernel(True, 3, combine=_unnormalised)(*b.args())
        with pytest.raises(AssertionError, match="relative error"):
            check(got, dense_attention(b, SCALE), b.padding)

    def test_a_combine_without_the_max_is_caught(self):
        """Scores near 100 (a latent column of 1s met by a query component of 800 * 0.125):
        units merged with exp(lse) overflow fp32 (lse > 88.7) to inf / inf; with the max
        subtracted the output is finite and right. Tolerance 3e-5 here: a score of ~100 holds
        fp32's half ulp, 3.8e-6, and the jnp path measures 1.6e-5 on this batch."""
        rows = [(1, 600), (3, 400), (1, 30), (0, 50)]
        b = make_batch(np.random.default_rng(0), rows, page_size=16, c_dtype=jnp.bfloat16, **WIDTH)
        c = np.asarray(b.c_kv, np.float32)
        c[..., 0] = np.where(b.used, 1.0, np.nan)
        q_lat = b.q_lat.copy()
        q_lat[..., 0] = 800.0
        b = dataclasses.replace(b, c_kv=np.asarray(jnp.asarray(c, jnp.bfloat16)), q_lat=q_lat)
        want = dense_attention(b, SCALE)
        check(kernel(True, 3)(*b.args()), want, b.padding, tol=3e-5)
        with pytest.raises(AssertionError, match="non-finite"):
            check(kernel(True, 3, combine=_without_max)(*b.args()), want, b.padding, tol=3e-5)

    def test_the_pipeline_has_no_race(self):
        """Under the interpreter's happens-before race detector (TMA copies on their own
        clock), the stages' loads and the matmuls' reads never overlap: no race, fp32 and bf16
        K; the same kernel with the rotated band's next load issued before its stage is read
        is flagged."""
        b = make_batch(
            np.random.default_rng(6), [(1, 300), (2, 150)], page_size=16, c_dtype=jnp.bfloat16,
            **WIDTH,
        )  # fmt: skip
        params = dataclasses.replace(mosaic_gpu_interpret(), detect_races=True)
        for k_type in (jnp.float32, jnp.bfloat16):
            args = (*b.args()[:3], b.args()[3].astype(k_type), *b.args()[4:])
            kernel(params, 2, k_type)(*args).block_until_ready()
            assert not _races_found(), k_type
        early = _kernel_with_early_k_load()
        got = early.ragged_paged_attention_gpu(
            *b.args(), scale=SCALE, kv_type=jnp.bfloat16, k_type=jnp.float32, interpret=params,
            num_sms=2,
        )  # fmt: skip
        jax.block_until_ready(got)
        assert _races_found()

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
        for c_dtype, kernel_call in ((jnp.bfloat16, True), (np.float32, False)):
            b = make_batch(
                np.random.default_rng(5), MIX[:2], page_size=16, c_dtype=c_dtype, **WIDTH
            )
            with lowering_for("cuda"):
                f = jax.jit(lambda *a: ragged_paged_attention(*a, scale=SCALE))
                text = jax.export.export(f, platforms=["cuda"])(*b.args()).mlir_module()
            assert ("mosaic_gpu" in text) is kernel_call


@jax.jit
def _dispatch_jitted(*args):
    return ragged_paged_attention(*args, scale=SCALE, impl="gpu_interpret")


def _unnormalised(o, lse, schedule, plan):
    """A wrong combine: weights relative to the max, never divided by their sum."""
    valid = schedule.item < plan.items
    item = jnp.minimum(schedule.item, plan.items - 1)
    o, lse = o.transpose(1, 0, 2, 3), lse.transpose(1, 0, 2)
    lse = jnp.where(valid[:, None, None], lse, -jnp.inf)
    top = jax.ops.segment_max(lse, item, num_segments=plan.items)
    w = jnp.where(valid[:, None, None], jnp.exp(lse - top[item]), 0.0)
    o = jnp.where(valid[:, None, None, None], o, 0.0)
    return jax.ops.segment_sum(o * w[:, :, None, :], item, num_segments=plan.items)


def _without_max(o, lse, schedule, plan):
    """A wrong combine: weights exp(lse), normalised, no max subtracted."""
    valid = schedule.item < plan.items
    item = jnp.minimum(schedule.item, plan.items - 1)
    o, lse = o.transpose(1, 0, 2, 3), lse.transpose(1, 0, 2)
    w = jnp.where(valid[:, None, None], jnp.exp(lse), 0.0)
    o = jnp.where(valid[:, None, None, None], o, 0.0)
    num = jax.ops.segment_sum(o * w[:, :, None, :], item, num_segments=plan.items)
    den = jax.ops.segment_sum(w, item, num_segments=plan.items)
    return num / jnp.where(den > 0, den, 1.0)[:, :, None, :]


def _races_found() -> bool:
    """Whether the interpreter's race detector flagged the last interpreted kernel (a private
    jax module in 0.10 and 0.11, as `mosaic_gpu_interpret`'s params are)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return bool(gpu_callbacks.get_races().races_found)


def _kernel_with_early_k_load():
    """The kernel module with one deliberate race: the fp32 rotated band's next block requested
    right after its stage's wait, before the stage is read and split."""
    lines = inspect.getsource(gpu).splitlines(keepends=True)
    request = [i for i, x in enumerate(lines) if "pl.when(blk + 1 < hi)" in x and "r.k_bar" in x]
    wait = [i for i, x in enumerate(lines) if x.strip() == "wait(blk, r.k_bar, 0)"]
    assert len(request) == len(wait) == 1 and wait[0] < request[0], "the kernel's K load moved"
    lines.insert(wait[0] + 1, lines.pop(request[0]))
    src = "".join(lines)
    namespace = {"__name__": "ragged_paged_attention_gpu_early_k"}
    exec(compile(src, "<early K load>", "exec"), namespace)  # noqa: S102
    return types.SimpleNamespace(**namespace)


def test_query_terms_are_exact_under_jit():
    """Q's three bf16 terms (split by masking bits, so no compiler may elide them) sum to the
    fp32 value exactly, jitted as in a step; each term is below the last's 2**-8."""
    scales = 10.0 ** np.arange(-4, 4).repeat(512)
    x = (np.random.default_rng(6).standard_normal(4096) * scales).astype(np.float32)
    split = jax.jit(gp.split3_bits)
    terms = [np.asarray(t, np.float64) for t in split(jnp.asarray(x))]
    np.testing.assert_array_equal(sum(terms), x.astype(np.float64))
    for big, small in zip(terms, terms[1:], strict=False):
        assert (np.abs(small) <= np.abs(big) * 2.0**-7 + 1e-38).all()


# ---- the split schedule and the combine, on their own ----------------------------------------
def _plan(*, items: int, parts: int, head_blocks: int = 1, tokens: int = 1) -> gp.Plan:
    """A Plan with only what the schedule reads set to what a test wants."""
    return gp.Plan(
        groups=1, hb=16, head_blocks=head_blocks, tokens=tokens, qc=16, items=items, k_terms=3,
        lat=True, stages=2, k_stages=1, smem=0, per_sm=1, parts=parts, units=items + parts,
    )  # fmt: skip


@functools.cache
def _scheduler(plan: gp.Plan, overhead: int):
    def f(kv_lens, cu_q_lens, num_rows):
        items = gp.token_items(kv_lens, cu_q_lens, num_rows, plan)
        return items, gp.split_schedule(items, plan, overhead=overhead)

    return jax.jit(f)


def schedule_of(rows, plan: gp.Plan, overhead: int = gp.OVERHEAD, b: int = 8):
    """(items, schedule) as numpy, for rows [(q_len, kv_len)] padded to b rows."""
    q = np.zeros(b, np.int32)
    kv = np.full(b, 7, np.int32)  # padding rows' kv_lens: garbage
    q[: len(rows)], kv[: len(rows)] = [r[0] for r in rows], [r[1] for r in rows]
    cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    args = (jnp.asarray(kv), jnp.asarray(cu), jnp.asarray([len(rows)], jnp.int32))
    items, sched = _scheduler(plan, overhead)(*args)
    return jax.tree.map(np.asarray, items), jax.tree.map(np.asarray, sched)


class TestSplitSchedule:
    def test_hand_worked(self):
        # overhead 2, 4 parts. Row 0: one query at position 639, 10 blocks: cost 12 on the axis
        # [0, 12), its blocks at [2, 12); row 1: 1 block, cost 3 at [12, 15). Total 15, a part's
        # span cap = max(ceil(15 / 4), 2 * 2) = 4: cuts at 0, 4, 8, 12 (none inside row 1).
        # Pieces: [0, 4) -> row 0's blocks [0, 2); [4, 8) -> [2, 6); [8, 12) -> [6, 10);
        # [12, 15) -> row 1's block [0, 1). One unit a part.
        _, s = schedule_of([(1, 640), (1, 64)], _plan(items=10, parts=4), overhead=2)
        np.testing.assert_array_equal(s.item[:5], [0, 0, 0, 1, 10])
        np.testing.assert_array_equal(s.lo[:4], [0, 2, 6, 0])
        np.testing.assert_array_equal(s.hi[:4], [2, 6, 10, 1])
        np.testing.assert_array_equal(s.begin, [0, 1, 2, 3, 4])
        # three rows of 3 blocks (cost 5 each: [0, 5), [5, 10), [10, 15)), 2 parts: cap
        # max(ceil(15 / 2), 4) = 8; the cut at 8 falls inside row 1, a short row (5 <= 8), and
        # moves to its nearer end, 10: part 0 takes rows 0 and 1 whole, part 1 row 2.
        _, s = schedule_of([(1, 192)] * 3, _plan(items=11, parts=2), overhead=2)
        np.testing.assert_array_equal(s.item[:4], [0, 1, 2, 11])
        np.testing.assert_array_equal(s.hi[:3] - s.lo[:3], [3, 3, 3])
        np.testing.assert_array_equal(s.begin, [0, 2, 3])

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(
        kv=st.lists(st.integers(0, 3000), min_size=1, max_size=8),
        kind=st.lists(st.sampled_from([0, 1, 5, 40]), min_size=8, max_size=8),
        parts=st.sampled_from([1, 3, 132]),
        tokens=st.sampled_from([1, 4]),
        overhead=st.sampled_from([0, gp.OVERHEAD]),
    )
    def test_every_block_once(self, kv, kind, parts, tokens, overhead):
        """Every kv block of every item in exactly one unit; units in part order, one item's
        contiguous; padding units empty; a short item one unit; no part more than a span and a
        short item's half past its share."""
        rows = [(min(q, k), k) for q, k in zip(kind, kv, strict=False)]
        plan = _plan(items=-(-sum(q for q, _ in rows) // tokens) + 8, parts=parts, tokens=tokens)
        items, s = schedule_of(rows, plan, overhead)
        blocks = np.where(items.ntok > 0, (items.first + items.ntok - 1 + gp.BK) // gp.BK, 0)
        n = int((s.item < plan.items).sum())
        assert (s.item[n:] == plan.items).all() and (s.lo[n:] == 0).all() and (s.hi[n:] == 0).all()
        seen = np.zeros((plan.items, max(1, blocks.max())), int)
        for i, lo, hi in zip(s.item[:n], s.lo[:n], s.hi[:n], strict=True):
            assert 0 <= lo < hi <= blocks[i]
            seen[i, lo:hi] += 1
        want = np.arange(seen.shape[1])[None, :] < blocks[:, None]
        np.testing.assert_array_equal(seen, want.astype(int))
        assert (np.diff(s.item[:n]) >= 0).all()  # item order, so one item's units contiguous
        assert s.begin[0] == 0 and s.begin[-1] == n and (np.diff(s.begin) >= 0).all()
        cost = np.where(blocks > 0, blocks + overhead, 0)
        cap = max(-(-cost.sum() // parts), 2 * overhead)
        units = np.bincount(s.item[:n], minlength=plan.items)
        assert (units[(cost > 0) & (cost <= cap)] == 1).all()
        load = [
            sum(s.hi[u] - s.lo[u] + overhead for u in range(s.begin[p], s.begin[p + 1]))
            for p in range(parts)
        ]
        assert max(load) <= 2 * cap + overhead  # each bound moves by half a short item at most

    def test_long_rows_spread_over_the_sms(self):
        """Decode at 32k: 128 rows over 132 parts, the busiest within 1% of the mean (each row
        in 2-3 units); one row alone over about every part."""
        plan = _plan(items=256, parts=132)
        items, s = schedule_of([(1, 32768)] * 128, plan, b=128)
        work = s.hi - s.lo + gp.OVERHEAD
        load = np.array([work[a:b].sum() for a, b in zip(s.begin[:-1], s.begin[1:], strict=True)])
        n = s.begin[-1]
        mean = (512 + gp.OVERHEAD) * 128 / 132
        assert load.max() <= 1.01 * mean and np.bincount(s.item[:n]).max() <= 3
        _, s = schedule_of([(1, 32768)], _plan(items=9, parts=132))
        assert (np.diff(s.begin) > 0).sum() >= 120


def test_combine_matches_float64_and_its_breakages_fail():
    """Partial results of 3 items in 1, 3 and 0 units (lse from -120 to 120: past fp32's exp
    range both ways), against a float64 merge; without the max, or unnormalised, it fails."""
    rng = np.random.default_rng(7)
    plan = _plan(items=3, parts=2, head_blocks=2)
    sched = gp.Schedule(
        item=jnp.asarray([0, 1, 1, 1, 3], jnp.int32),  # one padding unit
        lo=jnp.zeros(5, jnp.int32),
        hi=jnp.ones(5, jnp.int32),
        begin=jnp.asarray([0, 2, 4], jnp.int32),
    )
    o = rng.standard_normal((2, 5, 8, 16)).astype(np.float32)
    lse = rng.uniform(-120, 120, (2, 5, 16)).astype(np.float32)
    o[:, 4], lse[:, 4] = np.nan, np.nan  # a padding unit's memory: never written
    want = np.zeros((3, 2, 8, 16))
    for i, units in ((0, [0]), (1, [1, 2, 3])):
        w = np.exp(lse[:, units].astype(np.float64) - lse[:, units].max(1, keepdims=True))
        w = w / w.sum(1, keepdims=True)  # [head_blocks, units, qc]
        want[i] = (o[:, units] * w[:, :, None, :]).sum(1)
    got = np.asarray(gp.combine_units(jnp.asarray(o), jnp.asarray(lse), sched, plan))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    for wrong in (_without_max, _unnormalised):
        bad = np.asarray(wrong(jnp.asarray(o), jnp.asarray(lse), sched, plan))
        assert not np.isfinite(bad).all() or np.abs(bad - want).max() > 1e-2, wrong.__name__


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

    def test_decode_at_32k_over_every_sm(self):
        """Decode rows of 32k, 20k and 100 slots at V2-Lite's widths, pages of 64, all 132 SMs:
        the long rows cut into ~130 units, merged by the combine."""
        rows = [(1, 32768), (1, 20000), (1, 100)]
        b = make_batch(
            np.random.default_rng(9), rows, page_size=64, n=16, r=512, dr=64, c_dtype=jnp.bfloat16
        )
        assert units_per_row(b.args(), gp.NUM_SMS)[0] > 60
        got = kernel(False, gp.NUM_SMS)(*b.args())
        check(got, dense_attention(b, SCALE), b.padding)
