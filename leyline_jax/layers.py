"""The building blocks every attention family and MLP shares: `Linear`, `RMSNorm` (and its pure
`rms_norm`), SwiGLU (`swiglu`, `MLP`).

Parameters are created as zeros/ones: models are always built abstractly (`nnx.eval_shape`) and
filled from a checkpoint by `leyline_jax.loader`, never trained from this initialisation.
Weights are stored `[in, out]` (`x @ kernel`). RMSNorm statistics are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """[..., D] -> [..., D]: statistics in fp32, normalised value cast back before the weight."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return weight * (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def swiglu(x: jnp.ndarray, gate: jnp.ndarray, up: jnp.ndarray, down: jnp.ndarray) -> jnp.ndarray:
    """[..., H] -> [..., H]: down(silu(x @ gate) * (x @ up))."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, dtype):
        self.kernel = nnx.Param(jnp.zeros((din, dout), dtype))  # [in, out]

    def __call__(self, x):
        return x @ self.kernel[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class MLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, dtype):
        self.gate_proj = Linear(hidden, inter, dtype)
        self.up_proj = Linear(hidden, inter, dtype)
        self.down_proj = Linear(inter, hidden, dtype)

    def __call__(self, x):
        return swiglu(
            x, self.gate_proj.kernel[...], self.up_proj.kernel[...], self.down_proj.kernel[...]
        )
