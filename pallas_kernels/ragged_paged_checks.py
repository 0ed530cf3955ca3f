"""The validators of `pallas_kernels.ragged_paged_attention` (whose module docstring holds the
contract): the static checks every implementation runs at trace time, the concrete checks of
the metadata, whether the TPU kernel takes the arrays, and the decoding of stored bands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


# ---- validators -----------------------------------------------------------------------------
def _band_dtype(name: str, stored, meaning):
    """The float type a stored band means: its own dtype, or `meaning` when it holds raw bits."""
    stored = jnp.dtype(stored)
    if meaning is None:
        if not jnp.issubdtype(stored, jnp.floating):
            raise ValueError(f"{name} holds {stored} bits: name the float type they mean")
        return stored
    meaning = jnp.dtype(meaning)
    if not jnp.issubdtype(meaning, jnp.floating):
        raise ValueError(f"{name}'s dtype must name a float type, got {meaning}")
    if stored == meaning:
        return meaning
    if jnp.issubdtype(stored, jnp.unsignedinteger) and stored.itemsize == meaning.itemsize:
        return meaning
    raise ValueError(f"{name} stored as {stored} cannot hold {meaning} values")


def validate_static(
    q_lat,  # [T, N, R], or None for the grouped form
    q_pe,  # [T, N, Dr]
    c_kv,  # [P, page_size, R]
    k_pe,  # [P, page_size, Dr]
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    num_rows,  # i32[1]
    *,
    kv_dtype=None,
    k_pe_dtype=None,
    compiled: bool = False,
) -> tuple[jnp.dtype, jnp.dtype]:
    """Shapes and dtypes (cheap; runs at trace time). Returns the float types of c_kv and k_pe.
    `compiled`: also check the layout the compiled TPU kernel needs (R a multiple of 128 lanes,
    page_size and N multiples of their dtype's sublane tile)."""
    grouped = q_lat is None
    if q_pe.ndim != 3 or (not grouped and (q_lat.ndim != 3 or q_lat.shape[:2] != q_pe.shape[:2])):
        raise ValueError(
            "q_lat, q_pe must be [T, N, *] with equal T, N: "
            f"{None if grouped else q_lat.shape}, {q_pe.shape}"
        )
    ndim = 4 if grouped else 3
    if c_kv.ndim != ndim or k_pe.ndim != ndim or c_kv.shape[:-1] != k_pe.shape[:-1]:
        raise ValueError(
            f"c_kv, k_pe must be [P, page_size{', G' if grouped else ''}, *] with equal leading "
            f"dimensions: {c_kv.shape}, {k_pe.shape}"
        )
    if grouped:
        if compiled:
            raise ValueError("the compiled kernel serves the MLA form only (q_lat given)")
        if q_pe.shape[1] % c_kv.shape[2]:
            raise ValueError(f"{q_pe.shape[1]} query heads do not group over {c_kv.shape[2]}")
    elif q_lat.shape[2] != c_kv.shape[-1]:
        raise ValueError(f"q_lat width {q_lat.shape[2]} != c_kv width {c_kv.shape[-1]} (R)")
    if q_pe.shape[2] != k_pe.shape[-1]:
        raise ValueError(f"q_pe width {q_pe.shape[2]} != k_pe width {k_pe.shape[-1]} (Dr)")
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices must be [B, W], got {page_indices.shape}")
    b = page_indices.shape[0]
    for name, a, shape in (
        ("kv_lens", kv_lens, (b,)),
        ("page_indices", page_indices, page_indices.shape),
        ("cu_q_lens", cu_q_lens, (b + 1,)),
        ("num_rows", num_rows, (1,)),
    ):
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    for name, q in (("q_lat", q_lat), ("q_pe", q_pe)):
        if q is not None and not jnp.issubdtype(q.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got {q.dtype}")
    kv_type = _band_dtype("c_kv", c_kv.dtype, kv_dtype)
    k_pe_type = _band_dtype("k_pe", k_pe.dtype, k_pe_dtype)
    if compiled:
        r, page_size, n = c_kv.shape[-1], c_kv.shape[-2], q_lat.shape[1]
        if r % 128:
            raise ValueError(f"the compiled kernel needs R (c_kv width {r}) a multiple of 128")
        for name, band in (("c_kv", c_kv), ("k_pe", k_pe)):
            sublanes = 8 * (4 // jnp.dtype(band.dtype).itemsize)
            if page_size % sublanes:
                raise ValueError(
                    f"the compiled kernel needs page_size {page_size} a multiple of {sublanes} "
                    f"({name} stored as {band.dtype})"
                )
        heads = 8 * (4 // jnp.dtype(q_lat.dtype).itemsize)  # (token, head) rows fold onto sublanes
        if n % heads:
            raise ValueError(f"the compiled kernel needs N (heads, {n}) a multiple of {heads}")
    return kv_type, k_pe_type


def fits_tpu(*args, **kw) -> bool:
    """The compiled kernel takes these shapes (`validate_static(compiled=True)`)."""
    try:
        validate_static(*args, compiled=True, **kw)
    except ValueError:
        return False
    return True


def validate_dynamic(
    q,  # [T, N, *]: either query array (only T is read)
    c_kv,  # [P, page_size, ...]
    kv_lens,  # i32[B]
    page_indices,  # i32[B, W]
    cu_q_lens,  # i32[B + 1]
    num_rows,  # i32[1]
) -> None:
    """Metadata ranges (needs concrete values: call outside jit). Rows >= num_rows are padding
    and not checked."""
    kv_lens, page_indices = np.asarray(kv_lens), np.asarray(page_indices)
    cu_q_lens, num_rows = np.asarray(cu_q_lens), int(np.asarray(num_rows)[0])
    t = q.shape[0]
    pages, page_size = c_kv.shape[:2]
    b, w = page_indices.shape
    if not 0 <= num_rows <= b:
        raise ValueError(f"num_rows {num_rows} must be in [0, {b}]")
    cu = cu_q_lens[: num_rows + 1]
    if cu[0] < 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_q_lens must be non-negative and non-decreasing: {cu}")
    if cu[-1] > t:
        raise ValueError(f"cu_q_lens[num_rows] = {cu[-1]} exceeds the {t} query tokens")
    kv = kv_lens[:num_rows]
    if ((kv < 0) | (kv > w * page_size)).any():
        raise ValueError(f"kv_lens must be in [0, W * page_size = {w * page_size}]: {kv}")
    q_lens = np.diff(cu)
    if (q_lens > kv).any():
        row = int(np.argmax(q_lens > kv))
        raise ValueError(f"row {row} has {q_lens[row]} queries but kv_lens {kv[row]}")
    used = np.arange(w)[None, :] < -(-kv[:, None] // page_size)  # bool[num_rows, W]
    bad = used & ((page_indices[:num_rows] < 0) | (page_indices[:num_rows] >= pages))
    if bad.any():
        row = int(np.argmax(bad.any(axis=1)))
        raise ValueError(f"page_indices of row {row} name a page outside [0, {pages})")


def from_storage(x, dtype):
    """Stored rows -> float rows (a bitcast when they are raw bits)."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x
