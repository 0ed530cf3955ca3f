"""The lowering gate for split-KV decode attention on Hopper: one layer's decode step lowered here
for CUDA (`jax.export`, no GPU), at DeepSeek-V2-Lite's widths (MLA: latent 512 bf16, RoPE band
64 fp32, 16 heads), DeepSeek-V3's (128 heads) and a Llama-3-8B-shaped GQA model (8 KV heads of
128, 32 query heads; K and V bf16), 128 rows of 32k slots in pages of 64. Each artifact must hold
the GPU kernel's call (`mosaic_gpu`, named `ragged_paged_attention_gpu`), which Mosaic GPU emits
only once the kernel's shared memory fits the chip (227 KB a program).

Shared memory per program, as the plan counts it (`ragged_paged_gpu_plan.smem_bytes`, which
these tests hold equal to Mosaic GPU's own count, to the byte) and programs per SM (227 KB each,
1 KB of it the runtime's per resident program):

- GQA (Llama-8B): 84,112 B (Q's three terms 12 KB, two stages of K and V pages 64 KB, P's terms
  6 KB, barriers): two programs an SM, each with two kv blocks in flight.
- MLA (V2-Lite, V3): 227,440 B (Q_lat's and Q_pe's three terms 54 KB, two stages of the latent
  block 128 KB, one of the fp32 rotated band 16 KB, its terms 24 KB): one program an SM, with two
  kv blocks in flight. Two programs cannot fit any variant of this kernel: one program's queries
  and a single 64-slot latent block alone (48 + 6 + 64 KB) exceed half an SM (112.5 KB); the
  fp32 queries' three bf16 terms are what cost it (a bf16 query would be 18 KB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import ragged_paged_gpu_plan as gp
from pallas_kernels.dispatch import lowering_for
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

SDS = jax.ShapeDtypeStruct
I32 = jnp.int32
ROWS, CONTEXT, PAGE = 128, 32768, 64
PAGES = ROWS * CONTEXT // PAGE  # the pool: every row's pages
# name: (heads, latent / V width, K width, K dtype meaning, KV groups or None for MLA)
MODELS = {
    "v2-lite": (16, 512, 64, jnp.float32, None),
    "v3": (128, 512, 64, jnp.float32, None),
    "llama-8b": (32, 128, 128, jnp.bfloat16, 8),
}
MLA = ("v2-lite", "v3")


def decode_args(model: str):
    """One layer's decode step: ROWS rows of one query each, W = CONTEXT / PAGE pages a row; the
    moved band (and GQA's K) stored as bf16 bits, as the engine stores them."""
    heads, dv, dk, k_type, groups = MODELS[model]
    meta = SDS((ROWS,), I32), SDS((ROWS, CONTEXT // PAGE), I32), SDS((ROWS + 1,), I32)
    meta = (*meta, SDS((1,), I32))
    k_dt = jnp.uint16 if k_type == jnp.bfloat16 else k_type
    if groups:  # grouped: V and K pages [P, page, G, D], queries [T, N, D]
        v, k = SDS((PAGES, PAGE, groups, dv), jnp.uint16), SDS((PAGES, PAGE, groups, dk), k_dt)
        return None, SDS((ROWS, heads, dk), jnp.float32), v, k, *meta
    q_lat, q_pe = SDS((ROWS, heads, dv), jnp.float32), SDS((ROWS, heads, dk), jnp.float32)
    return q_lat, q_pe, SDS((PAGES, PAGE, dv), jnp.uint16), SDS((PAGES, PAGE, dk), k_dt), *meta


def attention(model: str, impl=None):
    k_type = MODELS[model][3]
    kw = dict(kv_dtype=jnp.bfloat16, k_pe_dtype=jnp.bfloat16 if k_type == jnp.bfloat16 else None)
    return lambda *a: ragged_paged_attention(*a, scale=0.1, impl=impl, **kw)


def exported(model: str, impl=None) -> str:
    """The decode step exported for CUDA (traced under `lowering_for("cuda")`)."""
    with lowering_for("cuda"):
        fn = jax.jit(attention(model, impl))
        return jax.export.export(fn, platforms=["cuda"])(*decode_args(model)).mlir_module()


def plan(model: str) -> gp.Plan:
    q_lat, q_pe, c_kv, k_pe, _, page_indices, *_ = decode_args(model)
    result = gp.plan_for(q_lat, q_pe, c_kv, k_pe, page_indices, jnp.dtype(MODELS[model][3]))
    assert isinstance(result, gp.Plan), result
    return result


def smem_limit(limit: int):
    """Mosaic GPU's own shared-memory bound lowered to `limit` bytes a program (its test hook,
    `artificial_shared_memory_limit`, in jax 0.10 and 0.11)."""
    from jax.experimental.mosaic.gpu import core

    if not hasattr(core, "artificial_shared_memory_limit"):
        pytest.skip("this jax has no artificial_shared_memory_limit")
    return core.artificial_shared_memory_limit(limit)


@pytest.mark.parametrize("model", list(MODELS))
def test_decode_lowers_with_the_kernel(model):
    """The kernel's call in the artifact; its programs fill 132 SMs, all resident at once."""
    text = exported(model)
    assert "mosaic_gpu" in text and "ragged_paged_attention_gpu" in text
    p = plan(model)
    assert p.stages == 2 and p.per_sm * (p.smem + gp.SMEM_RESERVED) <= gp.SMEM_PER_SM
    assert p.programs <= gp.NUM_SMS * p.per_sm and p.programs >= gp.NUM_SMS * p.per_sm - 8
    assert p.per_sm == (1 if model in MLA else 2), p


@pytest.mark.parametrize("model", list(MODELS))
def test_the_plan_counts_shared_memory_as_mosaic_gpu_does(model):
    """Lowered with Mosaic GPU's bound at the plan's count the kernel passes; a byte less and it
    is refused: the count (and so programs per SM) is Mosaic GPU's, not an estimate."""
    p = plan(model)
    with smem_limit(p.smem):
        assert "mosaic_gpu" in exported(model)
    with smem_limit(p.smem - 1), pytest.raises(Exception, match="shared memory"):
        exported(model)


def test_two_gqa_programs_fit_an_sm():
    """Llama-8B's program lowers within half an SM (less the runtime's 1 KB): two fit."""
    with smem_limit(gp.SMEM_PER_SM // 2 - gp.SMEM_RESERVED):
        assert "mosaic_gpu" in exported("llama-8b")


@pytest.mark.parametrize("model", MLA)
def test_two_mla_programs_cannot_fit_an_sm(model):
    """The MLA program is refused within half an SM, and no single-stage variant of it fits
    there either (its queries' terms and one latent block alone take more): one program an SM,
    two stages deep."""
    with (
        smem_limit(gp.SMEM_PER_SM // 2 - gp.SMEM_RESERVED),
        pytest.raises(ValueError, match="shared memory"),
    ):
        exported(model)
    _, dv, dk, _, _ = MODELS[model]
    one_stage = gp.smem_bytes(
        qc=16, lat=True, dv=dv, dk=dk, k_bytes=4, k_terms=3, page_size=PAGE, stages=1
    )
    assert one_stage > gp.SMEM_PER_SM // 2 - gp.SMEM_RESERVED
    assert plan(model).qc == 16  # the fewest columns a wgmma's swizzled bf16 rows take


def test_a_variant_past_the_budget_is_refused(monkeypatch):
    """Three stages at V2-Lite (another 64 KB latent block: 291 KB): the plan refuses it (the
    dispatch keeps jnp: no kernel call), and lowered anyway, with the plan's bound lifted, Mosaic
    GPU refuses it for its shared memory."""
    monkeypatch.setattr(gp, "STAGES", 3)
    q_lat, q_pe, c_kv, k_pe, _, page_indices, *_ = decode_args("v2-lite")
    why = gp.unsupported(q_lat, q_pe, c_kv, k_pe, page_indices, jnp.bfloat16, jnp.float32)
    assert "shared memory" in why
    assert "mosaic_gpu" not in exported("v2-lite")
    monkeypatch.setattr(gp, "SMEM_BYTES", 1 << 30)
    assert plan("v2-lite").smem > gp.SMEM_PER_SM
    with pytest.raises(Exception, match="shared memory"):
        exported("v2-lite")


def test_the_gate_can_fail():
    """Forced onto the jnp path, the artifact holds no kernel call: the check sees it."""
    assert "mosaic_gpu" not in exported("v2-lite", impl="jnp")
