"""splice_rotate: move cached slots and rotate their RoPE band, in one pass.

Arrays in, arrays out; knows nothing of models. A cache layer is two slot-major arrays: a band
that moves unchanged (`c`, e.g. MLA's latent) and a band that moves and rotates (`k`, e.g. MLA's
`k_pe`), `[S, D]` each (slots, width). For each moved row m:

    c[dst[m]] = c[src[m]]                                                 (bit-exact)
    k[dst[m]] = R(theta(pos_to[m]) - theta(pos_from[m])) k[src[m]]  (fp32 math, cast back)

with theta(p) = p * inv_freq (fp32, as a model's RoPE computes it). A `k` row holds
Dk / (2 len(inv_freq)) vectors of width D = 2 len(inv_freq) (one for MLA's `k_pe`, one per KV
head for GQA's K), each in the halves layout: pair i of a vector is (x[i], x[i + D/2]). The
rotation's cos/sin come from the angle-difference identities on each absolute phase's own
cos/sin, so a moved key equals what embedding at `pos_to` would have produced, to fp32 rounding,
at any position. A rotation is unit magnitude: scale factors baked into `k` (YaRN's attention
factor) are kept, never applied again.

Runs. A splice keeps downstream tokens in order, so its moved rows come in runs: consecutive
slots at both ends and consecutive positions, until a page or an edit ends. The kernels take
runs, `(src, dst, length, pos_from, pos_to)` i32[R] each: rows src + t go to dst + t at
positions pos_from + t -> pos_to + t for t < length <= `max_run` (`plan_runs` finds them on the
host). A run of length 0 is padding and writes nothing. Destination rows must be distinct and
must not be source rows of any run (fresh pages: no read-after-write hazard); rows no run names
are left bit-identical. Every implementation takes the pools of all layers at once (sequences
of per-layer arrays, each its own buffer, updated in place), so work that depends only on the
runs (indices, rotations) is done once for every layer.

Implementations (one contract):
- `splice_rotate_ref`: the reference, row by row on stacked `[L, S, D]` arrays (gather, rotate,
  scatter); `runs_to_rows` expands runs into its rows.
- `splice_rotate_jnp`: the path on CPU. The runs' rows, compacted, are gathered, rotated and
  scattered in blocks of `ROW_BLOCK`, every layer in one loop step that looks its rotation up
  once. Moving runs as dynamic slices was measured and lost on XLA:CPU: every slice is a kernel
  launch there, so a page-sized piece costs more than gathering its rows (see the function).
- `splice_rotate_tpu`: a Pallas TPU kernel, one call per layer. Grid: blocks of `block` runs;
  a DMA has a static size, so each run moves as its power-of-two pieces (13 rows: 8 + 4 + 1),
  one DMA each copying `c` rows HBM -> HBM and one bringing `k` rows to VMEM; the block's `k`
  rows are rotated in fp32 and written back by DMA, piece by piece.
- `splice_rotate_gpu`: a Pallas GPU kernel (the Triton lowering), one call for all layers. One
  program per run: for each layer it loads the run's `c` and `k` rows in a window of
  `next_pow2(max_run)` rows masked to the run's length, rotates `k` in fp32 and stores both at
  the destination.
- `splice_rotate`: the dispatch (`pallas_kernels.dispatch`: by default the TPU kernel on TPU
  and jnp on every other platform, chosen when the program is lowered; the GPU kernel and the
  interpret modes on request: the GPU kernel, written for the Triton lowering, does not lower
  through Mosaic GPU, jax's default, at real shapes).
The kernels update the pools in place (input_output_aliases): only destination rows are
written, which is safe because destinations are never sources.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import on_platform, resolve

TARGETS = ("tpu", "gpu")  # the backends with a compiled kernel (see `dispatch`)
DEFAULT_MAX_RUN = 16  # rows per run: a page of the paged state's default page size
ROW_BLOCK = 256  # rows per gather/scatter step of the jnp path (of 64..1024, 256 and 512 best)
DEFAULT_BLOCK = 8  # runs per TPU kernel grid step
REF_BLOCK = 1024  # rows per loop step of the reference


class Runs(NamedTuple):
    """A splice as runs (i32[R] each; see the module docstring)."""

    src: np.ndarray | jax.Array  # first source row
    dst: np.ndarray | jax.Array  # first destination row
    length: np.ndarray | jax.Array  # rows in the run (0: padding)
    pos_from: np.ndarray | jax.Array  # position of the first row before the move
    pos_to: np.ndarray | jax.Array  # and after it


def plan_runs(src, dst, pos_from, pos_to, *, max_run: int = DEFAULT_MAX_RUN) -> Runs:
    """Rows (i32[M] each, numpy, host) -> `Runs`: maximal stretches where source, destination
    and both positions all advance by one, cut every `max_run` rows."""
    rows = [np.asarray(a, np.int64) for a in (src, dst, pos_from, pos_to)]
    m = len(rows[0])
    cut = np.ones(m, bool)
    if m > 1:
        cut[1:] = np.any([np.diff(a) != 1 for a in rows], axis=0)
    stretch = np.cumsum(cut) - 1  # which stretch each row is in
    offset = np.arange(m) - np.flatnonzero(cut)[stretch]  # row's offset in its stretch
    starts = np.flatnonzero(cut | (offset % max_run == 0))
    length = np.diff(np.append(starts, m)).astype(np.int32)
    src, dst, pos_from, pos_to = (a[starts].astype(np.int32) for a in rows)
    return Runs(src, dst, length, pos_from, pos_to)


def runs_to_rows(runs: Runs, *, max_run: int, slots: int):
    """`Runs` -> the rows (src, dst, pos_from, pos_to), i32[R * max_run] each, of the row
    contract: row t of run r, padding (dst == slots) past the run's length."""
    t = jnp.arange(max_run, dtype=jnp.int32)
    live = t < jnp.asarray(runs.length)[:, None]

    def rows(a):
        return (jnp.asarray(a, jnp.int32)[:, None] + t).reshape(-1)

    dst = jnp.where(live, jnp.asarray(runs.dst, jnp.int32)[:, None] + t, slots).reshape(-1)
    return rows(runs.src), dst, rows(runs.pos_from), rows(runs.pos_to)


# ---- validators -----------------------------------------------------------------------------
def _check_rotated_width(width: int, inv_freq) -> None:
    if width % 2:
        raise ValueError(f"rotated band width {width} must be even")
    if inv_freq.ndim != 1 or width % (2 * inv_freq.shape[0]):
        raise ValueError(
            f"inv_freq must be [D/2] for vectors of width D dividing {width}, got {inv_freq.shape}"
        )


def _check_indices(**arrays) -> None:
    m = next(iter(arrays.values())).shape
    for name, a in arrays.items():
        if a.shape != m or a.ndim != 1:
            raise ValueError(f"{name} must be [M] like src, got {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {a.dtype}")


def validate_static(c, k, src, dst, pos_from, pos_to, inv_freq) -> None:
    """The row contract (`splice_rotate_ref`): shapes and dtypes (cheap; runs at trace time)."""
    if c.ndim != 3 or k.ndim != 3 or c.shape[:2] != k.shape[:2]:
        raise ValueError(f"c and k must be [L, S, D] with equal L, S: {c.shape}, {k.shape}")
    _check_rotated_width(k.shape[2], inv_freq)
    _check_indices(src=src, dst=dst, pos_from=pos_from, pos_to=pos_to)


def validate_dynamic(c, src, dst) -> None:
    """The row contract: index ranges and the no-hazard rule (needs concrete values: call
    outside jit)."""
    src, dst = np.asarray(src), np.asarray(dst)
    s = c.shape[1]
    real = dst != s
    if ((src < 0) | (src >= s))[real].any():
        raise ValueError("a source slot is out of range")
    if ((dst < 0) | (dst > s)).any():
        raise ValueError("a destination slot is out of range")
    _check_hazard(src[real], dst[real])


def _check_hazard(src: np.ndarray, dst: np.ndarray) -> None:
    if len(np.unique(dst)) != len(dst):
        raise ValueError("destination slots must be distinct")
    if np.intersect1d(dst, src).size:
        raise ValueError("a destination slot is also a source slot (read-after-write hazard)")


def validate_runs_static(cs, ks, runs: Runs, inv_freq, max_run: int) -> None:
    """The run contract: per-layer pools `cs` [S, Dc] / `ks` [S, Dk] (equal S, one shape and
    dtype per band across layers), `runs` i32[R] each, `max_run` >= 1 (trace time)."""
    if not cs or len(cs) != len(ks):
        raise ValueError(f"need one c and one k pool per layer, got {len(cs)} and {len(ks)}")
    for band in (cs, ks):
        if any(a.ndim != 2 or a.shape != band[0].shape or a.dtype != band[0].dtype for a in band):
            raise ValueError(f"a band's pools must be [S, D] of one shape and dtype: {band}")
    if cs[0].shape[0] != ks[0].shape[0]:
        raise ValueError(f"c and k pools must have equal S: {cs[0].shape}, {ks[0].shape}")
    _check_rotated_width(ks[0].shape[1], inv_freq)
    _check_indices(**{f"runs.{f}": a for f, a in runs._asdict().items()})
    if max_run < 1:
        raise ValueError(f"max_run {max_run} must be positive")


def validate_runs_dynamic(slots: int, runs: Runs, max_run: int) -> None:
    """The run contract: lengths in [0, max_run], real runs inside the pool, and the no-hazard
    rule over their rows (needs concrete values: call outside jit)."""
    src, dst, length = (np.asarray(a, np.int64) for a in runs[:3])
    if ((length < 0) | (length > max_run)).any():
        raise ValueError(f"a run's length is outside [0, {max_run}]")
    real = length > 0
    if ((src < 0) | (src + length > slots))[real].any():
        raise ValueError("a source slot is out of range")
    if ((dst < 0) | (dst + length > slots))[real].any():
        raise ValueError("a destination slot is out of range")
    rows = np.arange(length.sum()) - np.repeat(np.cumsum(length) - length, length)
    _check_hazard(np.repeat(src, length) + rows, np.repeat(dst, length) + rows)


# ---- rotation -------------------------------------------------------------------------------
def phase_table(inv_freq, length: int):
    """f32[length, D] = [cos | sin] of the fp32 phases p * inv_freq for p < length: what a
    model's RoPE computes at each position, looked up instead of recomputed per moved row
    (XLA:CPU spends ~4 ns per sin/cos; a splice of n rows needs 4 n D/2 of them)."""
    return _phase_rows(jnp.arange(length, dtype=jnp.int32), inv_freq)


def _phase_rows(pos, inv_freq):
    """f32[M, D] = [cos | sin] of the fp32 phases pos * inv_freq."""
    th = pos.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)
    return jnp.concatenate([jnp.cos(th), jnp.sin(th)], axis=-1)


def _difference(a, b):
    """cos, sin [M, D/2] of the rotation from phase a to phase b, from their [cos | sin] rows
    [M, D] by the angle-difference identities."""
    h = a.shape[-1] // 2
    ca, sa, cb, sb = a[:, :h], a[:, h:], b[:, :h], b[:, h:]
    return cb * ca + sb * sa, sb * ca - cb * sa


def _rotation(pos_from, pos_to, inv_freq, table=None):
    """cos, sin f32[M, D/2] of the rotation taking phase pos_from*inv to pos_to*inv."""
    if table is None:
        return _difference(_phase_rows(pos_from, inv_freq), _phase_rows(pos_to, inv_freq))
    return _difference(table.at[pos_from].get(mode="clip"), table.at[pos_to].get(mode="clip"))


def as_bits(x):
    """Same-width unsigned view (bit-exact)."""
    return jax.lax.bitcast_convert_type(
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
    )


def _values(x, k_dtype):
    """Stored rows -> fp32 values (stored rows may be the raw bits of `k_dtype`)."""
    return (jax.lax.bitcast_convert_type(x, k_dtype) if x.dtype != k_dtype else x).astype(
        jnp.float32
    )


def _stored(y, k_dtype, store_dtype):
    """fp32 values -> stored rows (cast to `k_dtype`, then to its bits if stored as bits)."""
    y = y.astype(k_dtype)
    return jax.lax.bitcast_convert_type(y, store_dtype) if store_dtype != k_dtype else y


def _rotate_rows(x, cos, sin, k_dtype, store_dtype):
    """Stored rows [..., M, Dk] -> rotated stored rows (math in fp32, cast to k_dtype); each
    row's Dk / D vectors (cos, sin [..., M, D/2]) are rotated alike."""
    x = _values(x, k_dtype)
    h = cos.shape[-1]
    heads = x.shape[-1] // (2 * h)
    if heads > 1:
        x = x.reshape(*x.shape[:-1], heads, 2 * h)
        cos, sin = cos[..., None, :], sin[..., None, :]
    x1, x2 = x[..., :h], x[..., h:]
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return _stored(y.reshape(*y.shape[:-2], -1) if heads > 1 else y, k_dtype, store_dtype)


def _bits16(x):
    """A 16-bit float array as uint16 bits, anything else as is. XLA:CPU scatters a float-16
    array by converting all of it to f32 and back; callers that care (the paged state) store
    16-bit bands as bits already, so this view only costs callers passing floats."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
        return as_bits(x)
    return x


def _as(x, dtype):
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _piece_bits(max_run: int, slots: int) -> range:
    """Piece sizes 2^b a run can need, largest first (none longer than the pool)."""
    return reversed(range(min(max_run, slots).bit_length()))


# ---- reference ------------------------------------------------------------------------------
def splice_rotate_ref(
    c, k, src, dst, pos_from, pos_to, inv_freq, *, k_dtype=None, table=None, block=REF_BLOCK
):
    """Plain jnp, row by row: c [L, S, Dc], k [L, S, Dk], src/dst/pos_from/pos_to i32[M]
    (rows with dst == S are padding), inv_freq f32[D/2] -> (c, k) with the destination rows
    written.

    `k_dtype`: the float type `k`'s elements mean when `k` holds raw bits (default: k.dtype).
    `table`: `phase_table(inv_freq, n)` covering every position, to look cos/sin up instead
    of computing them (same fp32 phases, so the same values on one backend). Moves run in a
    loop over blocks of `block` rows, each an in-place gather + scatter on the pools, so no
    pool-sized temporary is made whatever M is."""
    k_dtype = jnp.dtype(k.dtype if k_dtype is None else k_dtype)
    c_type, k_type = c.dtype, k.dtype
    c, k = _bits16(c), _bits16(k)  # float-16 pools move as bits (see `_bits16`)
    m = src.shape[0]
    block = min(block, max(m, 1))
    mp = -(-m // block) * block
    slots = c.shape[1]
    src = jnp.pad(src.astype(jnp.int32), (0, mp - m))
    dst = jnp.pad(dst.astype(jnp.int32), (0, mp - m), constant_values=slots)
    pos_from = jnp.pad(pos_from.astype(jnp.int32), (0, mp - m))
    pos_to = jnp.pad(pos_to.astype(jnp.int32), (0, mp - m))

    def body(b, pools):
        c, k = pools
        s, d, pf, pt = (
            jax.lax.dynamic_slice_in_dim(a, b * block, block) for a in (src, dst, pos_from, pos_to)
        )
        cos, sin = _rotation(pf, pt, inv_freq, table)
        y = _rotate_rows(k.at[:, s].get(mode="clip"), cos, sin, k_dtype, k.dtype)
        c = c.at[:, d].set(c.at[:, s].get(mode="clip"), mode="drop")
        k = k.at[:, d].set(y, mode="drop")
        return c, k

    c, k = jax.lax.fori_loop(0, mp // block, body, (c, k))
    return _as(c, c_type), _as(k, k_type)


# ---- runs as rows in blocks (the CPU path) --------------------------------------------------
@functools.partial(jax.jit, static_argnames=("k_dtype", "max_run", "block"), donate_argnums=(0, 1))
def splice_rotate_jnp(
    cs: Sequence[jax.Array],
    ks: Sequence[jax.Array],
    runs: Runs,
    inv_freq,
    *,
    k_dtype=None,
    table=None,
    max_run: int = DEFAULT_MAX_RUN,
    block: int = ROW_BLOCK,
):
    """The CPU path: cs [S, Dc] and ks [S, Dk] per layer, `runs` i32[R] each, inv_freq
    f32[D/2] -> (cs, ks) tuples with the destination rows written; the pools are donated and
    updated in place. `k_dtype`: see `splice_rotate_ref`; `table`: a `phase_table` covering
    every position (else cos/sin are computed).

    The runs' rows are compacted to the front (R x max_run candidates, the real ones first),
    then gathered, rotated and scattered `block` rows at a time, every layer in one loop step
    that looks its rotation up once (a dynamic number of steps: padding costs nothing).
    Measured at 8k downstream tokens, 27 layers (benchmarks/splice_bench.py --splice-only),
    against a memcpy of the same bytes: 2.5x when runs are whole pages, 3.0x when pages are
    shuffled and split into runs of 13 and 3 rows. Moving the runs as dynamic slices instead
    (power-of-two pieces: every slice is a kernel launch on XLA:CPU) ran at 2.8x and 6.0x, the
    row reference one layer at a time at 4.5x and 4.9x; a C loop of one memcpy per run reaches
    1.8x and 2.1x there (cold destination lines, copies too short for streaming stores)."""
    validate_runs_static(cs, ks, runs, inv_freq, max_run)
    k_dtype = jnp.dtype(ks[0].dtype if k_dtype is None else k_dtype)
    c_type, k_type = cs[0].dtype, ks[0].dtype
    cs, ks = tuple(map(_bits16, cs)), tuple(map(_bits16, ks))
    slots = cs[0].shape[0]
    src, dst, length, pos_from, pos_to = (jnp.asarray(a, jnp.int32) for a in runs)
    t = jnp.arange(max_run, dtype=jnp.int32)
    live = (t < length[:, None]).reshape(-1)
    (which,) = jnp.nonzero(live, size=live.shape[0], fill_value=0)
    n_rows = jnp.sum(live)
    block = min(block, live.shape[0])
    pad = -live.shape[0] % block

    def rows(a, fill=0):  # [R] run starts -> [R x max_run] rows, the real ones first
        r = (a[:, None] + t).reshape(-1)[which]
        r = jnp.where(jnp.arange(live.shape[0]) < n_rows, r, fill)
        return jnp.pad(r, (0, pad), constant_values=fill)

    rows = rows(src), rows(dst, slots), rows(pos_from), rows(pos_to)  # padding: dst S, dropped

    def body(b, pools):
        s, d, pf, pt = (jax.lax.dynamic_slice_in_dim(a, b * block, block) for a in rows)
        cos, sin = _rotation(pf, pt, inv_freq, table)

        def move(x, rotate):
            y = x.at[s].get(mode="clip")
            y = _rotate_rows(y, cos, sin, k_dtype, x.dtype) if rotate else y
            return x.at[d].set(y, mode="drop")

        cs, ks = pools
        return tuple(move(x, False) for x in cs), tuple(move(x, True) for x in ks)

    cs, ks = jax.lax.fori_loop(0, -(-n_rows // block), body, (cs, ks))
    return tuple(_as(x, c_type) for x in cs), tuple(_as(x, k_type) for x in ks)


# ---- Pallas TPU kernel ----------------------------------------------------------------------
def _tpu_kernel(
    src_ref,
    dst_ref,
    len_ref,
    pf_ref,
    pt_ref,
    inv_ref,
    c_in,
    k_in,
    c_out,
    k_out,
    k_buf,
    sem,
    *,
    block: int,
    window: int,
    max_run: int,
    k_dtype,
):
    del c_in, k_in  # aliased with c_out, k_out: read and write through the outputs
    base = pl.program_id(0) * block

    def each(*actions):  # run `action(j, size, off)` for every piece of every run in the block
        for j in range(block):
            n = len_ref[base + j]
            for bit in _piece_bits(max_run, c_out.shape[0]):
                size = 1 << bit

                @pl.when((n >> bit) & 1 == 1)
                def _(j=j, size=size, off=n & -(2 * size)):
                    for action in actions:
                        action(j, size, off)

    def rows(ref, first, size, off):
        return ref.at[pl.ds(first + off, size)]

    def c_copy(j, size, off):  # HBM -> HBM, bit-exact
        s, d = src_ref[base + j], dst_ref[base + j]
        return pltpu.make_async_copy(
            rows(c_out, s, size, off), rows(c_out, d, size, off), sem.at[0]
        )

    def k_read(j, size, off):  # HBM -> VMEM rows of run j's window
        s = src_ref[base + j]
        return pltpu.make_async_copy(
            rows(k_out, s, size, off), rows(k_buf, j * window, size, off), sem.at[1]
        )

    def k_write(j, size, off):  # VMEM -> HBM
        d = dst_ref[base + j]
        return pltpu.make_async_copy(
            rows(k_buf, j * window, size, off), rows(k_out, d, size, off), sem.at[2]
        )

    each(lambda *p: c_copy(*p).start(), lambda *p: k_read(*p).start())
    each(lambda *p: c_copy(*p).wait(), lambda *p: k_read(*p).wait())

    # rotate the block's k windows in fp32 (rows past a run's length hold garbage, never
    # written back)
    inv = inv_ref[...].astype(jnp.float32)  # [1, D/2]
    a = pf_ref[...].astype(jnp.float32) * inv  # [block * window, D/2]
    b = pt_ref[...].astype(jnp.float32) * inv
    ca, sa, cb, sb = jnp.cos(a), jnp.sin(a), jnp.cos(b), jnp.sin(b)
    cos, sin = cb * ca + sb * sa, sb * ca - cb * sa
    k_buf[...] = _rotate_rows(k_buf[...], cos, sin, k_dtype, k_buf.dtype)

    each(lambda *p: k_write(*p).start())
    each(lambda *p: k_write(*p).wait())


@functools.partial(
    jax.jit,
    static_argnames=("k_dtype", "max_run", "block", "interpret"),
    donate_argnums=(0, 1),
)
def _tpu_layer(c, k, runs, inv_freq, *, k_dtype, max_run, block, interpret):
    """One layer's pools through the TPU kernel (donated, updated in place)."""
    window = 1 << (max_run - 1).bit_length()
    m = runs.src.shape[0]
    pad = -(-m // block) * block - m
    src, dst, length, pos_from, pos_to = (
        jnp.pad(jnp.asarray(a, jnp.int32), (0, pad)) for a in runs
    )
    t = jnp.arange(window, dtype=jnp.int32)
    pf_rows, pt_rows = ((p[:, None] + t).reshape(-1, 1) for p in (pos_from, pos_to))
    inv = inv_freq.astype(jnp.float32)[None, :]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    rows_spec = pl.BlockSpec((block * window, 1), lambda b, *_: (b, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=((m + pad) // block,),
        in_specs=[
            rows_spec,  # pos_from of every window row
            rows_spec,  # pos_to
            pl.BlockSpec((1, inv.shape[1]), lambda b, *_: (0, 0)),  # inv_freq
            any_spec,  # c, left in HBM
            any_spec,  # k, left in HBM
        ],
        out_specs=[any_spec, any_spec],
        scratch_shapes=[
            pltpu.VMEM((block * window, k.shape[1]), k.dtype),
            pltpu.SemaphoreType.DMA((3,)),
        ],
    )
    kernel = functools.partial(
        _tpu_kernel, block=block, window=window, max_run=max_run, k_dtype=k_dtype
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)],
        # operand indices count the three scalar-prefetch operands first
        input_output_aliases={6: 0, 7: 1},
        interpret=interpret,
    )(src, dst, length, pf_rows, pt_rows, inv, c, k)


def splice_rotate_tpu(
    cs,
    ks,
    runs: Runs,
    inv_freq,
    *,
    k_dtype=None,
    max_run: int = DEFAULT_MAX_RUN,
    block: int = DEFAULT_BLOCK,
    interpret=False,
):
    """The Pallas TPU kernel, one call per layer; same contract as `splice_rotate_jnp` (cos/sin
    are computed in the kernel: cheap on the vector unit, so no phase table). The pools are
    donated and updated in place. `interpret`: False (compiled), True, or a
    `pltpu.InterpretParams`."""
    validate_runs_static(cs, ks, runs, inv_freq, max_run)
    k_dtype = jnp.dtype(ks[0].dtype if k_dtype is None else k_dtype)
    kw = dict(k_dtype=k_dtype, max_run=max_run, block=block, interpret=interpret)
    out = [_tpu_layer(c, k, Runs(*runs), inv_freq, **kw) for c, k in zip(cs, ks, strict=True)]
    return tuple(c for c, _ in out), tuple(k for _, k in out)


# ---- Pallas GPU kernel (Triton lowering) ----------------------------------------------------
def _pow2_spans(width: int) -> list[tuple[int, int]]:
    """[0, width) as (start, size) spans of power-of-two sizes, largest first: Triton blocks
    must have power-of-two sizes (192 columns: (0, 128), (128, 64))."""
    spans, start = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            spans.append((start, 1 << bit))
            start += 1 << bit
    return spans


def _gpu_kernel(src_ref, dst_ref, len_ref, pf_ref, pt_ref, inv_ref, *refs, layers, window, k_dtype):
    pools = refs[2 * layers :]  # the outputs (aliased with the inputs): cs then ks
    cs, ks = pools[:layers], pools[layers:]
    r = pl.program_id(0)
    s, d = src_ref[r], dst_ref[r]
    t = jnp.arange(window, dtype=jnp.int32)
    live = t < len_ref[r]  # rows of the run: padding runs (length 0) touch nothing

    def rows(ref, first, start, size):
        return ref.at[pl.ds(first, window), pl.ds(start, size)]

    def mask(size):
        return jnp.broadcast_to(live[:, None], (window, size))

    # the rotation of each row, per power-of-two span of the D/2 frequencies (fp32 phases)
    h = inv_ref.shape[0]
    pa = (pf_ref[r] + t).astype(jnp.float32)[:, None]
    pb = (pt_ref[r] + t).astype(jnp.float32)[:, None]
    rot = []
    for start, size in _pow2_spans(h):
        inv = inv_ref[pl.ds(start, size)][None, :]
        a, b = pa * inv, pb * inv
        ca, sa, cb, sb = jnp.cos(a), jnp.sin(a), jnp.cos(b), jnp.sin(b)
        rot.append((start, size, cb * ca + sb * sa, sb * ca - cb * sa))

    for c in cs:  # bit-exact: the stored values move untouched
        for start, size in _pow2_spans(c.shape[1]):
            x = plgpu.load(rows(c, s, start, size), mask=mask(size), other=0)
            plgpu.store(rows(c, d, start, size), x, mask=mask(size))
    for k in ks:
        for head in range(k.shape[1] // (2 * h)):
            for start, size, cos, sin in rot:
                lo, hi = head * 2 * h + start, head * 2 * h + h + start
                x1 = _values(plgpu.load(rows(k, s, lo, size), mask=mask(size), other=0), k_dtype)
                x2 = _values(plgpu.load(rows(k, s, hi, size), mask=mask(size), other=0), k_dtype)
                y1 = _stored(x1 * cos - x2 * sin, k_dtype, k.dtype)
                y2 = _stored(x2 * cos + x1 * sin, k_dtype, k.dtype)
                plgpu.store(rows(k, d, lo, size), y1, mask=mask(size))
                plgpu.store(rows(k, d, hi, size), y2, mask=mask(size))


@functools.partial(
    jax.jit,
    static_argnames=("k_dtype", "max_run", "interpret"),
    donate_argnums=(0, 1),
)
def _gpu(cs, ks, runs, inv_freq, *, k_dtype, max_run, interpret):
    layers = len(cs)
    pools = (*cs, *ks)
    indices = tuple(jnp.asarray(a, jnp.int32) for a in runs)
    kernel = functools.partial(
        _gpu_kernel, layers=layers, window=1 << (max_run - 1).bit_length(), k_dtype=k_dtype
    )
    out = pl.pallas_call(
        kernel,
        grid=(runs.src.shape[0],),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools],
        input_output_aliases={6 + i: i for i in range(len(pools))},
        interpret=interpret,
        name="splice_rotate",
    )(*indices, inv_freq.astype(jnp.float32), *pools)
    return tuple(out[:layers]), tuple(out[layers:])


def splice_rotate_gpu(
    cs,
    ks,
    runs: Runs,
    inv_freq,
    *,
    k_dtype=None,
    max_run: int = DEFAULT_MAX_RUN,
    interpret=False,
):
    """The Pallas GPU kernel (Triton lowering), one call for every layer; same contract as
    `splice_rotate_jnp` (cos/sin computed in the kernel). The pools are donated and updated in
    place. `interpret`: False (compiled) or True (Pallas' generic interpreter)."""
    validate_runs_static(cs, ks, runs, inv_freq, max_run)
    k_dtype = jnp.dtype(ks[0].dtype if k_dtype is None else k_dtype)
    return _gpu(
        tuple(cs),
        tuple(ks),
        Runs(*runs),
        inv_freq,
        k_dtype=k_dtype,
        max_run=max_run,
        interpret=interpret,
    )


# ---- dispatch -------------------------------------------------------------------------------
def splice_rotate(
    cs,
    ks,
    runs: Runs,
    inv_freq,
    *,
    k_dtype=None,
    table=None,
    max_run: int = DEFAULT_MAX_RUN,
    impl=None,
):
    """Move + rotate every layer's pools (`cs` [S, Dc], `ks` [S, Dk] per layer) along `runs`.
    impl: see `pallas_kernels.dispatch` (None: the TPU kernel on TPU, jnp on every other
    platform, chosen at lowering). `k_dtype`: see `splice_rotate_ref`; `table`: a
    `phase_table`, used by the jnp path. The kernels donate the pools. Concrete runs are
    validated here (`validate_runs_dynamic`); under the caller's jit that is the caller's job.
    """
    validate_runs_static(cs, ks, runs, inv_freq, max_run)
    if not any(isinstance(a, jax.core.Tracer) for a in runs):
        validate_runs_dynamic(cs[0].shape[0], runs, max_run)
    kw = dict(k_dtype=k_dtype, max_run=max_run)
    if impl is None:
        jnp_path = functools.partial(splice_rotate_jnp, table=table, **kw)
        tpu = functools.partial(splice_rotate_tpu, interpret=False, **kw)
        return on_platform(jnp_path, (tuple(cs), tuple(ks), Runs(*runs), inv_freq), tpu=tpu)
    name, target, interpret = resolve(impl, TARGETS)
    if target is None:
        return splice_rotate_jnp(cs, ks, runs, inv_freq, table=table, **kw)
    if target == "gpu":
        return splice_rotate_gpu(cs, ks, runs, inv_freq, interpret=interpret, **kw)
    return splice_rotate_tpu(cs, ks, runs, inv_freq, interpret=interpret, **kw)
