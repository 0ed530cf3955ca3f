"""splice_rotate's GPU kernel, in Mosaic GPU (Hopper: H100, H200; same contract as
`pallas_kernels.splice_rotate`, whose module docstring defines runs, pools and the rotation).

One call (`pl.kernel` over a Mosaic GPU mesh; the pools passed as refs, so they are aliased in
and out) moves every layer's pools. A program takes a block of `block` consecutive runs (a grid
over blocks, the last one padded with runs of length 0) and walks its items, the (run, layer)
pairs in order (every layer of its first run, then of the next), through two SMEM buffers:
item i in buffer `buffer(i)` (i % 2), each buffer a page-sized window of `c` rows and one of
`k` rows. For item i:

- its rows of both bands have come in by TMA (GMEM -> SMEM), one copy a band per power-of-two
  piece of the run's length (13 rows: 8 + 4 + 1; a copy has a static size) into the piece's
  own rows of the windows (`slot`: SMEM is sliced statically), each piece on its own barrier,
  which both bands' copies arrive on;
- once the stores of item i - 1 have read the other buffer, item i + 1's copies are issued
  into it (the next layer of the run, or the first layer of the block's next run): they travel
  while item i is stored;
- its `c` rows go out by TMA (SMEM -> GMEM) at the destination, bit-exact;
- its `k` window is rotated in place in registers in fp32, each half of each vector ([window,
  D/2] slices of the window) against the run's cos/sin rows (`run_rotations`: f32[window,
  D/2] in the window's row order, computed before the call from each absolute phase by the
  angle-difference identities as the jnp path does, read once per run for every layer), and
  its pieces go out by TMA. Rows past the run's length are never stored.

An item's stores are committed as one bulk group. Before the next item's copies go into the
other buffer, the program waits until the groups committed so far (the item before's, which
read that buffer) have read their SMEM (`wait_smem_to_gmem(0, wait_read_only=True)`, placed
before the current item's stores are issued, so those run on); the rotation's writes reach the
copy engine through `commit_smem`, whose warpgroup barrier also ends every thread's reads of a
buffer before it is refilled. Blocks: `runs_per_program` (enough programs to fill a Hopper's
SMs twice before a program takes several runs).

Shapes it takes (`unsupported` says why not): rows of both bands a whole number of 128 bytes
(Mosaic GPU's copy lowering takes byte counts divisible by a warpgroup's 128 threads); window x
D/2 a multiple of 256 (two values a lane; 16 x 32 for MLA's `k_pe`); the two buffers (2 x
window x both rows) within 200 KB of shared memory (V2-Lite, V3: 40 KB; Llama-3-8B: 128 KB).
The pools are updated in place (passed as refs). Runs must keep the run contract
(`validate_runs_dynamic`, checked here when they are concrete): the copies are told their rows
are inside the pool.
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
SMEM_BYTES = 200 * 1024  # of a Hopper's 227 KB of shared memory an SM: the two buffers' cap
IN_BOUNDS = plgpu.OOBFillMode.PROMISE_IN_BOUNDS  # runs inside the pool (the run contract)
BUFFERS = 2  # SMEM buffers a program cycles its items through
MAX_BLOCK = 8  # runs a program takes at most
MIN_PROGRAMS = 264  # programs before one takes several runs: two per SM of a 132-SM Hopper


def window_of(max_run: int) -> int:
    """Rows a run's window holds: the next power of two of `max_run`."""
    return 1 << (max_run - 1).bit_length()


def smem_bytes(cs, ks, max_run: int = DEFAULT_MAX_RUN) -> int:
    """Shared memory a program takes: `BUFFERS` windows of `c` rows and of `k` rows."""
    row = sum(b[0].shape[1] * jnp.dtype(b[0].dtype).itemsize for b in (cs, ks))
    return BUFFERS * window_of(max_run) * row


def runs_per_program(runs: int) -> int:
    """The block a program takes of `runs` runs: one run until there are `MIN_PROGRAMS`
    programs, then more, up to `MAX_BLOCK`."""
    return max(1, min(MAX_BLOCK, runs // MIN_PROGRAMS))


def unsupported(cs, ks, inv_freq, max_run: int = DEFAULT_MAX_RUN) -> str | None:
    """None when the kernel takes these pools, else why not (see the module docstring)."""
    h, window = int(np.shape(inv_freq)[0]), window_of(max_run)
    for name, band in (("c", cs), ("k", ks)):
        width, dtype = band[0].shape[1], jnp.dtype(band[0].dtype)
        if width * dtype.itemsize % COPY_BYTES:
            return f"a {name} row ({width} x {dtype.name}) is not a multiple of {COPY_BYTES} bytes"
    if window * h % (LANES * VEC):
        return f"window {window} x D/2 {h} is not a multiple of {LANES * VEC}"
    if (smem := smem_bytes(cs, ks, max_run)) > SMEM_BYTES:
        return f"two buffers of {window} rows take {smem} bytes of shared memory"
    return None


def buffer(item):
    """Which SMEM buffer a program's item (its index among the program's items) goes
    through: consecutive items alternate, so one's copies come in while the other's go out."""
    return item % BUFFERS


def _kernel(src_ref, dst_ref, len_ref, cos_ref, sin_ref, *pools, block, k_dtype, interpret):
    """One program per block of runs (mesh axis "block"). The scratch (SMEM buffers, barriers)
    is scoped in the kernel (Mosaic GPU's interpreter allocates barriers only there)."""
    layers = len(pools) // 2
    c, k = pools[0], pools[layers]
    window = cos_ref.shape[1]
    pl.run_scoped(
        functools.partial(
            _body,
            (src_ref, dst_ref, len_ref, cos_ref, sin_ref),
            pools[:layers],
            pools[layers:],
            block=block,
            k_dtype=k_dtype,
            interpret=interpret,
        ),
        plgpu.SMEM((BUFFERS, window, c.shape[1]), c.dtype),
        plgpu.SMEM((BUFFERS, window, k.shape[1]), k.dtype),
        # one barrier per (buffer, piece); a piece's c and k copies both arrive
        plgpu.Barrier(num_arrivals=2, num_barriers=BUFFERS * window.bit_length()),
    )


def _body(runs, cs, ks, c_buf, k_buf, bar, *, block, k_dtype, interpret):
    src_ref, dst_ref, len_ref, cos_ref, sin_ref = runs
    window, h = cos_ref.shape[1:]
    sizes = [1 << b for b in reversed(range(window.bit_length()))]  # the pieces, largest first
    layers = len(cs)
    first = jax.lax.axis_index("block") * block  # the program's first run

    def each(n, action):
        """action(piece index, size, the piece's rows in the run, its rows in the window) for
        each piece of a run of n rows."""
        for i, size in enumerate(sizes):
            run_rows = pl.ds(n & -(2 * size), size)  # the larger pieces come first
            pl.when((n & size) != 0)(
                functools.partial(action, i, size, run_rows, slot(size, window))
            )

    def fetch(r, layer, b):
        """Issue the copies of item (run r, layer) into buffer b."""
        s = src_ref[r]

        def copy(i, size, run_rows, rows):
            at = pl.ds(s + run_rows.start, size)
            for pool, buf in ((cs[layer], c_buf), (ks[layer], k_buf)):
                plgpu.copy_gmem_to_smem(
                    pool.at[at], buf.at[b, rows], bar.at[b * len(sizes) + i], oob_mode=IN_BOUNDS
                )

        each(len_ref[r], copy)

    def run(j, carry):
        r = first + j
        d, n = dst_ref[r], len_ref[r]
        cos = strided(cos_ref[r], interpret)  # f32[window, D/2], for every layer
        sin = strided(sin_ref[r], interpret)
        for layer in range(layers):
            item = j * layers + layer
            b, following = buffer(item), buffer(item + 1)

            def wait(i, size, run_rows, rows, b=b):
                plgpu.barrier_wait(bar.at[b * len(sizes) + i])

            def store(pool, buf, b=b):
                def copy(i, size, run_rows, rows):
                    at = pl.ds(d + run_rows.start, size)
                    plgpu.copy_smem_to_gmem(buf.at[b, rows], pool.at[at], commit_group=False)

                each(n, copy)

            each(n, wait)  # the item's rows are in
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's stores read theirs
            if layer + 1 < layers:
                fetch(r, layer + 1, following)
            else:
                pl.when(j + 1 < block)(functools.partial(fetch, r + 1, 0, following))
            store(cs[layer], c_buf)
            window_k = k_buf.at[b]
            for lo in range(0, k_buf.shape[-1], 2 * h):  # each vector of the row
                x1_at, x2_at = pl.ds(lo, h), pl.ds(lo + h, h)
                x1 = to_values(strided(window_k[:, x1_at], interpret), k_dtype)
                x2 = to_values(strided(window_k[:, x2_at], interpret), k_dtype)
                window_k[:, x1_at] = to_stored(x1 * cos - x2 * sin, k_dtype, k_buf.dtype)
                window_k[:, x2_at] = to_stored(x2 * cos + x1 * sin, k_dtype, k_buf.dtype)
            plgpu.commit_smem()  # the rotated rows, visible to the copy engine
            store(ks[layer], k_buf)
            plgpu.commit_smem_to_gmem_group()
        return carry

    fetch(first, 0, buffer(0))
    jax.lax.fori_loop(0, block, run, 0)
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
    jax.jit,
    static_argnames=("k_dtype", "max_run", "block", "interpret"),
    donate_argnums=(0, 1),
)
def _call(cs, ks, runs, inv_freq, *, k_dtype, max_run, block, interpret):
    layers, window = len(cs), window_of(max_run)
    m = runs.src.shape[0]
    pad = -m % block  # the last block's padding: runs of length 0
    runs = Runs(*(jnp.pad(jnp.asarray(a, jnp.int32), (0, pad)) for a in runs))
    cos, sin = run_rotations(runs, inv_freq, window)
    pools = [jax.new_ref(x, memory_space=plgpu.GMEM) for x in (*cs, *ks)]  # aliased in, out
    kernel = pl.kernel(
        functools.partial(_kernel, block=block, k_dtype=k_dtype, interpret=interpret),
        out_type=(),
        mesh=plgpu.Mesh(grid=((m + pad) // block,), grid_names=("block",)),
        interpret=mosaic_gpu_interpret() if interpret else False,
        name="splice_rotate_gpu",
    )
    kernel(*runs[:3], cos, sin, *pools)
    out = [ref[...] for ref in pools]
    return tuple(out[:layers]), tuple(out[layers:])


def splice_rotate_gpu(
    cs,
    ks,
    runs: Runs,
    inv_freq,
    *,
    k_dtype=None,
    max_run: int = DEFAULT_MAX_RUN,
    block: int | None = None,
    interpret=False,
):
    """The Mosaic GPU kernel, one call for every layer; same contract as
    `pallas_kernels.splice_rotate.splice_rotate_jnp`. The pools are donated and updated in
    place. `block`: runs a program takes (default `runs_per_program`). `interpret`: False
    (compiled, on a Hopper GPU) or True (Mosaic GPU's interpreter)."""
    validate_runs_static(cs, ks, runs, inv_freq, max_run)
    if not any(isinstance(a, jax.core.Tracer) for a in runs):
        validate_runs_dynamic(cs[0].shape[0], runs, max_run)
    if why := unsupported(cs, ks, inv_freq, max_run):
        raise ValueError(f"the GPU splice kernel does not take these pools: {why}")
    if block is not None and block < 1:
        raise ValueError(f"block {block} must be positive")
    k_dtype = jnp.dtype(ks[0].dtype if k_dtype is None else k_dtype)
    return _call(
        tuple(cs),
        tuple(ks),
        Runs(*runs),
        jnp.asarray(inv_freq, jnp.float32),
        k_dtype=k_dtype,
        max_run=max_run,
        block=block or runs_per_program(runs.src.shape[0]),
        interpret=bool(interpret),
    )
