"""The kernels' dispatch is chosen per platform when a program is lowered, not by the backend
jax runs on when it is traced (`pallas_kernels.dispatch.on_platform`): on this CPU, a program
exported for TPU holds the TPU kernel's call, and exported for CPU or CUDA the jnp path.
Lowered here, without either accelerator (`jax.export`), at DeepSeek-V2-Lite's attention
widths.

One artifact for several platforms at once (`platforms=["cpu", "tpu"]`) does not lower with
jax 0.10: it lowers each kept `platform_dependent` branch for every platform of the module, and
a Pallas TPU call has no CPU lowering ("Only interpret mode is supported on CPU backend")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.splice_rotate import Runs, splice_rotate

SDS = jax.ShapeDtypeStruct
I32 = jnp.int32
TPU_CALL = "tpu_custom_call"


def exported_text(fn, args, platforms) -> str:
    return jax.export.export(jax.jit(fn), platforms=platforms)(*args).mlir_module()


def splice_args(layers=3, slots=64 * 16, runs=8):
    cs = tuple(SDS((slots, 512), jnp.bfloat16) for _ in range(layers))
    ks = tuple(SDS((slots, 64), jnp.bfloat16) for _ in range(layers))
    return cs, ks, Runs(*[SDS((runs,), I32)] * 5), SDS((32,), jnp.float32)


def attention_args(tokens=16, rows=4, pages=64, width=8, heads=16):
    q_lat, q_pe = SDS((tokens, heads, 512), jnp.float32), SDS((tokens, heads, 64), jnp.float32)
    c_kv, k_pe = SDS((pages, 16, 512), jnp.bfloat16), SDS((pages, 16, 64), jnp.bfloat16)
    meta = SDS((rows,), I32), SDS((rows, width), I32), SDS((rows + 1,), I32), SDS((1,), I32)
    return q_lat, q_pe, c_kv, k_pe, *meta


def splice(impl):
    return lambda cs, ks, runs, inv: splice_rotate(cs, ks, runs, inv, impl=impl)


def attention(impl):
    return lambda *a: ragged_paged_attention(*a, scale=0.1, impl=impl)


CASES = {"splice": (splice, splice_args), "attention": (attention, attention_args)}


@pytest.mark.parametrize("kernel", list(CASES))
def test_each_platform_lowers_with_its_kernel(kernel):
    make, args = CASES[kernel]
    assert TPU_CALL in exported_text(make(None), args(), ["tpu"])
    assert TPU_CALL not in exported_text(make(None), args(), ["cpu"])  # the jnp path
    assert TPU_CALL not in exported_text(make(None), args(), ["cuda"])  # jnp: no GPU kernel yet


@pytest.mark.parametrize("kernel", list(CASES))
def test_the_check_can_fail(kernel):
    """Forced onto the jnp path, the TPU artifact holds no kernel call: the check sees it."""
    make, args = CASES[kernel]
    assert TPU_CALL not in exported_text(make("jnp"), args(), ["tpu"])
