"""splice_rotate's GPU kernel, in Mosaic GPU (Hopper: H100, H200; same contract as
`pallas_kernels.splice_rotate`, whose module docstring defines runs, pools and the rotation).

One call (`pl.kernel` over a Mosaic GPU mesh, one program per run; the pools passed as refs,
so they are aliased in and out) moves every layer's pools. For each run, and for each layer in
turn:

- its `k` rows come in by TMA (GMEM -> SMEM), one copy per power-of-two piece of its length
  (13 rows: 8 + 4 + 1; a copy has a static size), each piece on its own barrier, into its own
  rows of a page-sized SMEM window (`slot`: SMEM is sliced statically);
- meanwhile its `c` rows move bit-exact piece by piece through registers (GMEM -> GMEM): a
  plain copy needs no shared memory, so more programs fit on an SM;
- the `k` window is rotated in registers in fp32, each half of each vector ([window, D/2]
  slices of the SMEM window) against the run's cos/sin rows (`run_rotations`: f32[window,
  D/2] in the window's row order, computed before the call from each absolute phase by the
  angle-difference identities as the jnp path does, read once per run for every layer),
  written to a second SMEM window, and its pieces go out by TMA (SMEM -> GMEM) at the
  destination. Rows past the run's length are never stored.

Shapes it takes (`unsupported` says why not): a `c` row a multiple of 128 elements (a warpgroup's
lanes); a `k` row a whole number of 128 bytes (Mosaic GPU's copy lowering takes byte counts
divisible by a warpgroup's 128 threads); window x D/2 a multiple of 256 (two values a lane; 16 x 32
for MLA's `k_pe`); two `k` windows within 200 KB of shared memory. The pools are updated in place
(passed as refs). Runs must keep the run contract (`validate_runs_dynamic`, checked here when
they are concrete): the copies are told their rows are inside the pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dispatch import mosaic_gpu_interpret
from pallas_kernels.splice_runs import (
    DEFAULT_MAX_RUN,
    Runs,
    rotation,
    to_stored,
    to_values,
    validate_runs_dynamic,
    validate_runs_static,
)

LANES = 128  # threads of a warpgroup
VEC = 2  # elements a thread holds of a register row: one layout for fp32 and 16-bit values
COPY_BYTES = 128  # Mosaic GPU's copy lowering takes byte counts divisible by a warpgroup's size
SMEM_BYTES = 200 * 1024  # of a Hopper's 227 KB of shared memory an SM: the two k windows' cap
IN_BOUNDS = plgpu.OOBFillMode.PROMISE_IN_BOUNDS  # runs inside the pool (the run contract)


def window_of(max_run: int) -> int:
    """Rows a run's window holds: the next power of two of `max_run`."""
    return 1 << (max_run - 1).bit_length()


def unsupported(cs, ks, inv_freq, max_run: int = DEFAULT_MAX_RUN) -> str | None:
    """None when the kernel takes these pools, else why not (see the module docstring)."""
    h, window = int(np.shape(inv_freq)[0]), window_of(max_run)
    k_width, k_type = ks[0].shape[1], jnp.dtype(ks[0].dtype)
    if cs[0].shape[1] % LANES:
        return f"a c row of {cs[0].shape[1]} is not a multiple of {LANES} elements"
    if k_width * k_type.itemsize % COPY_BYTES:
        return f"a k row ({k_width} x {k_type.name}) is not a multiple of {COPY_BYTES} bytes"
    if window * h % (LANES * VEC):
        return f"window {window} x D/2 {h} is not a multiple of {LANES * VEC}"
    if (smem := 2 * window * k_width * k_type.itemsize) > SMEM_BYTES:
        return f"two k windows of {window} rows take {smem} bytes of shared memory"
    return None


def _kernel(src_ref, dst_ref, len_ref, cos_ref, sin_ref, *pools, k_dtype, interpret):
    """One program per run (mesh axis "run"). The scratch (SMEM windows, barriers) is scoped in
    the kernel (Mosaic GPU's interpreter allocates barriers only there)."""
    layers = len(pools) // 2
    k = pools[layers]
    window = cos_ref.shape[1]
    pieces = window.bit_length()
    pl.run_scoped(
        functools.partial(
            _body,
            (src_ref, dst_ref, len_ref, cos_ref, sin_ref),
            pools[:layers],
            pools[layers:],
            k_dtype=k_dtype,
            interpret=interpret,
        ),
        plgpu.SMEM((window, k.shape[1]), k.dtype),
        plgpu.SMEM((window, k.shape[1]), k.dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=pieces),
    )


def _body(runs, cs, ks, k_win, k_out, k_bar, *, k_dtype, interpret):
    src_ref, dst_ref, len_ref, cos_ref, sin_ref = runs
    window, h = cos_ref.shape[1:]
    sizes = [1 << b for b in reversed(range(window.bit_length()))]  # the pieces, largest first
    r = jax.lax.axis_index("run")

    def each(n, action):
        """action(barrier index, size, the piece's rows in the run, its rows in the window) for
        each piece of a run of n rows."""
        for i, size in enumerate(sizes):
            run_rows = pl.ds(n & -(2 * size), size)  # the larger pieces come first
            pl.when((n & size) != 0)(
                functools.partial(action, i, size, run_rows, slot(size, window))
            )

    s, d, n = src_ref[r], dst_ref[r], len_ref[r]
    cos = strided(cos_ref[r], interpret)  # f32[window, D/2], for every layer
    sin = strided(sin_ref[r], interpret)
    for c, k in zip(cs, ks, strict=True):

        def fetch(i, size, run_rows, rows, k=k):
            at = pl.ds(s + run_rows.start, size)
            plgpu.copy_gmem_to_smem(k.at[at], k_win.at[rows], k_bar.at[i], oob_mode=IN_BOUNDS)

        def copy(i, size, run_rows, rows, c=c):  # GMEM -> registers -> GMEM, bit-exact
            c[pl.ds(d + run_rows.start, size)] = c[pl.ds(s + run_rows.start, size)]

        def wait(i, size, run_rows, rows):
            plgpu.barrier_wait(k_bar.at[i])

        def store(i, size, run_rows, rows, k=k):
            plgpu.copy_smem_to_gmem(k_out.at[rows], k.at[pl.ds(d + run_rows.start, size)])

        each(n, fetch)
        each(n, copy)  # while the k rows come in
        each(n, wait)
        for lo in range(0, k_win.shape[1], 2 * h):  # each vector of the row
            first, second = pl.ds(lo, h), pl.ds(lo + h, h)
            x1 = to_values(strided(k_win[:, first], interpret), k_dtype)
            x2 = to_values(strided(k_win[:, second], interpret), k_dtype)
            k_out[:, first] = to_stored(x1 * cos - x2 * sin, k_dtype, k_out.dtype)
            k_out[:, second] = to_stored(x2 * cos + x1 * sin, k_dtype, k_out.dtype)
        plgpu.commit_smem()
        each(n, store)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the windows are reused

    plgpu.wait_smem_to_gmem(0)


def strided(x, interpret: bool):
    """A [window, D/2] array in registers, VEC elements a thread whatever its dtype (so stored
    values and their fp32 cos/sin share one layout). A layout is the compiler's alone: the
    interpreter, which has no layouts (nor this primitive), takes the values as they are."""
    if interpret:
        return x
    return plgpu.layout_cast(x, plgpu.Layout.WG_STRIDED(tuple(x.shape), vec_size=VEC))


def slot(size: int, window: int) -> pl.Slice:
    """A piece's rows in the window: static (SMEM is sliced statically), disjoint for the
    pieces of one run (16: 0-15 alone; 8, 4, 2, 1: 0-7, 8-11, 12-13, 14)."""
    return pl.ds(0 if size == window else window - 2 * size, size)


def run_rotations(runs: Runs, inv_freq, window: int):
    """cos, sin f32[R, window, D/2]: the rotation of each window row (`slot`) of each run, from
    pos_from + t to pos_to + t for the run's row t it holds (rows no piece fills: harmless
    values, never stored)."""
    n = runs.length[:, None]
    columns = [jnp.zeros_like(n)] * window
    for size in (1 << b for b in range((window - 1).bit_length())):  # the pieces under a window
        first, at = n & -(2 * size), slot(size, window).start
        columns[at : at + size] = [first + i for i in range(size)]
    t = jnp.where(n == window, jnp.arange(window), jnp.concatenate(columns, axis=1))
    pos_from = (runs.pos_from[:, None] + t).reshape(-1)
    pos_to = (runs.pos_to[:, None] + t).reshape(-1)
    cos, sin = rotation(pos_from, pos_to, inv_freq)
    shape = (runs.src.shape[0], window, cos.shape[-1])
    return cos.reshape(shape), sin.reshape(shape)


@functools.partial(
    jax.jit, static_argnames=("k_dtype", "max_run", "interpret"), donate_argnums=(0, 1)
)
def _call(cs, ks, runs, inv_freq, *, k_dtype, max_run, interpret):
    layers, window = len(cs), window_of(max_run)
    runs = Runs(*(jnp.asarray(a, jnp.int32) for a in runs))
    cos, sin = run_rotations(runs, inv_freq, window)
    pools = [jax.new_ref(x, memory_space=plgpu.GMEM) for x in (*cs, *ks)]  # aliased in, out
    kernel = pl.kernel(
        functools.partial(_kernel, k_dtype=k_dtype, interpret=interpret),
        out_type=(),
        mesh=plgpu.Mesh(grid=(runs.src.shape[0],), grid_names=("run",)),
        interpret=mosaic_gpu_interpret() if interpret else False,
        name="splice_rotate_gpu",
    )
    kernel(*runs[:3], cos, sin, *pools)
    out = [ref[...] for ref in pools]
    return tuple(out[:layers]), tuple(out[layers:])


def splice_rotate_gpu(
    cs, ks, runs: Runs, inv_freq, *, k_dtype=None, max_run: int = DEFAULT_MAX_RUN, interpret=False
):
    """The Mosaic GPU kernel, one call for every layer; same contract as
    `pallas_kernels.splice_rotate.splice_rotate_jnp`. The pools are donated and updated in
    place. `interpret`: False (compiled, on a Hopper GPU) or True (Mosaic GPU's interpreter)."""
    validate_runs_static(cs, ks, runs, inv_freq, max_run)
    if not any(isinstance(a, jax.core.Tracer) for a in runs):
        validate_runs_dynamic(cs[0].shape[0], runs, max_run)
    if why := unsupported(cs, ks, inv_freq, max_run):
        raise ValueError(f"the GPU splice kernel does not take these pools: {why}")
    k_dtype = jnp.dtype(ks[0].dtype if k_dtype is None else k_dtype)
    return _call(
        tuple(cs),
        tuple(ks),
        Runs(*runs),
        jnp.asarray(inv_freq, jnp.float32),
        k_dtype=k_dtype,
        max_run=max_run,
        interpret=bool(interpret),
    )
