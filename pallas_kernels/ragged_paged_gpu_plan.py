"""The work plan of ragged_paged_attention's GPU kernel (`ragged_paged_attention_gpu`, whose module
docstring describes the kernel): its static shape (`Plan`: query columns per unit, head blocks,
token items, stages, shared memory, programs), which arrays it takes (`unsupported` says why not),
the token items and the query columns made before the call, the split schedule (`split_schedule`:
which program attends which kv blocks of which item) and the combine of the splits after it
(`combine_units`); the bf16 terms of an fp32 operand (`split3` in the kernel, `split3_bits` in
XLA).

The split schedule (FlashMLA's `get_mla_metadata`, in jnp so that it runs inside the caller's
jitted step on the step's metadata). An item's work is the kv blocks its queries see, plus
`OVERHEAD` blocks' worth for what a unit costs besides its blocks (its queries in, the first
block's load that nothing overlaps, its partial result out and combined). The items are laid end
to end on one cost axis, which is cut into `plan.parts` equal spans (at least `2 * OVERHEAD`
each): part p takes [p * cap, (p + 1) * cap), except that a cut inside a short item (one that
fits a span) moves to that item's nearer end. A unit is an item's piece within one part's span,
with its block range [lo, hi): a row no longer than a span is one unit (one split), a long row
several, each part a few units in cost order. Every kv block of every item lies in exactly one
unit. Each head block runs the same schedule (program (head block, part)), so the head blocks of
one part read the same pages at about the same time (MLA's head blocks share them, so all but
the first can find them in L2). The arrays have a fixed length (`plan.units` = items + parts,
the most pieces two sorted cuts make), so a program is compiled once per shape bucket; units past
the last are padding (item = plan.items, no blocks), which no program reads or writes. Computed on
the host instead (numpy, per step), the same arrays can be handed to the kernel
(`schedule=lambda items, plan: host_made`).

The combine: an item's units hold partial attention outputs o_u (each normalised over its own
blocks) and their log-sum-exp l_u; the item's output is sum_u w_u o_u / sum_u w_u with w_u =
exp(l_u - max_u l_u), in jnp (segment sums over the units' items; one item's units are
contiguous).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

BK = 64  # slots per kv block: the M of every wgmma
STAGES = 2  # kv blocks in shared memory at once: the next one's pages arrive during this one's
# matmuls (read when a plan is made: a benchmark may set 1 to measure the overlap)
ACC_VALUES = 8192  # fp32 values of the out^T accumulator (64 registers a thread of a warpgroup)
QC_SIZES = (256, 192, 128, 64, 32, 16)  # query columns of a program: the N of a wgmma, whose
# bf16 rows swizzle whole (a multiple of 128 bytes, or 64 or 32 bytes)
TERMS = 3  # bf16 terms of an fp32 operand (8 + 8 + 8 bits of mantissa)
SMEM_PER_SM = 227 * 1024  # a Hopper's shared memory one program (CTA) may take, and an SM holds
SMEM_RESERVED = 1024  # taken by the CUDA runtime per resident program
SMEM_BYTES = SMEM_PER_SM  # the most one program of this kernel may take (the plan refuses more)
SMEM_ALIGN = 1024  # Mosaic GPU rounds every scoped allocation up to this
REDUCTION_BYTES = 2048  # Mosaic GPU's scratch of a cross-thread reduction
BARRIER_BYTES = 8
NUM_SMS = 132  # SMs of an H100 / H200 (SXM): the programs are sized to fill them once
OVERHEAD = 2  # kv blocks' worth of work a unit costs besides its blocks (module docstring)
_F32, _BF16 = jnp.float32, jnp.bfloat16


class Plan(NamedTuple):
    """The static shape of one call."""

    groups: int  # G: KV heads (1 for MLA)
    hb: int  # heads of a group in one program's columns
    head_blocks: int  # head blocks: G * (N / G) / hb
    tokens: int  # tokens of one row in one unit's columns
    qc: int  # query columns of a unit: hb * tokens
    items: int  # token items (a bound: cdiv(T, tokens) + B)
    k_terms: int  # bf16 terms of the rotated band (3 for fp32, 1 for bf16)
    lat: bool  # MLA: the moved band is also a key (the latent score term)
    stages: int  # kv blocks in shared memory at once (STAGES)
    k_stages: int  # of the rotated band as stored: `stages`, or 1 for fp32 (freed once split)
    smem: int  # bytes of shared memory of one program (Mosaic GPU's count, barriers included)
    per_sm: int  # programs resident on one SM at once (by shared memory)
    parts: int  # persistent programs per head block: num_sms * per_sm // head_blocks (>= 1)
    units: int  # the schedule's length: items + parts (the most pieces two sorted cuts make)

    @property
    def programs(self) -> int:
        """The grid: head_blocks * parts programs, all resident at once."""
        return self.head_blocks * self.parts


def _align(n: int) -> int:
    return -(-n // SMEM_ALIGN) * SMEM_ALIGN


def smem_bytes(
    *, qc: int, lat: bool, dv: int, dk: int, k_bytes: int, k_terms: int, page_size: int, stages: int
) -> int:
    """Shared memory of one program, counted as Mosaic GPU counts it (the kernel's scopes: the
    query terms and the barriers for the program's life; per unit, the kv stages, then the output
    tile in the same bytes; per block, the rotated band's terms, then P's terms in the same
    bytes)."""
    k_stages = 1 if k_terms > 1 else stages
    queries = _align(TERMS * qc * dv * 2) * lat + _align(TERMS * qc * dk * 2)
    block = max(
        _align(k_terms * BK * dk * 2) if k_terms > 1 else 0,
        _align(TERMS * BK * qc * 2),
        REDUCTION_BYTES,
    )
    kv = _align(stages * BK * dv * 2) + _align(k_stages * BK * dk * k_bytes) + block
    out = _align(dv * qc * 4) + _align(BK * qc * 4)
    pages = BK // page_size  # barriers: the queries' two, one per page, stage and band
    barriers = BARRIER_BYTES * (2 + (stages + k_stages) * pages)
    return queries + max(kv, out) + barriers


def plan_for(q_lat, q_pe, c_kv, k_pe, page_indices, k_type, *, num_sms: int = NUM_SMS):
    """The call's Plan, or why the kernel does not take these shapes (a str). The query columns:
    the fewest that hold ceil(T / B) tokens of a row's heads (a decode step: one token), and
    never more than fit the accumulator and shared memory."""
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
    if num_sms < 1:
        return f"num_sms {num_sms} < 1"
    heads = n // groups
    k_terms = TERMS if jnp.dtype(k_type) == jnp.dtype(_F32) else 1
    k_bytes = jnp.dtype(k_type).itemsize
    b, _ = page_indices.shape
    want = heads * -(-t // max(b, 1))  # columns that hold a row's share of the tokens
    sizes = [qc for qc in QC_SIZES if qc * dv <= ACC_VALUES]
    order = sorted(qc for qc in sizes if qc >= want) + [qc for qc in sizes if qc < want]
    for qc in order:
        hb = min(heads, qc)
        if heads % hb or qc % hb:
            continue
        smem = smem_bytes(
            qc=qc,
            lat=lat,
            dv=dv,
            dk=dk,
            k_bytes=k_bytes,
            k_terms=k_terms,
            page_size=page_size,
            stages=STAGES,
        )
        if smem > SMEM_BYTES:
            continue
        tokens = qc // hb
        items = -(-t // tokens) + b
        head_blocks = groups * heads // hb
        per_sm = max(1, SMEM_PER_SM // (smem + SMEM_RESERVED))
        parts = max(1, num_sms * per_sm // head_blocks)
        return Plan(
            groups=groups,
            hb=hb,
            head_blocks=head_blocks,
            tokens=tokens,
            qc=qc,
            items=items,
            k_terms=k_terms,
            lat=lat,
            stages=STAGES,
            k_stages=1 if k_terms > 1 else STAGES,
            smem=smem,
            per_sm=per_sm,
            parts=parts,
            units=items + parts,
        )
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


def _find(sorted_, x, side: str):
    """jnp.searchsorted by comparing every pair: one fused kernel on a GPU for the few hundred
    entries of a step's metadata (the default binary search is a loop of small kernels)."""
    return jnp.searchsorted(sorted_, x, side=side, method="compare_all")


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
    row = jnp.minimum(_find(ends, i, "right"), b - 1).astype(jnp.int32)
    j0 = (i - (ends - counts)[row]) * plan.tokens
    valid = i < ends[-1]
    ntok = jnp.where(valid, jnp.clip(q_lens[row] - j0, 0, plan.tokens), 0)
    first = kv_lens[row] - q_lens[row] + j0
    t0 = cu_q_lens[row] + j0
    return Items(row, first, ntok, kv_lens[row], t0)


def item_blocks(items: Items):
    """i32[items]: the kv blocks an item's queries see (0 for an item without queries)."""
    return jnp.where(items.ntok > 0, (items.first + items.ntok - 1 + BK) // BK, 0)


class Schedule(NamedTuple):
    """The split schedule (module docstring), one for every head block. Units i32[plan.units], in
    part order: the item (plan.items for padding) and its kv blocks [lo, hi). begin
    i32[plan.parts + 1]: part p runs units begin[p] .. begin[p + 1] - 1."""

    item: jax.Array
    lo: jax.Array
    hi: jax.Array
    begin: jax.Array


def split_schedule(items: Items, plan: Plan, *, overhead: int = OVERHEAD) -> Schedule:
    """The split schedule of these items over `plan.parts` parts (module docstring)."""
    n_items, parts = plan.items, plan.parts
    blocks = item_blocks(items)  # i32[items]
    cost = jnp.where(blocks > 0, blocks + overhead, 0)
    start = jnp.cumsum(cost) - cost  # where each item begins on the cost axis
    total = jnp.sum(cost)
    cap = jnp.maximum(-(-total // parts), 2 * overhead)  # one part's span
    bounds = jnp.arange(parts, dtype=start.dtype) * cap  # where each part's span begins
    # a bound inside a short item (cost <= cap) moves to its nearer end: a short row, one unit
    at = jnp.clip(_find(start, bounds, "right") - 1, 0, n_items - 1)
    s0, s1 = start[at], start[at] + cost[at]
    inside = (bounds > s0) & (bounds < s1) & (cost[at] <= cap)
    bounds = jnp.where(inside, jnp.where(bounds - s0 <= s1 - bounds, s0, s1), bounds)
    a = jnp.sort(jnp.concatenate([start, bounds]))  # pieces [a, b) between consecutive cuts
    b = jnp.concatenate([a[1:], total[None]])
    item = jnp.clip(_find(start, a, "right") - 1, 0, n_items - 1)
    base = start[item] + overhead  # where the item's first block sits on the axis
    lo = jnp.clip(a - base, 0, blocks[item])
    hi = jnp.clip(b - base, 0, blocks[item])
    valid = (hi > lo) & (a < total)
    slot = jnp.where(valid, jnp.cumsum(valid) - 1, plan.units)
    part = jnp.where(valid, _find(bounds, a, "right") - 1, parts)

    fill = jnp.array([n_items, 0, 0, parts], jnp.int32)[:, None]  # padding units
    packed = (
        jnp.broadcast_to(fill, (4, plan.units))
        .at[:, slot]
        .set(jnp.stack([item, lo, hi, part]).astype(jnp.int32), mode="drop")
    )  # one scatter: valid pieces first, in order
    begin = _find(packed[3], jnp.arange(parts + 1), "left").astype(jnp.int32)
    return Schedule(packed[0], packed[1], packed[2], begin)


def columns(q, items: Items, plan: Plan, scale: float):
    """q [T, N, D] -> three bf16 terms of scale * q per (head block, item)'s columns, term-major:
    [head_blocks, items, 3 * qc, D] (columns token-major within a term; padding columns 0)."""
    t, n, d = q.shape
    tok = items.t0[:, None] + jnp.arange(plan.tokens)  # [items, tokens]
    live = jnp.arange(plan.tokens) < items.ntok[:, None]
    x = jnp.where(live[..., None, None], q.astype(_F32)[jnp.where(live, tok, 0)] * scale, 0.0)
    x = x.reshape(plan.items, plan.tokens, plan.head_blocks, plan.hb, d)
    x = x.transpose(2, 0, 1, 3, 4).reshape(plan.head_blocks, plan.items, plan.qc, d)
    terms = jnp.stack(split3_bits(x), axis=2)  # [head_blocks, items, 3, qc, D]
    return terms.reshape(plan.head_blocks, plan.items, TERMS * plan.qc, d)


def combine_units(o, lse, schedule: Schedule, plan: Plan):
    """The units' partial results (o f32[head_blocks, U, Dv, qc], each normalised over its own
    blocks; lse f32[head_blocks, U, qc]) -> each (item, head block)'s f32[items, head_blocks,
    Dv, qc]: weights exp(lse - the item's max), normalised. Padding units are never read (no
    program wrote them); an item without units is 0."""
    n_items = plan.items
    valid = schedule.item < n_items
    item = jnp.minimum(schedule.item, n_items - 1)
    o, lse = o.transpose(1, 0, 2, 3), lse.transpose(1, 0, 2)  # units first
    lse = jnp.where(valid[:, None, None], lse, -jnp.inf)
    top = jax.ops.segment_max(lse, item, num_segments=n_items)  # [items, head_blocks, qc]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.where(valid[:, None, None], jnp.exp(lse - top[item]), 0.0)
    o = jnp.where(valid[:, None, None, None], o, 0.0)
    num = jax.ops.segment_sum(o * w[:, :, None, :], item, num_segments=n_items)
    den = jax.ops.segment_sum(w, item, num_segments=n_items)
    return num / jnp.where(den > 0, den, 1.0)[:, :, None, :]


def scatter_items(out, items: Items, plan: Plan, t: int, n: int):
    """f32[items, head_blocks, Dv, qc] -> f32[T, N, Dv] (queries no item holds: 0)."""
    dv = out.shape[2]
    out = out.reshape(plan.items, plan.head_blocks, dv, plan.tokens, plan.hb)
    out = out.transpose(0, 3, 1, 4, 2).reshape(plan.items, plan.tokens, n, dv)
    tok = items.t0[:, None] + jnp.arange(plan.tokens)
    tok = jnp.where(jnp.arange(plan.tokens) < items.ntok[:, None], tok, t)  # dropped
    return jnp.zeros((t, n, dv), _F32).at[tok].set(out, mode="drop")
