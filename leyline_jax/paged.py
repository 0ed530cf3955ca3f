"""Paged prefill and decode over `PagedKVState`, and the checked public state operations.

Each public function validates on the host first (the bookkeeping is host data: no device
read), so a bad call raises before anything changes; then the host plans the step (pages,
slots, copy-on-write pairs), pads it to a bucketed shape and runs the step, which donates the
pools. Donation means the state passed in is consumed: keep using the returned one.

The step runs layer by layer (`leyline_jax.model.Split`): the embedding's program, one program
per layer on that layer's pages (layers of one kind share one compiled program, so a step
shape costs the same to compile at 8, 30 or 60 layers), the logits'; a model of at most
`model.FUSED_LAYERS` layers runs as one program. Why not a scan over stacked layers, and the
measurements: BENCHMARKS.md, "Startup".

The step is ragged: prefill chunks, decode tokens and directive fills of many sequences are one
flattened batch of new tokens with per-row metadata (query offsets `cu_q_lens`, KV lengths,
page-table rows), and attention (`pallas_kernels.ragged_paged_attention`) touches only each
row's real pages, so a step's cost follows the sequences' real lengths. Compiled shapes depend
on the bucket of total new tokens only (`step_shapes`; the rows follow from it): the page-table
rows are passed whole. Attention is each family's (`attn.paged`); MLA's is absorbed (queries
multiplied into the latent space, `c_kv` and `k_pe` read in place: `leyline_jax.mla`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import process_allgather

from leyline_jax import allocator, kv_pools
from leyline_jax import kv_state as kv
from leyline_jax import model as models
from leyline_jax.allocator import OutOfPagesError
from leyline_jax.config import check_ids, check_tokens
from leyline_jax.kv_pools import KVPools
from leyline_jax.kv_state import PagedKVState, bucket
from leyline_jax.model import CausalLM, Split

# Token buckets start at 1: a decode of B rows runs bucket(B) tokens, not a minimum bucket (at 16
# a one-row decode of the bench config ran 16 tokens of matmuls and took twice as long)
MIN_TOKEN_BUCKET = 1


def step_shapes(state: PagedKVState) -> list[tuple[int, int]]:
    """Every (tokens, rows) shape a step over `state` can take, smallest first: the token
    buckets (powers of the state's `bucket_growth` up to its `max_step_tokens`, the last) and, for
    each, its rows: as many as its tokens, up to bucket(max_seqs). A step's shape follows
    from its token count alone, so this list is the whole set a server compiles."""
    return [(t, _row_bucket(state, t)) for t in state.ladder(state.max_step_tokens)]


def _row_bucket(state: PagedKVState, tokens: int) -> int:
    """The rows a step of `tokens` (a bucket) pads to: a step of n rows carries at least n
    tokens, so this is never short, and only the token count picks a shape. The price: up to
    bucket(max_seqs) rows of logits for a step of fewer (a prefill chunk of one row)."""
    return min(tokens, bucket(state.max_seqs))


# ---- the model over a paged cache: one program per kind of layer, or one in all ------------
def _layer_body(layer, pools, h, cow_src, cow_dst, positions, slots, meta):
    """One decoder layer over a flattened batch of new tokens (`pools`: that layer's pages
    alone). Copy shared pages first (`cow_src` -> `cow_dst`, i32[K]; P drops), then the layer's
    `attn.paged` writes the new tokens' KV to `slots` (padding P*page_size writes nothing) and
    every row attends through its own pages to its own slots only (`meta`: kv_lens i32[B],
    page_indices i32[B, W], cu_q_lens i32[B+1], num_rows i32[1]); then the feed forward.
    Returns h [T, H] after the layer and the layer's pools."""
    pools = kv_pools.copy_pages(pools, cow_src, cow_dst)
    out, pools = layer.attn.paged(layer.input_norm(h), positions, pools, 0, slots, meta)
    return layer.feed_forward(h + out), pools


@functools.partial(jax.jit, static_argnums=0, donate_argnames="pools")
def layer_step(graph, params, pools, h, *args):
    """`_layer_body` of one layer as its own program (donates its pools)."""
    return _layer_body(models.merge(graph, params), pools, h, *args)


@functools.partial(jax.jit, static_argnums=0)
def last_logits(graph, params, h, last):
    """float32 logits [B, vocab] after token `last[b]` (a flat index) of each row."""
    ends = models.merge(graph, params)
    return ends.logits(ends.final_norm(h[last]))


@functools.partial(jax.jit, static_argnums=0, donate_argnames="pools")
def _whole_step(graphs, params, pools, cow_src, cow_dst, tokens, positions, slots, meta, last):
    """The whole step as one program (`Split.fused`): embed, every layer, the logits."""
    ends, layers = models.merge_whole(graphs, params)
    h, moved, rotated = ends.embed_tokens(tokens), [], []
    for i, layer in enumerate(layers):
        h, one = _layer_body(layer, pools.layer(i), h, cow_src, cow_dst, positions, slots, meta)
        moved.append(one.moved[0])
        rotated.append(one.rotated[0])
    return pools.with_bands(moved, rotated), ends.logits(ends.final_norm(h[last]))


def _step(graph: Split, pools: KVPools, cow_src, cow_dst, tokens, positions, slots, meta, last):
    """The device step: one program for a shallow model, else layer by layer (embed, each
    layer's program on its own pages, donated one layer at a time, logits). Returns the pools
    and float32 logits [B, vocab]."""
    if graph.fused:
        return _whole_step(
            *graph.whole, pools, cow_src, cow_dst, tokens, positions, slots, meta, last
        )
    h = graph.embed(tokens)
    moved, rotated = [], []
    for i, layer in enumerate(graph.layers):
        one = pools.layer(i)
        h, one = layer_step(*layer, one, h, cow_src, cow_dst, positions, slots, meta)
        moved.append(one.moved[0])
        rotated.append(one.rotated[0])
    return pools.with_bands(moved, rotated), graph.run(last_logits, h, last)


_read_pages = jax.jit(kv_pools.read_pages)
_write_pages = jax.jit(kv_pools.write_pages, donate_argnums=0)
# `read_pages` / `load_pages` move pages in blocks of at most this many (each bucketed)
PAGE_BLOCK = 256


# ---- host planning --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rows:
    """A step's rows flattened, bucketed and padded (host arrays): what `_step` runs. Shapes
    depend on the token and row buckets only, never on how long the sequences are."""

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slots: np.ndarray  # i32[T]; padding = P * page_size (dropped)
    kv_lens: np.ndarray  # i32[B]; padding rows 0
    page_indices: np.ndarray  # i32[B, max_pages]
    cu_q_lens: np.ndarray  # i32[B + 1]
    num_rows: np.ndarray  # i32[1]
    last: np.ndarray  # i32[B] flat index of each row's last token
    cow_src: np.ndarray  # i32[B] pages to copy first (padding: P)
    cow_dst: np.ndarray  # i32[B]


def _padding(state: PagedKVState, b: int, t: int) -> Rows:
    """`b` rows of `t` tokens that are all padding: no row, every slot dropped."""
    p, ps = state.num_pages, state.page_size
    return Rows(
        tokens=np.zeros(t, np.int32),
        positions=np.zeros(t, np.int32),
        slots=np.full(t, p * ps, np.int32),
        kv_lens=np.zeros(b, np.int32),
        page_indices=np.full((b, state.max_pages_per_seq), p, np.int32),
        cu_q_lens=np.zeros(b + 1, np.int32),
        num_rows=np.zeros(1, np.int32),
        last=np.zeros(b, np.int32),
        cow_src=np.full(b, p, np.int32),
        cow_dst=np.full(b, p, np.int32),
    )


def _rows(state: PagedKVState, seqs, blocks, starts, slots, cow=((), ())) -> Rows:
    """Rows running blocks[i] at positions starts[i].. of seqs[i], whose KV goes to slots[i]
    (pages already in `state`'s table), flattened in row order; `cow`: (pages, their copies)
    the step copies first."""
    n, counts = len(seqs), np.array([len(x) for x in blocks], np.int32)
    t = state.bucket(int(counts.sum()), MIN_TOKEN_BUCKET, state.max_step_tokens)
    rows = _padding(state, _row_bucket(state, t), t)
    cu = rows.cu_q_lens
    cu[1 : n + 1] = np.cumsum(counts)
    cu[n + 1 :] = cu[n]
    rows.num_rows[0] = n
    rows.last[:n] = cu[1 : n + 1] - 1
    rows.cow_src[: len(cow[0])] = cow[0]
    rows.cow_dst[: len(cow[1])] = cow[1]
    for i, (q, x, a, sl) in enumerate(zip(seqs, blocks, starts, slots, strict=True)):
        lo, hi = cu[i], cu[i + 1]
        rows.tokens[lo:hi] = x
        rows.positions[lo:hi] = a + np.arange(len(x))
        rows.slots[lo:hi] = sl
        rows.kv_lens[i] = a + len(x)
        rows.page_indices[i] = state.page_table[q]
    return rows


def _run(model, state: PagedKVState, rows: Rows, graph: Split | None = None):
    graph = Split.of(model) if graph is None else graph
    device = {k: jnp.asarray(v) for k, v in dataclasses.asdict(rows).items()}
    meta = tuple(device[k] for k in ("kv_lens", "page_indices", "cu_q_lens", "num_rows"))
    args = (device[k] for k in ("cow_src", "cow_dst", "tokens", "positions", "slots"))
    pools, logits = _step(graph, state.pools, *args, meta, device["last"])
    return state.replace(pools=pools), logits


def _append(model, state: PagedKVState, seqs, blocks, graph=None):
    """Append blocks[i] to open, distinct seqs[i] (checked) and run them in one step of at
    most the state's `max_step_tokens` (checked here, before anything changes)."""
    if (n := sum(map(len, blocks))) > state.max_step_tokens:
        raise ValueError(
            f"{n} tokens in one step; the state's max_step_tokens is {state.max_step_tokens}"
        )
    starts = [int(state.lengths[q]) for q in seqs]
    state, plan = allocator.append(state, seqs, blocks)
    rows = _rows(state, seqs, blocks, starts, plan.slots, cow=(plan.cow_src, plan.cow_dst))
    return _run(model, state, rows, graph)


def fill(model, state: PagedKVState, seq: int, start: int, tokens, graph=None, cow=None):
    """Run `tokens` at positions start.. of open `seq`, whose slots its page table already
    holds (a directive's replacement after a splice, FORGET's re-prefill), in chunks of the
    state's `max_step_tokens`; each attends to the slots before it. `cow`: (page, its copy)
    to copy first. Returns the state. Checked by the caller (`leyline_jax.allocator.plan_edit`
    placed the slots)."""
    ps, most = state.page_size, state.max_step_tokens
    for a in range(0, len(tokens), most):
        chunk = tokens[a : a + most]
        pos = start + a + np.arange(len(chunk))
        slots = state.page_table[seq, pos // ps] * ps + pos % ps
        pair = ([cow[0]], [cow[1]]) if cow is not None and a == 0 else ((), ())
        rows = _rows(state, [seq], [chunk], [start + a], [slots], cow=pair)
        state, _ = _run(model, state, rows, graph)
    return state


def refill(model, state: PagedKVState, seq: int, runs, graph=None) -> PagedKVState:
    """Run `seq`'s own tokens at each [a, b) of `runs` (sorted, disjoint) again, writing their
    slots, each attending to the slots before it: a recompute (`leyline_jax.recompute`). Runs
    go a row each, as many rows and tokens a step as the state's shapes take (a long run is
    cut); a row attends to the KV the runs before it wrote, in the same step or an earlier
    one, as a prefill of the chosen tokens would. Every page written must be the sequence's
    alone (checked: raises ValueError before anything changes). Returns the state."""
    ps, most = state.page_size, state.max_step_tokens
    rows_max = _row_bucket(state, most)
    pieces = [(a, min(a + most, b)) for a0, b in runs for a in range(a0, b, most)]
    pages = {int(x) for a, b in pieces for x in state.page_table[seq, a // ps : (b - 1) // ps + 1]}
    if any(state.refcount[p] != 1 for p in pages):
        raise ValueError(f"a recompute of sequence {seq} would write a page it shares")
    graph = Split.of(model) if graph is None else graph
    tokens, step = state.token_ids[seq], []
    for i, (a, b) in enumerate(pieces):
        step.append((a, b))
        after = pieces[i + 1] if i + 1 < len(pieces) else None
        full = after is None or len(step) == rows_max
        if not full and sum(y - x for x, y in step) + after[1] - after[0] > most:
            full = True
        if full:
            pos = [np.arange(x, y) for x, y in step]
            slots = [state.page_table[seq, p // ps] * ps + p % ps for p in pos]
            blocks = [np.asarray(tokens[x:y]) for x, y in step]
            rows = _rows(state, [seq] * len(step), blocks, [x for x, _ in step], slots)
            state, _ = _run(model, state, rows, graph)
            step = []
    return state


def first_layer(model, state: PagedKVState, seq: int, start: int, stop: int, graph=None):
    """Layer 0 of `seq`'s own tokens [start, stop) run again (at most `max_step_tokens`), each
    attending to the slots up to its own, with nothing written (every slot dropped): the
    ragged step's embedding and layer 0 alone. Returns (state, h [T, H] after layer 0, the
    tokens' positions i32[T], their slots i32[T]); T is the step's bucket, rows past
    stop - start are padding (their positions repeat `start`). Checked by the caller."""
    ps, p = state.page_size, state.num_pages
    pos = np.arange(start, stop)
    rows = _rows(
        state, [seq], [state.token_ids[seq][start:stop]], [start], [np.full(len(pos), p * ps)]
    )
    t = len(rows.tokens)
    positions = np.full(t, start, np.int32)
    positions[: len(pos)] = pos
    slots = state.page_table[seq, positions // ps] * ps + positions % ps
    graph = Split.of(model) if graph is None else graph
    device = {k: jnp.asarray(v) for k, v in dataclasses.asdict(rows).items()}
    meta = tuple(device[k] for k in ("kv_lens", "page_indices", "cu_q_lens", "num_rows"))
    args = (device[k] for k in ("cow_src", "cow_dst", "positions", "slots"))
    h = graph.embed(device["tokens"])
    h, one = layer_step(*graph.layers[0], state.pools.layer(0), h, *args, meta)
    pools = state.pools
    moved, rotated = (one.moved[0], *pools.moved[1:]), (one.rotated[0], *pools.rotated[1:])
    return state.replace(pools=pools.with_bands(moved, rotated)), h, positions, slots


def precompile(model: CausalLM, state: PagedKVState, shape: tuple[int, int], graph=None):
    """Compile (and run once) the step of `shape` (tokens, rows: one of `step_shapes`) and
    return the state. The run is all padding (no row, every slot dropped): the pools come back
    unchanged."""
    tokens, rows = shape
    return _run(model, state, _padding(state, rows, tokens), graph)[0]


# ---- public API -----------------------------------------------------------------------------
def prefill(
    model: CausalLM, state: PagedKVState, seq: int, tokens
) -> tuple[PagedKVState, jax.Array]:
    """Append `tokens` to sequence `seq` (opening it if it is not open) and run them through the
    model. Returns the new state and float32 logits [vocab] after the last appended token.

    Works for a new sequence (prefill) and a cached one (chunked prefill / extend). Raises
    `ValueError` for bad tokens, `SequenceError` for a bad sequence id or an overlong sequence,
    `OutOfPagesError` when the pool is short — all before the state changes. Donates `state`.
    """
    toks = check_tokens(tokens, model.config.vocab_size)
    seq = allocator.check_seq(state, seq)
    is_new = not state.active[seq]
    length = 0 if is_new else int(state.lengths[seq])
    n = len(toks)
    allocator.check_room(state, seq, length, n)
    need = allocator.append_pages(state, seq, n)  # a sequence not open holds no token
    free = len(allocator.free_pages(state))
    if need > free:
        raise OutOfPagesError(
            f"prefill of {n} tokens on sequence {seq} needs {need} pages; "
            f"{free} of {state.num_pages} are free"
        )
    if is_new:
        state = allocator.open_seq(state, seq)
    graph, most = Split.of(model), state.max_step_tokens
    for a in range(0, n, most):
        state, logits = _append(model, state, [seq], [toks[a : a + most]], graph)
    return state, logits[0]


def extend(
    model: CausalLM,
    state: PagedKVState,
    seqs: Sequence[int],
    tokens: Sequence[Sequence[int]],
    *,
    graph=None,
    padded: bool = False,
) -> tuple[PagedKVState, jax.Array]:
    """Append a block of tokens to each of several open sequences in one batched step (the
    prefill half of continuous batching). Blocks may differ in length; together they are at
    most the state's `max_step_tokens` tokens. Returns the new state and float32 logits
    [len(seqs), vocab] after each block's last token. Raises like `decode`, before the state
    changes. Donates `state`. `graph`: `Split.of(model)` made once by a caller that steps
    often (saves the split). `padded`: return the step's logits as they are, [rows of the
    step's shape, vocab] (rows past len(seqs) are padding), so a caller that samples on device
    meets no shape-dependent slice."""
    seqs = list(seqs)
    blocks = [check_tokens(t, model.config.vocab_size) for t in tokens]
    if len(seqs) != len(blocks) or not seqs:
        raise ValueError(f"{len(seqs)} sequences but {len(blocks)} token blocks")
    if any(len(b) == 0 for b in blocks):
        raise ValueError("each block needs at least one token")
    allocator.check_appends(state, seqs, [len(b) for b in blocks])
    state, logits = _append(model, state, seqs, blocks, graph)
    return state, logits if padded else logits[: len(seqs)]


def decode(
    model: CausalLM, state: PagedKVState, seqs: Sequence[int], tokens: Sequence[int], *, graph=None
) -> tuple[PagedKVState, jax.Array]:
    """Append one token to each of several open sequences in one batched step.

    Returns the new state and float32 logits [len(seqs), vocab]. Sequences must be distinct and
    open. Raises like `prefill`, before the state changes. Donates `state`. `graph`: as `extend`.
    """
    seqs = list(seqs)
    toks = check_tokens(tokens, model.config.vocab_size)
    if len(seqs) != len(toks):
        raise ValueError(f"{len(seqs)} sequences but {len(toks)} tokens")
    allocator.check_appends(state, seqs, [1] * len(seqs))
    state, logits = _append(model, state, seqs, [toks[i : i + 1] for i in range(len(seqs))], graph)
    return state, logits[: len(seqs)]


def read_pages(state: PagedKVState, ids) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of whole pages (ids in [0, num_pages), any order, repeats allowed): every
    layer's (moved [L, K, page_size, *moved_shape], rotated [L, K, page_size, *rotated_shape])
    in the storage dtypes, so a 16-bit band comes back as its raw bits (uint16) and
    `load_pages` puts it back bit-exact. The state is not donated; this reads the device (what
    a snapshot of the pools needs), in blocks of `PAGE_BLOCK` pages, each bucketed. Pools
    spread over several processes (`serve.multihost`) are gathered from every one: each
    process calls this with the same ids at the same point (a collective)."""
    p = check_ids(ids, state.num_pages, "page id", allow_empty=True)
    shapes = [(a.shape[1:], a.dtype) for a in (state.pools.moved[0], state.pools.rotated[0])]
    parts: tuple[list, list] = ([], [])
    for a in range(0, len(p), PAGE_BLOCK):
        block = p[a : a + PAGE_BLOCK]
        got = _read_pages(state.pools, kv.padded(block, state.bucket(len(block), 1, PAGE_BLOCK), 0))
        with jax.transfer_guard_device_to_host("allow"):  # the read this function is for
            for part, band in zip(parts, got, strict=True):
                part.append(_host(band)[:, : len(block)])
    return tuple(
        np.concatenate(part, axis=1) if part else np.zeros((state.num_layers, 0, *shape), dtype)
        for part, (shape, dtype) in zip(parts, shapes, strict=True)
    )


def _host(a: jax.Array) -> np.ndarray:
    """`a` whole on the host, gathered from every process when its shards span several."""
    return np.asarray(a if a.is_fully_addressable else process_allgather(a, tiled=True))


def _pages_block(arr: np.ndarray, start: int, n: int, size: int, pool: jax.Array) -> jax.Array:
    """arr[:, start : start + n] ([L, K, ...] host pages) padded with zeros to `size` pages;
    replicated over `pool`'s mesh from each process's own (equal) copy when it spans several."""
    out = np.zeros((arr.shape[0], size, *arr.shape[2:]), arr.dtype)
    out[:, :n] = arr[:, start : start + n]
    if pool.is_fully_addressable:
        return jnp.asarray(out)
    replicated = jax.sharding.NamedSharding(pool.sharding.mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_callback(out.shape, replicated, lambda index: out[index])


def load_pages(
    state: PagedKVState, moved: np.ndarray, rotated: np.ndarray
) -> tuple[PagedKVState, np.ndarray]:
    """Write K host pages (`read_pages`' arrays: moved [L, K, page_size, *moved_shape] and
    rotated [L, K, page_size, *rotated_shape], in the storage dtypes) into the K lowest free
    pages, bit-exact. Returns the state and i32[K] the pages written, each holding one
    reference taken like `retain`'s: open sequences on them (`adopt`) or hand them to a prefix
    cache, then drop it with `release`. Raises ValueError for arrays whose shapes or dtypes are
    not the pools', OutOfPagesError when fewer than K pages are free, before anything changes.
    Donates `state`."""
    moved, rotated = np.asarray(moved), np.asarray(rotated)
    k = moved.shape[1] if moved.ndim > 1 else -1
    bands = (("moved", moved, state.pools.moved), ("rotated", rotated, state.pools.rotated))
    for name, arr, pool in bands:
        want = (state.num_layers, k, *pool[0].shape[1:])
        if arr.shape != want or arr.dtype != pool[0].dtype:
            raise ValueError(
                f"{name} pages of shape {arr.shape} and dtype {arr.dtype} do not fit the pools: "
                f"{want} of {pool[0].dtype} needed (K = the moved band's second dimension)"
            )
    free = allocator.free_pages(state)
    if k > len(free):
        raise OutOfPagesError(
            f"loading {k} pages needs {k} free pages; {len(free)} of {state.num_pages} are free"
        )
    dst_pages = free[:k]
    pools = state.pools
    for a in range(0, k, PAGE_BLOCK):
        n = min(PAGE_BLOCK, k - a)
        b = state.bucket(n, 1, PAGE_BLOCK)
        dst = kv.padded(dst_pages[a : a + n], b, state.num_pages)
        blocks = [_pages_block(arr, a, n, b, pool[0]) for _, arr, pool in bands]
        pools = _write_pages(pools, dst, *blocks)
    state = state.replace(pools=pools)
    return allocator.retain_pages(state, dst_pages), dst_pages.astype(np.int32)


def compile_counts() -> dict[str, int]:
    """How many shapes each jitted step has compiled (for tests and benchmarks)."""
    ends = last_logits._cache_size() + models.compile_counts()["embed"]
    step = layer_step._cache_size() + _whole_step._cache_size()
    return {"step": step, "ends": ends, "zero": kv.compile_counts()["zero"]}


__all__ = [
    "compile_counts",
    "decode",
    "extend",
    "fill",
    "load_pages",
    "prefill",
    "read_pages",
    "step_shapes",
]
