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
- `splice_rotate_gpu` (`pallas_kernels.splice_rotate_gpu`): a Mosaic GPU kernel for Hopper,
  one call for all layers, a program a block of runs: each (run, layer) item's pieces of both
  bands come in by TMA into one of two SMEM buffers while the item before is stored from the
  other, `k` rotated in registers between (see that module). Pre-Hopper GPUs take the jnp
  path.
- `splice_rotate`: the dispatch (`pallas_kernels.dispatch`: by default the TPU kernel on TPU,
  the GPU kernel on CUDA where it takes the pools, jnp elsewhere, chosen when the program is
  lowered; the interpret modes on request).
The contract's shared parts (runs, their planning and validation, the rotation's fp32 math)
live in `pallas_kernels.splice_runs`.
The kernels update the pools in place (the TPU kernel by input_output_aliases, the GPU kernel
through refs): only destination rows are written, which is safe because destinations are never
sources.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.dispatch import hopper, on_platform, resolve
from pallas_kernels.splice_rotate_gpu import splice_rotate_gpu, unsupported
from pallas_kernels.splice_runs import (  # noqa: F401  (the contract's names, re-exported)
    DEFAULT_MAX_RUN,
    Runs,
    as_bits,
    phase_rows,
    phase_table,
    plan_runs,
    rotation,
    runs_to_rows,
    to_stored,
    to_values,
    validate_dynamic,
    validate_runs_dynamic,
    validate_runs_static,
    validate_static,
)

TARGETS = ("tpu", "gpu")  # the backends with a compiled kernel (see `dispatch`)
ROW_BLOCK = 256  # rows per gather/scatter step of the jnp path (of 64..1024, 256 and 512 best)
DEFAULT_BLOCK = 8  # runs per TPU kernel grid step
REF_BLOCK = 1024  # rows per loop step of the reference


def _rotate_rows(x, cos, sin, k_dtype, store_dtype):
    """Stored rows [..., M, Dk] -> rotated stored rows (math in fp32, cast to k_dtype); each
    row's Dk / D vectors (cos, sin [..., M, D/2]) are rotated alike."""
    x = to_values(x, k_dtype)
    h = cos.shape[-1]
    heads = x.shape[-1] // (2 * h)
    if heads > 1:
        x = x.reshape(*x.shape[:-1], heads, 2 * h)
        cos, sin = cos[..., None, :], sin[..., None, :]
    x1, x2 = x[..., :h], x[..., h:]
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return to_stored(y.reshape(*y.shape[:-2], -1) if heads > 1 else y, k_dtype, store_dtype)


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
        cos, sin = rotation(pf, pt, inv_freq, table)
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
        cos, sin = rotation(pf, pt, inv_freq, table)

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
    impl: see `pallas_kernels.dispatch` (None: the TPU kernel on TPU, the Mosaic GPU kernel on
    a Hopper GPU where it takes the pools (`splice_rotate_gpu.unsupported` is None), jnp
    otherwise, chosen at lowering). `k_dtype`: see `splice_rotate_ref`; `table`: a
    `phase_table`, used by the jnp path. The kernels donate the pools. Concrete runs are
    validated here (`validate_runs_dynamic`); under the caller's jit that is the caller's job.
    """
    validate_runs_static(cs, ks, runs, inv_freq, max_run)
    if not any(isinstance(a, jax.core.Tracer) for a in runs):
        validate_runs_dynamic(cs[0].shape[0], runs, max_run)
    kw = dict(k_dtype=k_dtype, max_run=max_run)
    if impl is None:
        jnp_path = functools.partial(splice_rotate_jnp, table=table, **kw)
        kernels = dict(tpu=functools.partial(splice_rotate_tpu, interpret=False, **kw))
        if unsupported(cs, ks, inv_freq, max_run) is None and hopper():
            kernels["cuda"] = functools.partial(splice_rotate_gpu, interpret=False, **kw)
        return on_platform(jnp_path, (tuple(cs), tuple(ks), Runs(*runs), inv_freq), **kernels)
    name, target, interpret = resolve(impl, TARGETS)
    if target is None:
        return splice_rotate_jnp(cs, ks, runs, inv_freq, table=table, **kw)
    if target == "gpu":
        return splice_rotate_gpu(cs, ks, runs, inv_freq, interpret=interpret, **kw)
    return splice_rotate_tpu(cs, ks, runs, inv_freq, interpret=interpret, **kw)
