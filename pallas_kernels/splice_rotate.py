"""splice_rotate: move cached slots and rotate their RoPE band, in one pass.

Arrays in, arrays out; knows nothing of models. A cache is two slot-major arrays per pool:
a band that moves unchanged (`c`, e.g. MLA's latent) and a band that moves and rotates (`k`,
e.g. MLA's `k_pe`), both `[L, S, D]` (layers, slots, width). For each of M moves m:

    c[:, dst[m]] = c[:, src[m]]                                   (bit-exact)
    k[:, dst[m]] = R(theta(pos_to[m]) - theta(pos_from[m])) k[:, src[m]]  (fp32 math, cast back)

with theta(p) = p * inv_freq (fp32, as a model's RoPE computes it) and the rotation acting on the
halves layout: pair i is (k[i], k[i + D/2]). The rotation's cos/sin come from the angle-difference
identities on each absolute phase's own cos/sin, so a moved key equals what embedding at
`pos_to` would have produced, to fp32 rounding, at any position. A rotation is unit magnitude:
scale factors baked into `k` (YaRN's attention factor) are kept, never applied again.

Rows with `dst == S` are padding and write nothing. Destination slots must be distinct and must
not be source slots of any move (fresh pages: no read-after-write hazard); slots no move names
are left bit-identical.

Three implementations with one signature:
- `splice_rotate_ref`: plain jnp (gather, rotate, scatter). Used on CPU and GPU.
- `splice_rotate_kernel`: a Pallas TPU kernel. Grid (layer, block of `block` moves); per move one
  DMA copies the `c` row HBM -> HBM and one brings the `k` row to VMEM; the block's `k` rows are
  rotated in fp32 and written back by DMA. The pool arrays are aliased in place (only
  destination rows are touched), which is safe because destinations are never sources.
- `splice_rotate`: the dispatch (compiled kernel on TPU, jnp elsewhere, interpret mode on request).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.dispatch import resolve

DEFAULT_BLOCK = 8  # moves per kernel grid step
REF_BLOCK = 1024  # moves per loop step of the jnp path


# ---- validators -----------------------------------------------------------------------------
def validate_static(c, k, src, dst, pos_from, pos_to, inv_freq) -> None:
    """Shapes and dtypes (cheap; runs at trace time)."""
    if c.ndim != 3 or k.ndim != 3 or c.shape[:2] != k.shape[:2]:
        raise ValueError(f"c and k must be [L, S, D] with equal L, S: {c.shape}, {k.shape}")
    if k.shape[2] % 2:
        raise ValueError(f"rotated band width {k.shape[2]} must be even")
    m = src.shape
    for name, a in (("src", src), ("dst", dst), ("pos_from", pos_from), ("pos_to", pos_to)):
        if a.shape != m or a.ndim != 1:
            raise ValueError(f"{name} must be [M] like src, got {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {a.dtype}")
    if inv_freq.shape != (k.shape[2] // 2,):
        raise ValueError(f"inv_freq must be [{k.shape[2] // 2}], got {inv_freq.shape}")


def validate_dynamic(c, src, dst) -> None:
    """Index ranges and the no-hazard rule (needs concrete values: call outside jit)."""
    src, dst = np.asarray(src), np.asarray(dst)
    s = c.shape[1]
    real = dst != s
    if ((src < 0) | (src >= s))[real].any():
        raise ValueError("a source slot is out of range")
    if ((dst < 0) | (dst > s)).any():
        raise ValueError("a destination slot is out of range")
    d = dst[real]
    if len(np.unique(d)) != len(d):
        raise ValueError("destination slots must be distinct")
    if np.intersect1d(d, src[real]).size:
        raise ValueError("a destination slot is also a source slot (read-after-write hazard)")


# ---- reference ------------------------------------------------------------------------------
def phase_table(inv_freq, length: int):
    """f32[length, D] = [cos | sin] of the fp32 phases p * inv_freq for p < length: what a
    model's RoPE computes at each position, looked up instead of recomputed per moved row
    (XLA:CPU spends ~4 ns per sin/cos; a splice of n rows needs 4 n D/2 of them)."""
    th = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq.astype(jnp.float32)
    return jnp.concatenate([jnp.cos(th), jnp.sin(th)], axis=-1)


def _rotation(pos_from, pos_to, inv_freq, table=None):
    """cos, sin f32[M, D/2] of the rotation taking phase pos_from*inv to pos_to*inv."""
    if table is None:
        inv = inv_freq.astype(jnp.float32)
        a = pos_from.astype(jnp.float32)[:, None] * inv
        b = pos_to.astype(jnp.float32)[:, None] * inv
        ca, sa, cb, sb = jnp.cos(a), jnp.sin(a), jnp.cos(b), jnp.sin(b)
    else:
        h = table.shape[1] // 2
        a = table.at[pos_from].get(mode="clip")
        b = table.at[pos_to].get(mode="clip")
        ca, sa, cb, sb = a[:, :h], a[:, h:], b[:, :h], b[:, h:]
    return cb * ca + sb * sa, sb * ca - cb * sa


def as_bits(x):
    """Same-width unsigned view (bit-exact)."""
    return jax.lax.bitcast_convert_type(
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
    )


def _rotate_rows(x, cos, sin, k_dtype, store_dtype):
    """Stored rows [..., M, Dk] -> rotated stored rows (math in fp32, cast to k_dtype)."""
    x = jax.lax.bitcast_convert_type(x, k_dtype) if x.dtype != k_dtype else x
    x = x.astype(jnp.float32)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(k_dtype)
    return jax.lax.bitcast_convert_type(y, store_dtype) if store_dtype != k_dtype else y


def splice_rotate_ref(
    c, k, src, dst, pos_from, pos_to, inv_freq, *, k_dtype=None, table=None, block=REF_BLOCK
):
    """Plain jnp: c [L, S, Dc], k [L, S, Dk], src/dst/pos_from/pos_to i32[M], inv_freq
    f32[Dk/2] -> (c, k) with the destination rows written.

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
    return jax.lax.bitcast_convert_type(c, c_type), jax.lax.bitcast_convert_type(k, k_type)


def _bits16(x):
    """A 16-bit float array as uint16 bits, anything else as is. XLA:CPU scatters a float-16
    array by converting all of it to f32 and back; callers that care (the paged state) store
    16-bit bands as bits already, so this view only costs callers passing floats."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
        return as_bits(x)
    return x


# ---- Pallas TPU kernel ----------------------------------------------------------------------
def _kernel(
    src_ref,
    dst_ref,
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
    slots: int,
    k_dtype,
):
    del c_in, k_in  # aliased with c_out, k_out: read and write through the outputs
    layer, b = pl.program_id(0), pl.program_id(1)
    base = b * block

    def real(j):  # padding moves have dst == slots and copy nothing
        return dst_ref[base + j] < slots

    def c_copy(j):  # HBM -> HBM, bit-exact
        return pltpu.make_async_copy(
            c_out.at[layer, pl.ds(src_ref[base + j], 1)],
            c_out.at[layer, pl.ds(dst_ref[base + j], 1)],
            sem.at[0],
        )

    def k_read(j):  # HBM -> VMEM row j
        return pltpu.make_async_copy(
            k_out.at[layer, pl.ds(src_ref[base + j], 1)], k_buf.at[pl.ds(j, 1)], sem.at[1]
        )

    def k_write(j):  # VMEM row j -> HBM
        return pltpu.make_async_copy(
            k_buf.at[pl.ds(j, 1)], k_out.at[layer, pl.ds(dst_ref[base + j], 1)], sem.at[2]
        )

    def each(*actions):  # run `action(j).start()` / `.wait()` for every real move j
        for j in range(block):

            @pl.when(real(j))
            def _(j=j):
                for action in actions:
                    action(j)

    each(lambda j: c_copy(j).start(), lambda j: k_read(j).start())
    each(lambda j: c_copy(j).wait(), lambda j: k_read(j).wait())

    # rotate the block's k rows in fp32 (padding rows hold garbage and are not written back)
    inv = inv_ref[...].astype(jnp.float32)  # [1, D/2]
    a = pf_ref[...].astype(jnp.float32) * inv  # [block, D/2]
    bb = pt_ref[...].astype(jnp.float32) * inv
    ca, sa, cb, sb = jnp.cos(a), jnp.sin(a), jnp.cos(bb), jnp.sin(bb)
    cos, sin = cb * ca + sb * sa, sb * ca - cb * sa
    k_buf[...] = _rotate_rows(k_buf[...], cos, sin, k_dtype, k_buf.dtype)

    each(lambda j: k_write(j).start())
    each(lambda j: k_write(j).wait())


@functools.partial(
    jax.jit, static_argnames=("k_dtype", "block", "interpret"), donate_argnums=(0, 1)
)
def splice_rotate_kernel(
    c,
    k,
    src,
    dst,
    pos_from,
    pos_to,
    inv_freq,
    *,
    k_dtype=None,
    block=DEFAULT_BLOCK,
    interpret=False,
):
    """The Pallas TPU kernel; same contract as `splice_rotate_ref` (cos/sin are computed in
    the kernel: cheap on the vector unit, so no phase table). `c` and `k` are donated and
    updated in place. `interpret`: False (compiled), True, or a `pltpu.InterpretParams`."""
    validate_static(c, k, src, dst, pos_from, pos_to, inv_freq)
    k_dtype = jnp.dtype(k.dtype if k_dtype is None else k_dtype)
    layers, slots, _ = c.shape
    m = src.shape[0]
    mp = -(-m // block) * block
    pad = mp - m
    src = jnp.pad(src.astype(jnp.int32), (0, pad))
    dst = jnp.pad(dst.astype(jnp.int32), (0, pad), constant_values=slots)
    pos_from = jnp.pad(pos_from.astype(jnp.int32), (0, pad))[:, None]
    pos_to = jnp.pad(pos_to.astype(jnp.int32), (0, pad))[:, None]
    inv = inv_freq.astype(jnp.float32)[None, :]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(layers, mp // block),
        in_specs=[
            pl.BlockSpec((block, 1), lambda layer, b, *_: (b, 0)),  # pos_from
            pl.BlockSpec((block, 1), lambda layer, b, *_: (b, 0)),  # pos_to
            pl.BlockSpec((1, inv.shape[1]), lambda layer, b, *_: (0, 0)),  # inv_freq
            any_spec,  # c, left in HBM
            any_spec,  # k, left in HBM
        ],
        out_specs=[any_spec, any_spec],
        scratch_shapes=[pltpu.VMEM((block, k.shape[2]), k.dtype), pltpu.SemaphoreType.DMA((3,))],
    )
    return pl.pallas_call(
        functools.partial(_kernel, block=block, slots=slots, k_dtype=k_dtype),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)],
        # operand indices count the two scalar-prefetch operands first
        input_output_aliases={5: 0, 6: 1},
        interpret=interpret,
    )(src, dst, pos_from, pos_to, inv, c, k)


# ---- dispatch -------------------------------------------------------------------------------
def splice_rotate(
    c, k, src, dst, pos_from, pos_to, inv_freq, *, k_dtype=None, table=None, impl=None
):
    """Move + rotate with the implementation for this backend.

    impl: None (compiled kernel on TPU, jnp elsewhere), "jnp", "pallas" (compiled kernel),
    "interpret" (kernel under Pallas' generic interpreter), "tpu_interpret" (kernel under the
    TPU-semantics interpreter, which executes the in-place aliasing as hardware would).
    `k_dtype`: see `splice_rotate_ref`; `table`: a `phase_table`, used by the jnp path.
    """
    impl, interpret = resolve(impl)
    if not isinstance(src, jax.core.Tracer) and not isinstance(dst, jax.core.Tracer):
        validate_dynamic(c, src, dst)  # concrete indices: check here (under jit the caller does)
    if impl == "jnp":
        validate_static(c, k, src, dst, pos_from, pos_to, inv_freq)
        return splice_rotate_ref(
            c, k, src, dst, pos_from, pos_to, inv_freq, k_dtype=k_dtype, table=table
        )
    return splice_rotate_kernel(
        c, k, src, dst, pos_from, pos_to, inv_freq, k_dtype=k_dtype, interpret=interpret
    )
