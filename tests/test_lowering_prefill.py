"""The lowering gate for prefill in the expanded form (`pallas_kernels.expanded_attention`;
tests/test_lowering_engine.py gates the engine's programs at large): a layer step at the
largest token bucket of a default engine state (1024 tokens, 64 rows, 4096 pages of 16),
exported here for CUDA and for TPU at DeepSeek-V2-Lite's and DeepSeek-V3's shapes (16 and 128
heads) with abstract params,

- holds the platform's flash attention call for every tile size the cost model gives
  (`leyline_jax.mla.expanded_tiles`): tokamax's Mosaic GPU kernel (a `mosaic_gpu` custom call)
  on CUDA, jax's splash attention (a `tpu_custom_call`) on TPU, each recognised by its operands
  (a tile of E queries and a chunk of C keys, [E, N, Dk] and [C, N, Dk]; head-major on TPU),
  twice per size (the chunk holding the diagonal, the chunks before it), beside the absorbed
  kernel's call for the rest of the rows;
- holds no array of scores larger than one tile's: the MLIR's tensor types are parsed and none
  may have an axis of a query count (the step's tokens, a tile size) and another of a slot count
  (a chunk, a row's page-table slots) with more elements than N x the largest tile x one kernel
  block of slots (`KERNEL_BLOCK`).

Shapes are told apart by size, so the slot counts must be sizes no other axis has: the gate
sets the module's chunk to 8192 slots (the program is the same at any chunk) and asserts that
the slot counts are none of the inputs' axes and no query count; a tile size that equals a
model width (V2-Lite's 128 = Dn = Dv) is not counted as a query axis (asserted for the step's
tokens and largest tile).

The checks are shown to fail: a decode step (one token) holds no flash call; a program that
materialises T x S scores (the expanded form dense over a row's slots), and the path with the
jnp call in place of the kernel ([N, E, C] scores per chunk), are caught by the scores check.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

from leyline_jax import mla, paged
from pallas_kernels import expanded_attention as ea
from tests.test_lowering_engine import MAX_SEQS, PAGE, PAGES, abstract, buckets, exported, i32

SDS = jax.ShapeDtypeStruct
CALLS = {"cuda": "mosaic_gpu", "tpu": "tpu_custom_call"}
CHUNK = 8192  # slots per chunk in these programs: a size no other axis has
TENSOR = re.compile(r"tensor<((?:\d+x)*)[a-z]\w*>")


def shapes(text: str) -> list[tuple[int, ...]]:
    """Every tensor type's shape in `text`, in order (scalars: ())."""
    return [tuple(int(d) for d in m.group(1).split("x")[:-1]) for m in TENSOR.finditer(text)]


def custom_calls(text: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(target, operand shapes) of every custom call in an exported module's text."""
    calls = []
    for line in text.splitlines():
        if (m := re.search(r"stablehlo\.custom_call @(\w+)", line)) is None:
            continue
        signature = line[line.rindex(" : (") + 4 :]  # after the backend config's bytes
        calls.append((m.group(1), shapes(signature[: signature.index(") -> ")])))
    return calls


def flash_calls(text, platform, e, n, dk) -> int:
    """The calls of the platform's flash attention on a tile of `e` queries and a chunk of keys."""
    q, k = ((e, n, dk), (CHUNK, n, dk)) if platform == "cuda" else ((n, e, dk), (n, CHUNK, dk))
    return sum(
        t.startswith(CALLS[platform]) and q in ops and k in ops for t, ops in custom_calls(text)
    )


def scores_arrays(text, queries, slots, budget) -> set[tuple[int, ...]]:
    """The tensor shapes in `text` with an axis of a size in `queries` and another of a size in
    `slots`, of more than `budget` elements."""
    bad = set()
    for dims in shapes(text):
        q_axes = [i for i, d in enumerate(dims) if d in queries]
        s_axes = [i for i, d in enumerate(dims) if d in slots]
        if any(a != b for a in q_axes for b in s_axes) and math.prod(dims) > budget:
            bad.add(dims)
    return bad


@pytest.fixture(autouse=True)
def chunk(monkeypatch):
    monkeypatch.setattr(ea, "CHUNK", CHUNK)


def step(name, t):
    """(config, the first (dense) layer's step arguments at `t` tokens, the axis sizes of its
    params, pools, rows, page-table width and hidden state: every input axis but the tokens)."""
    config, split, one = abstract(name)
    b = min(t, MAX_SEQS)
    h = SDS((t, config.hidden_size), jnp.bfloat16)
    meta = (i32(b), i32(b, PAGES), i32(b + 1), i32(1))
    args = (*split.layers[0], one, h, i32(b), i32(b), i32(t), i32(t), meta)
    widths = {d for leaf in jax.tree.leaves(args[1:3]) for d in leaf.shape}  # params, pools
    return config, args, widths | {b, PAGES, config.hidden_size}


def sizes(config, t, platform, axes):
    """(tiles, query counts, slot counts, one tile's scores budget) of a step, checked to be
    told apart from each other and from the inputs' axes."""
    tiles = mla.expanded_tiles(t, config, platform=platform)
    queries = {t, *tiles} - axes
    slots = {CHUNK, PAGES * PAGE}
    assert ea.default_chunk(tiles, PAGES * PAGE) == CHUNK
    assert {t, max(tiles, default=t)} <= queries and not slots & (axes | queries), (axes, tiles)
    return tiles, queries, slots, config.num_attention_heads * max(tiles) * ea.KERNEL_BLOCK


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_the_prefill_step_lowers_with_the_flash_attention(name, platform):
    t = buckets()[-1]
    config, args, axes = step(name, t)
    tiles, queries, slots, budget = sizes(config, t, platform, axes)
    assert len(tiles) == 3  # V2-Lite (1024, 256, 128), V3 (1024, 512, 256)
    text = exported(paged.layer_step, args, platform)
    n, dk = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
    for e in tiles:
        assert flash_calls(text, platform, e, n, dk) == 2, e
    calls = [c for c, _ in custom_calls(text) if c.startswith(CALLS[platform])]
    assert len(calls) > 2 * len(tiles)  # and the absorbed kernel's
    assert not scores_arrays(text, queries, slots, budget)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_decode_step_holds_no_flash_call(platform):
    """One token: the cost model gives no tile, the step holds the absorbed kernel alone."""
    config, args, _ = step("v2-lite", 1)
    assert mla.expanded_tiles(1, config, platform=platform) == ()
    text = exported(paged.layer_step, args, platform)
    n, dk = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
    assert not any(flash_calls(text, platform, e, n, dk) for e in (128, 256, 1024))
    assert any(c.startswith(CALLS[platform]) for c, _ in custom_calls(text))


def test_the_scores_check_catches_materialised_scores(monkeypatch):
    """The expanded form dense over one row's slots ([N, T, S] scores), and the path with the
    jnp call in place of the kernel ([N, E, C] per chunk): both caught."""
    t = buckets()[-1]
    config, args, axes = step("v2-lite", t)
    tiles, queries, slots, budget = sizes(config, t, "cuda", axes)
    n, dn, dr, dv, r = 16, 128, 64, 128, 512
    s = PAGES * PAGE

    def dense(q_nope, q_pe, c_kv, k_pe, w_kb, w_vb, row_pages):
        slot = jnp.arange(s)
        page, offset = row_pages[slot // PAGE], slot % PAGE
        c = jax.lax.bitcast_convert_type(c_kv[page, offset], jnp.bfloat16)
        k = k_pe[page, offset]
        mask = slot[None, :] <= jnp.arange(t)[:, None] + (s - t)
        return mla.mla_attention(q_nope, q_pe, c, k, w_kb, w_vb, mask, 0.1)

    bf16 = jnp.bfloat16
    inputs = (
        SDS((t, n, dn), bf16), SDS((t, n, dr), jnp.float32), SDS((PAGES, PAGE, r), jnp.uint16),
        SDS((PAGES, PAGE, dr), jnp.float32), SDS((n, dn, r), bf16), SDS((n, r, dv), bf16),
        i32(PAGES),
    )  # fmt: skip
    text = jax.export.export(jax.jit(dense), platforms=["cuda"])(*inputs).mlir_module()
    assert (n, t, s) in scores_arrays(text, queries, slots, budget)

    monkeypatch.setitem(ea.PLATFORM_ATTEND, "cuda", "xla")
    text = exported(paged.layer_step, args, "cuda")
    assert (n, max(tiles), CHUNK) in scores_arrays(text, queries, slots, budget)


def test_a_kernel_that_does_not_trace_leaves_the_step_absorbed(monkeypatch):
    """tokamax breaking on a jax it was not written for (here: raising when traced) is refused
    by `unsupported`, and the CUDA step lowers with the absorbed kernel alone."""

    def broken(*args, **kw):
        raise AttributeError("module 'jax.experimental.pallas.mosaic_gpu' has no attribute ...")

    monkeypatch.setitem(ea.ATTENDS, "tokamax", broken)
    config, args, _ = step("v2-lite", buckets()[-1])
    why = ea.unsupported("tokamax", tiles=(1024,), chunk=CHUNK, heads=16, dk=192, dv=128)
    assert "does not trace" in why
    text = exported(paged.layer_step, args, "cuda")
    assert not any(flash_calls(text, "cuda", e, 16, 192) for e in (128, 256, 1024))
    assert any(c.startswith(CALLS["cuda"]) for c, _ in custom_calls(text))
