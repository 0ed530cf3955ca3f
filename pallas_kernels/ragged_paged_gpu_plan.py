"""The work plan of ragged_paged_attention's GPU kernel (`ragged_paged_attention_gpu`, whose module
docstring describes the kernel): its static shape (`Plan`: query columns per program, head blocks,
token items, kv splits), which arrays it takes (`unsupported` says why not), the token items and the
query columns made before the call, and the kv splits' merge after it; the bf16 terms of an fp32
operand (`split3` in the kernel, `split3_bits` in XLA).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

BK = 64  # slots per kv block: the M of every wgmma
ACC_VALUES = 8192  # fp32 values of the out^T accumulator (64 registers a thread of a warpgroup)
QC_SIZES = (256, 192, 128, 64, 32, 16)  # query columns of a program: the N of a wgmma, whose
# bf16 rows swizzle whole (a multiple of 128 bytes, or 64 or 32 bytes)
TERMS = 3  # bf16 terms of an fp32 operand (8 + 8 + 8 bits of mantissa)
SMEM_BYTES = 220 * 1024  # of a Hopper's 227 KB of shared memory an SM
PROGRAMS = 264  # kv splits aim at this many programs (two per SM of an H100 / H200's 132)
_F32, _BF16 = jnp.float32, jnp.bfloat16


class Plan(NamedTuple):
    """The static shape of one call."""

    groups: int  # G: KV heads (1 for MLA)
    hb: int  # heads of a group in one program
    head_blocks: int  # programs along the heads: G * (N / G) / hb
    tokens: int  # tokens of one row in one program
    qc: int  # query columns of one program: hb * tokens
    items: int  # token items (a bound: cdiv(T, tokens) + B)
    splits: int  # kv ranges per item
    k_terms: int  # bf16 terms of the rotated band (3 for fp32, 1 for bf16)
    lat: bool  # MLA: the moved band is also a key (the latent score term)


def _smem_bytes(plan: Plan, r_score: int, dk: int, dv: int) -> int:
    qc = plan.qc
    q = TERMS * qc * (r_score + dk) * 2
    tiles = BK * dv * 2 + BK * dk * 4 + plan.k_terms * BK * dk * 2 + TERMS * BK * qc * 2
    out = dv * qc * 4 + BK * qc * 4
    return q + tiles + out + 2048  # + the reduction scratch


def plan_for(q_lat, q_pe, c_kv, k_pe, page_indices, k_type) -> Plan | str:
    """The call's Plan, or why the kernel does not take these shapes."""
    t, n, dk = q_pe.shape
    lat = q_lat is not None
    groups = 1 if lat else c_kv.shape[2]
    dv, page_size = c_kv.shape[-1], c_kv.shape[1]
    if dv % 64 or dk % 64:
        return f"band widths {dv}, {dk} are not multiples of 64"
    if page_size < 8 or BK % page_size:
        return f"page_size {page_size} does not divide {BK} in pages of at least 8 slots"
    if n % groups:
        return f"{n} heads do not split into {groups} KV groups"
    heads = n // groups
    k_terms = TERMS if k_type == jnp.dtype(_F32) else 1
    b, w = page_indices.shape
    for qc in QC_SIZES:
        if qc * dv > ACC_VALUES:
            continue
        hb = min(heads, qc)
        if heads % hb == 0 and qc % hb == 0:
            tokens = qc // hb
            items = -(-t // tokens) + b
            head_blocks = groups * heads // hb
            blocks = -(-w * page_size // BK)
            splits = max(1, min(blocks, PROGRAMS // max(1, head_blocks * items)))
            plan = Plan(groups, hb, head_blocks, tokens, qc, items, splits, k_terms, lat)
            if _smem_bytes(plan, dv if lat else 0, dk, dv) <= SMEM_BYTES:
                return plan
    return f"no block of query columns fits {heads} heads of widths {dv}, {dk} in shared memory"


def unsupported(q_lat, q_pe, c_kv, k_pe, page_indices, kv_type, k_type) -> str | None:
    """None when the kernel takes these arrays (see the module docstring), else why not."""
    if jnp.dtype(kv_type) != jnp.dtype(_BF16):
        return f"the moved band holds {jnp.dtype(kv_type).name}, not bfloat16"
    if jnp.dtype(k_type) not in (jnp.dtype(_F32), jnp.dtype(_BF16)):
        return f"the rotated band holds {jnp.dtype(k_type).name}"
    plan = plan_for(q_lat, q_pe, c_kv, k_pe, page_indices, jnp.dtype(k_type))
    return plan if isinstance(plan, str) else None


def split3(x):
    """fp32 -> three bf16 terms whose sum is x to fp32's precision (hi, mid, lo), by rounding
    conversions: in the kernel (Mosaic GPU keeps every conversion)."""
    hi = x.astype(_BF16)
    rest = x - hi.astype(_F32)
    mid = rest.astype(_BF16)
    return hi, mid, (rest - mid.astype(_F32)).astype(_BF16)


def split3_bits(x):
    """split3 for XLA: each term cut off by masking the fp32 bits (hi: the top 8 bits of the
    mantissa; mid: the next 8; lo: the rest), so every term is exact in bf16 and no conversion
    pair can be elided. XLA:GPU may treat f32 -> bf16 -> f32 as the identity (excess precision
    allowed): with `split3` there, Q's mid and lo terms came out 0 and outputs bf16-accurate
    (3e-3) when the dispatch was jitted on an H200."""
    x = x.astype(_F32)

    def top(v):
        bits = jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000)
        return jax.lax.bitcast_convert_type(bits, _F32)

    hi = top(x)
    mid = top(x - hi)
    return hi.astype(_BF16), mid.astype(_BF16), (x - hi - mid).astype(_BF16)


class Items(NamedTuple):
    """Per token item (i32[items]): its row, its first query's position, its queries, the row's
    kv_lens, and its first query's index in T."""

    row: jax.Array
    first: jax.Array
    ntok: jax.Array
    kv_len: jax.Array
    t0: jax.Array


def token_items(kv_lens, cu_q_lens, num_rows, plan: Plan) -> Items:
    """Each row's queries cut into items of `plan.tokens` tokens, rows in order."""
    b = kv_lens.shape[0]
    q_lens = jnp.where(jnp.arange(b) < num_rows[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    counts = -(-q_lens // plan.tokens)
    ends = jnp.cumsum(counts)
    i = jnp.arange(plan.items, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(ends, i, side="right"), b - 1).astype(jnp.int32)
    j0 = (i - (ends - counts)[row]) * plan.tokens
    valid = i < ends[-1]
    ntok = jnp.where(valid, jnp.clip(q_lens[row] - j0, 0, plan.tokens), 0)
    first = kv_lens[row] - q_lens[row] + j0
    t0 = cu_q_lens[row] + j0
    return Items(row, first, ntok, kv_lens[row], t0)


def columns(q, items: Items, plan: Plan, scale: float):
    """q [T, N, D] -> three bf16 terms of scale * q per program's columns:
    [head_blocks, items, 3, qc, D] (columns token-major; padding columns 0)."""
    t, n, d = q.shape
    tok = items.t0[:, None] + jnp.arange(plan.tokens)  # [items, tokens]
    live = jnp.arange(plan.tokens) < items.ntok[:, None]
    x = jnp.where(live[..., None, None], q.astype(_F32)[jnp.where(live, tok, 0)] * scale, 0.0)
    x = x.reshape(plan.items, plan.tokens, plan.head_blocks, plan.hb, d)
    x = x.transpose(2, 0, 1, 3, 4).reshape(plan.head_blocks, plan.items, plan.qc, d)
    return jnp.stack(split3_bits(x), axis=2)


def merge(o, lse, items: Items, plan: Plan, t: int, n: int):
    """The splits' partial results -> f32[T, N, Dv] (queries no item holds: 0)."""
    w = jnp.exp(lse - lse.max(axis=2, keepdims=True))  # [hbk, items, splits, qc]
    out = (o * w[:, :, :, None, :]).sum(axis=2) / w.sum(axis=2)[:, :, None, :]  # [hbk, it, Dv, qc]
    dv = o.shape[3]
    out = out.reshape(plan.head_blocks, plan.items, dv, plan.tokens, plan.hb)
    out = out.transpose(1, 3, 0, 4, 2).reshape(plan.items, plan.tokens, n, dv)
    tok = items.t0[:, None] + jnp.arange(plan.tokens)
    tok = jnp.where(jnp.arange(plan.tokens) < items.ntok[:, None], tok, t)  # dropped
    return jnp.zeros((t, n, dv), _F32).at[tok].set(out, mode="drop")
