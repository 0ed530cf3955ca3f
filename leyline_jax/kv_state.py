"""The functional paged KV state: a pytree, and pure operations on it.

Layout. Per layer, the latent `c_kv` and the rope band `k_pe` of every cached token live in pages
of `page_size` slots, in two separate arrays (a splice rotates `k_pe` only). Token i of sequence
q lives at page `page_table[q, i // page_size]`, offset `i % page_size`. Unused page-table
entries hold `num_pages` ("nowhere"): gathers through them read nothing that is used, scatters
through them are dropped.

Sharing. Pages carry reference counts; a page is free when its count is 0. `fork_seq` shares
every page of a sequence; a page referenced more than once is never written: appending to a
sequence whose partial last page is shared first copies that page (copy on write).

Storage. A 16-bit float band (bf16 `c_kv` by default) is stored as its raw bits (uint16) and
viewed as floats only where rows are read (`decode`): XLA:CPU runs a float-16 scatter by
converting the whole pool to f32 and back (two full-pool passes for every write), and a
bitcast of the pool costs the same; an integer pool is scattered in place. `kv_dtype` /
`k_pe_dtype` on the state say what the stored bits mean.

Every operation here is a pure jnp function `state -> state` (jit-compatible, no host sync).
They assume valid arguments: the public wrappers (`leyline_jax.paged`) check on the host first,
so an error is raised before anything changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from leyline_jax.config import MLAConfig


def storage_dtype(dtype):
    """What a band of `dtype` is stored as: its raw bits for 16-bit floats, else itself."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.uint16)
    return dtype


def encode(x, dtype):
    """Values -> storage: cast to `dtype`, then to its storage bits (bit-exact)."""
    x = x.astype(dtype)
    st = storage_dtype(dtype)
    return x if st == x.dtype else jax.lax.bitcast_convert_type(x, st)


def decode(x, dtype):
    """Storage -> values of `dtype` (bit-exact; apply to gathered rows, not to a pool)."""
    dtype = jnp.dtype(dtype)
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


class OutOfPagesError(RuntimeError):
    """The page pool cannot hold the result. Raised before any state changes."""


class SequenceError(ValueError):
    """A sequence id that is out of range, not open, or already open."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVState:
    c_kv: jax.Array  # [L, P, page_size, R]   latent, storage_dtype(kv_dtype)
    k_pe: jax.Array  # [L, P, page_size, Dr]  rope band (halves layout), storage_dtype(k_pe_dtype)
    page_table: jax.Array  # i32[max_seqs, max_pages]; unused entries = P
    lengths: jax.Array  # i32[max_seqs] tokens cached per sequence
    positions: jax.Array  # i32[max_seqs] position of each sequence's next token
    token_ids: jax.Array  # i32[max_seqs, max_seq_len]
    active: jax.Array  # bool[max_seqs] open sequences
    refcount: jax.Array  # i32[P] references to each page; 0 = free
    page_size: int = dataclasses.field(metadata=dict(static=True))
    kv_dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))  # what c_kv's bits mean
    k_pe_dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))
    vocab_size: int = dataclasses.field(metadata=dict(static=True))  # token ids are < this

    @property
    def num_pages(self) -> int:
        return self.refcount.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    @property
    def max_seq_len(self) -> int:
        """Most tokens one sequence may hold (exact: not rounded to whole pages)."""
        return self.token_ids.shape[1]

    @property
    def num_layers(self) -> int:
        return self.c_kv.shape[0]


def init_state(
    config: MLAConfig,
    *,
    num_pages: int,
    page_size: int,
    max_seqs: int,
    kv_dtype=jnp.bfloat16,
    k_pe_dtype=None,
    max_seq_len: int | None = None,
) -> PagedKVState:
    """An empty pool of `num_pages` pages of `page_size` slots for up to `max_seqs` sequences.

    `kv_dtype` stores `c_kv`; `k_pe_dtype` stores the rope band and defaults to float32 whatever
    `kv_dtype` is: a band rounded to bf16 after every splice drifts like a random walk (relative
    L2 5e-2 after 1000 splices, against 1.7e-3 for a fresh bf16 prefill), while an fp32 band
    stays at the fresh-prefill error however many splices it takes (4e-4 at positions up to
    1e5; `benchmarks/drift_study.py`). The price is ~11% more cache for DeepSeek shapes (a
    token's 512 bf16 + 64 fp32 values against 576 bf16). `max_seq_len` bounds one sequence
    (default: the whole pool, capped by the model's max_position_embeddings; an explicit
    value may go past it: positions the model was not trained for are the caller's choice, as
    with a serving stack's max-model-length override). Raises ValueError naming a bad
    argument.
    """
    for name, v in (("num_pages", num_pages), ("page_size", page_size), ("max_seqs", max_seqs)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    num_pages, page_size, max_seqs = int(num_pages), int(page_size), int(max_seqs)
    limit = config.max_position_embeddings
    if max_seq_len is None:
        max_seq_len = min(num_pages * page_size, limit)
    elif (
        isinstance(max_seq_len, bool)
        or not isinstance(max_seq_len, (int, np.integer))
        or max_seq_len < 1
    ):
        raise ValueError(f"max_seq_len={max_seq_len!r} must be a positive integer")
    max_seq_len = int(max_seq_len)
    max_pages = -(-max_seq_len // page_size)
    kv_dtype = jnp.dtype(kv_dtype)
    k_pe_dtype = jnp.dtype(jnp.float32 if k_pe_dtype is None else k_pe_dtype)
    for name, dt in (("kv_dtype", kv_dtype), ("k_pe_dtype", k_pe_dtype)):
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"{name} must be a floating dtype, got {dt}")
    layers = config.num_hidden_layers
    return PagedKVState(
        c_kv=jnp.zeros(
            (layers, num_pages, page_size, config.kv_lora_rank), storage_dtype(kv_dtype)
        ),
        k_pe=jnp.zeros(
            (layers, num_pages, page_size, config.qk_rope_head_dim), storage_dtype(k_pe_dtype)
        ),
        page_table=jnp.full((max_seqs, max_pages), num_pages, jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
        positions=jnp.zeros((max_seqs,), jnp.int32),
        token_ids=jnp.zeros((max_seqs, max_seq_len), jnp.int32),
        active=jnp.zeros((max_seqs,), bool),
        refcount=jnp.zeros((num_pages,), jnp.int32),
        page_size=page_size,
        kv_dtype=kv_dtype,
        k_pe_dtype=k_pe_dtype,
        vocab_size=config.vocab_size,
    )


# ---- page accounting shared by the host check and the device op ----------------------------
def pages_needed(length, count, last_page_shared, page_size: int):
    """Pages an append of `count` tokens to a sequence of `length` tokens takes from the pool:
    the new pages it grows into, plus one copy of its partial last page when that page is shared.
    Works elementwise on numpy or jnp arrays (the host check and the device op agree by
    construction)."""
    grow = -(-(length + count) // page_size) - (-(-length // page_size))
    cow = (length % page_size != 0) & (count > 0) & last_page_shared
    return grow + cow, cow


# ---- pure operations ------------------------------------------------------------------------
def open_seq(state: PagedKVState, seq) -> PagedKVState:
    """Mark `seq` open and empty."""
    return dataclasses.replace(
        state,
        active=state.active.at[seq].set(True),
        lengths=state.lengths.at[seq].set(0),
        positions=state.positions.at[seq].set(0),
        page_table=state.page_table.at[seq].set(state.num_pages),
    )


def free_seq(state: PagedKVState, seq) -> PagedKVState:
    """Close `seq` and drop its page references (pages reaching 0 become free)."""
    pages = state.page_table[seq]
    return dataclasses.replace(
        state,
        refcount=state.refcount.at[pages].add(-1, mode="drop"),
        page_table=state.page_table.at[seq].set(state.num_pages),
        lengths=state.lengths.at[seq].set(0),
        positions=state.positions.at[seq].set(0),
        token_ids=state.token_ids.at[seq].set(0),
        active=state.active.at[seq].set(False),
    )


def fork_seq(state: PagedKVState, src, dst) -> PagedKVState:
    """Open `dst` as a copy of `src` that shares all of its pages (refcounts + 1)."""
    pages = state.page_table[src]
    return dataclasses.replace(
        state,
        refcount=state.refcount.at[pages].add(1, mode="drop"),
        page_table=state.page_table.at[dst].set(pages),
        lengths=state.lengths.at[dst].set(state.lengths[src]),
        positions=state.positions.at[dst].set(state.positions[src]),
        token_ids=state.token_ids.at[dst].set(state.token_ids[src]),
        active=state.active.at[dst].set(True),
    )


def retain_pages(state: PagedKVState, pages) -> PagedKVState:
    """Take one more reference to each page in `pages` (i32[K]; P = padding). A holder outside
    any sequence (a prefix cache) keeps pages alive this way."""
    return dataclasses.replace(state, refcount=state.refcount.at[pages].add(1, mode="drop"))


def release_pages(state: PagedKVState, pages, *, zero: bool = False) -> PagedKVState:
    """Drop one reference to each page in `pages` (distinct; P = padding). With `zero`, pages
    nobody references any more are zeroed (a purge: their contents must not survive)."""
    refcount = state.refcount.at[pages].add(-1, mode="drop")
    if not zero:
        return dataclasses.replace(state, refcount=refcount)
    p = state.num_pages
    dead = jnp.where(refcount.at[pages].get(mode="fill", fill_value=1) == 0, pages, p)
    return dataclasses.replace(
        state,
        refcount=refcount,
        c_kv=state.c_kv.at[:, dead].set(0, mode="drop"),
        k_pe=state.k_pe.at[:, dead].set(0, mode="drop"),
    )


def adopt_prefix(state: PagedKVState, seq, pages, tokens, length) -> PagedKVState:
    """Open `seq` holding `length` tokens (`tokens` i32[max_seq_len]) whose KV already lives in
    `pages` (i32[max_pages] page-table row, P = unused): every listed page gains a reference.
    Pages must be full (length a multiple of page_size), so the sequence never writes them."""
    return dataclasses.replace(
        state,
        refcount=state.refcount.at[pages].add(1, mode="drop"),
        page_table=state.page_table.at[seq].set(pages),
        lengths=state.lengths.at[seq].set(length),
        positions=state.positions.at[seq].set(length),
        token_ids=state.token_ids.at[seq].set(tokens),
        active=state.active.at[seq].set(True),
    )


def append_tokens(
    state: PagedKVState,
    seqs: jax.Array,  # i32[B]; padded rows may hold any open sequence id with count 0
    tokens: jax.Array,  # i32[B, T]
    counts: jax.Array,  # i32[B] real tokens per row (<= T)
) -> tuple[PagedKVState, jax.Array]:
    """Reserve slots for `counts[b]` new tokens of each `seqs[b]` and record their ids.

    Allocates the lowest free pages, copies a shared partial last page first (copy on write),
    updates page tables, refcounts, lengths, positions and token ids. Returns the new state and
    i32[B, T] destination slots (`page * page_size + offset`; padding gets P * page_size,
    "nowhere"). The KV itself is written by `write_kv`. Sequences in one call must differ.
    """
    ps, num_pages = state.page_size, state.num_pages
    b, t = tokens.shape
    length = state.lengths[seqs]  # [B]
    last_col = jnp.maximum(length - 1, 0) // ps  # page-table column of the partial last page
    last_page = jnp.take_along_axis(state.page_table[seqs], last_col[:, None], 1)[:, 0]
    shared = state.refcount.at[last_page].get(mode="fill", fill_value=0) > 1
    need, cow = pages_needed(length, counts, shared, ps)

    # candidate pages: the lowest free ones, enough for the worst case of this shape
    per_row = -(-t // ps) + 1
    (free,) = jnp.nonzero(state.refcount == 0, size=b * per_row, fill_value=num_pages)
    offset = jnp.cumsum(need) - need  # first candidate of each row
    j = jnp.arange(per_row)[None, :]  # [1, J]
    take = j < need[:, None]  # [B, J]
    page = jnp.where(take, free[jnp.minimum(offset[:, None] + j, b * per_row - 1)], num_pages)
    # column each taken page goes to: the partial last page's column for a copy, else growth
    grow_col = -(-length // ps)[:, None] + j - cow[:, None]
    col = jnp.where(cow[:, None] & (j == 0), last_col[:, None], grow_col)
    col = jnp.where(take, col, state.page_table.shape[1])  # dropped

    refcount = state.refcount.at[page].add(1, mode="drop")
    refcount = refcount.at[jnp.where(cow, last_page, num_pages)].add(-1, mode="drop")
    cow_dst = jnp.where(cow, page[:, 0], num_pages)
    c_kv = state.c_kv.at[:, cow_dst].set(state.c_kv[:, last_page], mode="drop")
    k_pe = state.k_pe.at[:, cow_dst].set(state.k_pe[:, last_page], mode="drop")
    page_table = state.page_table.at[seqs[:, None], col].set(page, mode="drop")

    pos = length[:, None] + jnp.arange(t)[None, :]  # [B, T] token index within its sequence
    real = jnp.arange(t)[None, :] < counts[:, None]
    pcol = jnp.minimum(pos // ps, page_table.shape[1] - 1)
    slot_page = jnp.take_along_axis(page_table[seqs], pcol, 1)
    slots = jnp.where(real, slot_page * ps + pos % ps, num_pages * ps)
    token_ids = state.token_ids.at[seqs[:, None], jnp.where(real, pos, state.max_seq_len)].set(
        tokens, mode="drop"
    )
    new = dataclasses.replace(
        state,
        c_kv=c_kv,
        k_pe=k_pe,
        page_table=page_table,
        refcount=refcount,
        token_ids=token_ids,
        lengths=state.lengths.at[seqs].add(counts),
        positions=state.positions.at[seqs].add(counts),
    )
    return new, slots


def write_kv(
    state: PagedKVState,
    layer: int,
    slots: jax.Array,  # i32[...] destination slots; P * page_size drops
    c_kv: jax.Array,  # [..., R]
    k_pe: jax.Array,  # [..., Dr]
) -> PagedKVState:
    """Store one layer's latent and rope band at `slots` (cast to the storage dtypes)."""
    ps = state.page_size
    page, off = slots // ps, slots % ps

    def put(pool, rows, dtype):  # in place on the storage pool (see the module docstring)
        return pool.at[layer, page, off].set(encode(rows, dtype), mode="drop")

    return dataclasses.replace(
        state,
        c_kv=put(state.c_kv, c_kv, state.kv_dtype),
        k_pe=put(state.k_pe, k_pe, state.k_pe_dtype),
    )


def gather_kv(
    state: PagedKVState,
    layer: int,
    pages: jax.Array,  # i32[..., W] page ids (P = none)
    valid: jax.Array,  # bool[..., W * page_size] slots that hold tokens
) -> tuple[jax.Array, jax.Array]:  # [..., W * page_size, R], [..., W * page_size, Dr]
    """Read one layer's latent and rope band (as kv_dtype / k_pe_dtype) for a run of pages.
    Slots that are not valid come back as zeros, whatever the pool holds there (unused pages
    may hold anything, even NaN)."""
    c = decode(state.c_kv[layer].at[pages].get(mode="fill", fill_value=0), state.kv_dtype)
    k = decode(state.k_pe[layer].at[pages].get(mode="fill", fill_value=0), state.k_pe_dtype)
    c = c.reshape(*pages.shape[:-1], -1, c.shape[-1])
    k = k.reshape(*pages.shape[:-1], -1, k.shape[-1])
    return jnp.where(valid[..., None], c, 0), jnp.where(valid[..., None], k, 0)


# ---- host-side views ------------------------------------------------------------------------
def host_meta(state: PagedKVState) -> dict[str, np.ndarray]:
    """Page tables, lengths, open flags and refcounts on the host (one small transfer)."""
    pt, ln, ac, rc = jax.device_get((state.page_table, state.lengths, state.active, state.refcount))
    return {"page_table": pt, "lengths": ln, "active": ac, "refcount": rc}


def table_references(meta, page_size: int, num_pages: int) -> np.ndarray:
    """i32[P]: how many open sequences' page tables list each page (within their lengths)."""
    counts = np.zeros(num_pages, np.int32)
    for q in np.flatnonzero(meta["active"]):
        used = meta["page_table"][q, : -(-int(meta["lengths"][q]) // page_size)]
        np.add.at(counts, used[used < num_pages], 1)
    return counts


def tokens(state: PagedKVState, seq: int) -> list[int]:
    """The token ids of sequence `seq` as it is now."""
    meta = host_meta(state)
    check_seq(meta, state, seq, must_be_open=True)
    n = int(meta["lengths"][seq])
    return [int(x) for x in np.asarray(state.token_ids[seq])[:n]]


def check_seq(meta, state: PagedKVState, seq, *, must_be_open: bool) -> int:
    """Raise SequenceError unless `seq` is an int in range (and open, if asked); `meta` is
    `host_meta(state)`."""
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)):
        raise SequenceError(f"sequence id must be an int, got {seq!r}")
    if not 0 <= seq < state.max_seqs:
        raise SequenceError(f"sequence {seq} is out of range [0, {state.max_seqs})")
    if must_be_open and not meta["active"][seq]:
        raise SequenceError(f"sequence {seq} is not open")
    return int(seq)
