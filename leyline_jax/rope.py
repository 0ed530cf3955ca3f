"""RoPE and YaRN as pure functions, in the one layout the package uses: halves.

Pair i of a rope band of width Dr is (x[i], x[i + Dr/2]), rotated by phase `position * inv_freq[i]`.
Checkpoints that pair dimensions interleaved ((x[2i], x[2i+1])) are permuted at load time
(`deinterleave_perm`), so every code path here, and the splice kernel, sees one layout.

Phases are computed the way the reference does: fp32 `position * inv_freq`. YaRN's attention factor
(`MLAConfig.rope_scale`) multiplies cos/sin when a key or query is first embedded
(`apply_rope`), exactly where transformers applies it, and so is baked into cached `k_pe`.
`rotate` is a pure, unit-magnitude rotation: it never applies the attention factor again.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=32)
def inv_freq(
    dim: int,
    theta: float,
    *,
    yarn_factor: float | None = None,
    original_max: int | None = None,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> np.ndarray:
    """f32[dim/2] inverse frequencies of a rope band `dim` wide with base `theta`; with
    `yarn_factor`, YaRN-corrected (the other arguments are YaRN's: `original_max` its
    original_max_position_embeddings, `truncate` rounds the ramp's ends to whole dimensions).
    Read-only and cached per arguments (the model calls this in every trace, through its
    config's `rope_inv_freq()`).

    Mirrors transformers' `compute_default_rope_parameters` / `_compute_yarn_parameters` step by
    step in float32, so that phases agree with the reference to the last few ulps.
    """
    base = np.float32(theta)
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(base, exponents, dtype=np.float32)
    if yarn_factor is None:
        return _frozen((np.float32(1.0) / pos_freqs).astype(np.float32))

    factor = np.float32(yarn_factor)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip(
        (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
    ).astype(np.float32)
    extrapolation_factor = np.float32(1.0) - ramp
    out = interpolation * (np.float32(1.0) - extrapolation_factor) + (
        extrapolation * extrapolation_factor
    )
    return _frozen(out.astype(np.float32))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def deinterleave_perm(dim: int) -> np.ndarray:
    """i32[dim]: `x_halves = x_interleaved[perm]` (pair (2i, 2i+1) becomes pair (i, i + dim/2))."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)]).astype(np.int32)


def phases(positions: jnp.ndarray, inv_freq_: jnp.ndarray) -> jnp.ndarray:
    """f32[..., Dr/2] absolute phases `position * inv_freq`, in fp32 as the reference."""
    return positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_, jnp.float32)


def _rotate_halves(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_rope(
    x: jnp.ndarray,  # [..., T, (N,) Dr] in the halves layout
    positions: jnp.ndarray,  # i32[..., T]
    inv_freq_: jnp.ndarray,  # f32[Dr/2]
    scale: float = 1.0,  # YaRN attention factor (MLAConfig.rope_scale)
    *,
    heads_axis: bool = False,  # True when x has a head axis between T and Dr
) -> jnp.ndarray:
    """Embed position into a rope band: x -> scale * R(position) x; fp32 math, x.dtype result."""
    ph = phases(positions, inv_freq_)  # [..., T, Dr/2]
    if heads_axis:
        ph = ph[..., None, :]
    cos = jnp.cos(ph) * scale
    sin = jnp.sin(ph) * scale
    return _rotate_halves(x.astype(jnp.float32), cos, sin).astype(x.dtype)


def rotate(x: jnp.ndarray, phase: jnp.ndarray) -> jnp.ndarray:
    """Unit-magnitude rotation of an embedded band by `phase` (f32[..., Dr/2]); fp32 math.

    R(a)R(b) = R(a+b); R(a)R(-a) = I. Moving a cached key between absolute positions is
    `pallas_kernels.splice_rotate` (rotation from each absolute phase's own cos/sin).
    """
    return _rotate_halves(x.astype(jnp.float32), jnp.cos(phase), jnp.sin(phase)).astype(x.dtype)
