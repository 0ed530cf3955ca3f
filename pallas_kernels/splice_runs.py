"""The splice's run contract, shared by every implementation (`pallas_kernels.splice_rotate`
documents it): the runs, their planning and validation, and the rotation's fp32 math."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_MAX_RUN = 16  # rows per run: a page of the paged state's default page size


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
    return phase_rows(jnp.arange(length, dtype=jnp.int32), inv_freq)


def phase_rows(pos, inv_freq):
    """f32[M, D] = [cos | sin] of the fp32 phases pos * inv_freq."""
    th = pos.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)
    return jnp.concatenate([jnp.cos(th), jnp.sin(th)], axis=-1)


def _difference(a, b):
    """cos, sin [M, D/2] of the rotation from phase a to phase b, from their [cos | sin] rows
    [M, D] by the angle-difference identities."""
    h = a.shape[-1] // 2
    ca, sa, cb, sb = a[:, :h], a[:, h:], b[:, :h], b[:, h:]
    return cb * ca + sb * sa, sb * ca - cb * sa


def rotation(pos_from, pos_to, inv_freq, table=None):
    """cos, sin f32[M, D/2] of the rotation taking phase pos_from*inv to pos_to*inv."""
    if table is None:
        return _difference(phase_rows(pos_from, inv_freq), phase_rows(pos_to, inv_freq))
    return _difference(table.at[pos_from].get(mode="clip"), table.at[pos_to].get(mode="clip"))


def as_bits(x):
    """Same-width unsigned view (bit-exact)."""
    return jax.lax.bitcast_convert_type(
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
    )


def to_values(x, k_dtype):
    """Stored rows -> fp32 values (stored rows may be the raw bits of `k_dtype`)."""
    return (jax.lax.bitcast_convert_type(x, k_dtype) if x.dtype != k_dtype else x).astype(
        jnp.float32
    )


def to_stored(y, k_dtype, store_dtype):
    """fp32 values -> stored rows (cast to `k_dtype`, then to its bits if stored as bits)."""
    y = y.astype(k_dtype)
    return jax.lax.bitcast_convert_type(y, store_dtype) if store_dtype != k_dtype else y
