"""The building blocks every attention family and MLP shares: `Linear`, `RMSNorm` (and its pure
`rms_norm`), SwiGLU (`swiglu`, `MLP`), and their Hugging Face checkpoint layout (`hf_shapes`,
`HFLeaves`), which each family's tensor table and converter extend with its attention.

Parameters are created as zeros/ones: models are always built abstractly (`nnx.eval_shape`) and
filled from a checkpoint by `leyline_jax.loader`, never trained from this initialisation.
Weights are stored `[in, out]` (`x @ kernel`). RMSNorm statistics are float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """[..., D] -> [..., D]: statistics in fp32, normalised value cast back before the weight."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return weight * (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def matmul(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """[..., K] @ [K, N] -> [..., N] in `x`'s dtype, as `einsum` over the rows as one matrix.
    A single bf16 row is multiplied as two (the row and a copy): XLA:CPU turns a one-row bf16
    product into a matrix-vector product over the weight converted to fp32 on every call (a
    decode step of one row took 4x as long as one of two)."""
    rows = x.reshape(-1, x.shape[-1])
    one = rows.shape[0] == 1 and x.dtype == w.dtype == jnp.bfloat16
    out = einsum("mk,kn->mn", jnp.broadcast_to(rows, (2, rows.shape[1])) if one else rows, w)
    return out[: rows.shape[0]].reshape(*x.shape[:-1], w.shape[-1])


def einsum(spec: str, a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """`jnp.einsum(spec, a, b)` in `a`'s dtype. bf16 operands are multiplied with float32
    accumulation and output, then rounded once: the arithmetic a plain bf16 product means on
    every backend, but XLA:CPU runs it through its bf16 GEMM (about twice its fp32 rate on CPUs
    with AVX512-BF16) where a plain bf16 product takes a path several times slower than fp32.
    XLA:CPU's generic dot has no bf16 x bf16 -> f32 kernel, and a product XLA lays out
    permuted may not reach the GEMM: `nts,sr->tnr` in the whole-sequence MLA attention failed
    when it ran (UNIMPLEMENTED in DotThunk; not every permuted spec does). So `spec` must be
    written in `dot_general`'s own output order (batch, `a`'s free, `b`'s free axes), summing
    out no free axis: the case the products here need, checked."""
    ins, out = spec.split("->")
    lhs, rhs = ins.split(",")
    batch = [x for x in lhs if x in rhs and x in out]
    natural = "".join(batch + [x for x in lhs if x not in rhs] + [x for x in rhs if x not in lhs])
    if out != natural:
        raise ValueError(f"{spec}: the output must be in dot_general's order ({natural})")
    if a.dtype == b.dtype == jnp.bfloat16:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(a.dtype)
    return jnp.einsum(spec, a, b)


def swiglu(x: jnp.ndarray, gate: jnp.ndarray, up: jnp.ndarray, down: jnp.ndarray) -> jnp.ndarray:
    """[..., H] -> [..., H]: down(silu(x @ gate) * (x @ up))."""
    return matmul(jax.nn.silu(matmul(x, gate)) * matmul(x, up), down)


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, dtype):
        self.kernel = nnx.Param(jnp.zeros((din, dout), dtype))  # [in, out]

    def __call__(self, x):
        return matmul(x, self.kernel[...])


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


# ---- the Hugging Face checkpoint layout of the shared parts ------------------------------------
def hf_shapes(config, layer: Callable[[str, int], dict]) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `config` holds, with its on-disk shape (linear
    weights `[out, in]` as torch stores them): the embeddings, norms and LM head of every
    family, and each layer's attention and MLP from `layer(prefix, i)`."""
    c, h = config, config.hidden_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes.update(layer(p, i))
    return shapes


def mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


_TILE = 256  # rows and columns of one block of a transposing copy


def contiguous(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`a` as a C-contiguous array (copied into `out` if given). A transposed view (the last
    two axes swapped, as `.T` makes) is copied block by block, so that reads and writes both
    stay in cache (numpy's own copy strides across whole rows on one side: 4-8x slower on an
    embedding-sized matrix), as unsigned integers of the same width (bit-exact; faster than
    numpy's copy of a custom dtype such as bfloat16)."""
    if out is None:
        if a.flags.c_contiguous:
            return a
        out = np.empty(a.shape, a.dtype)
    if a.ndim < 2 or not a.swapaxes(-1, -2).flags.c_contiguous:
        out[...] = a
        return out
    bits = f"u{a.dtype.itemsize}"
    src, dst = a.view(bits), out.view(bits)
    rows, cols = a.shape[-2:]
    for i in range(0, rows, _TILE):
        for j in range(0, cols, _TILE):
            dst[..., i : i + _TILE, j : j + _TILE] = src[..., i : i + _TILE, j : j + _TILE]
    return out


class HFLeaves:
    """Lazy leaves of `CausalLM` params from a flat mapping of Hugging Face tensors (names and
    shapes already checked): each is a zero-argument callable that reads the tensors it needs
    and builds the param as numpy in `dtype`, linear weights transposed to `[in, out]`. A
    family adds `attention(prefix)` (and `moe(prefix)` for sparse layers); `params()` is the
    nested params dict."""

    def __init__(self, config, tensors: Mapping[str, Any], dtype):
        self.c, self.tensors, self.dtype = config, tensors, dtype

    def get(self, name, out_dtype=None):  # a fresh array (a lazy tensor's read is one already)
        return np.array(self.tensors[name], dtype=out_dtype or self.dtype)

    def plain(self, name, out_dtype=None):
        return lambda: self.get(name, out_dtype)

    def linear(self, name, out_dtype=None):  # [out, in] -> [in, out]
        return {"kernel": lambda: self.get(name, out_dtype).T}

    def mlp(self, prefix) -> dict:
        return {
            k: self.linear(f"{prefix}.{k}.weight") for k in ("gate_proj", "up_proj", "down_proj")
        }

    def layer(self, i: int) -> dict:
        p = f"model.layers.{i}"
        return {
            "input_norm": {"weight": self.plain(f"{p}.input_layernorm.weight")},
            "post_attention_norm": {"weight": self.plain(f"{p}.post_attention_layernorm.weight")},
            "attn": self.attention(f"{p}.self_attn"),
            "mlp": self.moe(p) if self.c.is_sparse(i) else self.mlp(f"{p}.mlp"),
        }

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "embed": self.plain("model.embed_tokens.weight"),
            "layers": {i: self.layer(i) for i in range(self.c.num_hidden_layers)},
            "final_norm": {"weight": self.plain("model.norm.weight")},
        }
        if not self.c.tie_word_embeddings:
            params["lm_head"] = self.linear("lm_head.weight")
        return params
