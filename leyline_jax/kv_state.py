"""The paged KV state: the device pools of KV pages (`leyline_jax.kv_pools`) and their
bookkeeping on the host.

Pages. Token i of sequence q lives at page `page_table[q, i // page_size]`, offset
`i % page_size`, in every layer's pools. Unused page-table entries hold `num_pages`
("nowhere"): gathers through them read nothing that is used, scatters through them are dropped.

Host and device. The bookkeeping (page tables, lengths, token ids, open flags, page refcounts)
is host data (numpy, read-only arrays); only the pools (`KVPools`) live on the device. Every
allocation, fork, free and reference count is decided on the host with no device read, and
the pools change only through jitted, donated steps (`leyline_jax.paged`, the directives).
The state is still a value: each operation returns a new `PagedKVState` (host arrays are
copied where they change, never written in place) and consumes the pools of the one it was
given.

Sharing. Pages carry reference counts; a page is free when its count is 0; a page referenced
more than once is never written (copy on write). Every decision about pages and references is
`leyline_jax.allocator`' (the allocator); this module holds the state, its shape ladders
(every jitted operand is padded to a bucket: a bounded set of compiled shapes) and its
construction (`init_state`).

The host operations here assume valid arguments: the public wrappers (`leyline_jax.paged`)
check first, so an error is raised before anything changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from leyline_jax.allocator import check_seq, pages_for
from leyline_jax.hf_config import is_int
from leyline_jax.kv_pools import KVPools, storage_dtype, zero_pages

# The most new tokens one step carries by default (`init_state`'s `max_step_tokens`)
MAX_STEP_TOKENS = 1024
# A state's buckets are powers of this by default (`init_state`'s `bucket_growth`, read when a
# state is made): two, measured against the padding it saves (BENCHMARKS.md, issue 27)
BUCKET_GROWTH = 2
# Pages are zeroed in blocks of at most this many (each bucketed): a bounded set of shapes
ZERO_BLOCK = 64

__all__ = ["PagedKVState", "init_state", "tokens"]


def bucket(n: int, minimum: int = 1, maximum: int | None = None, growth: int = 2) -> int:
    """Smallest power of `growth` >= max(n, minimum), capped at `maximum`: the shapes jitted
    steps over the pools are padded to."""
    b, need = 1, max(n, minimum)
    while b < need:
        b *= growth
    return b if maximum is None else min(b, maximum)


def ladder(top: int, minimum: int = 1, growth: int = 2) -> list[int]:
    """Every bucket from `minimum` up to `top`, smallest first: `bucket(n, minimum, top,
    growth)` for n in [1, top] (powers of `growth`, and `top` itself last)."""
    out = [bucket(minimum, growth=growth)]
    while out[-1] < top:
        out.append(out[-1] * growth)
    return [*out[:-1], top]


def padded(ids, size: int, fill: int) -> jax.Array:
    """i32[size] on the device: `ids`, then `fill` (the padding a bucketed step drops)."""
    out = np.full(size, fill, np.int32)
    out[: len(ids)] = ids
    return jnp.asarray(out)


_zero_pages = jax.jit(zero_pages, donate_argnums=0)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVState:
    pools: KVPools  # device
    page_table: np.ndarray  # host i32[max_seqs, max_pages]; unused entries = P
    lengths: np.ndarray  # host i32[max_seqs] tokens cached per sequence
    token_ids: tuple[np.ndarray, ...]  # host, per sequence: i32[lengths[q]]
    active: np.ndarray  # host bool[max_seqs] open sequences
    refcount: np.ndarray  # host i32[P] references to each page; 0 = free
    vocab_size: int = dataclasses.field(metadata=dict(static=True))  # token ids are < this
    max_seq_len: int = dataclasses.field(metadata=dict(static=True))  # exact, not page-rounded
    # the most new tokens one step carries: the top of the step's token buckets
    max_step_tokens: int = dataclasses.field(default=MAX_STEP_TOKENS, metadata=dict(static=True))
    # each bucket of its ladders (step tokens, splice moves, zeroed pages) over the one before
    bucket_growth: int = dataclasses.field(default=BUCKET_GROWTH, metadata=dict(static=True))

    def replace(self, **changes) -> PagedKVState:
        """A new state with `changes` (host arrays are frozen: nobody writes them in place)."""
        for name, value in changes.items():
            if isinstance(value, np.ndarray):
                _frozen(value)
            elif name == "token_ids":
                for row in value:
                    _frozen(row)
        return dataclasses.replace(self, **changes)

    def bucket(self, n: int, minimum: int = 1, maximum: int | None = None) -> int:
        """`n` padded to this state's ladder (`bucket` with its `bucket_growth`)."""
        return bucket(n, minimum, maximum, self.bucket_growth)

    def ladder(self, top: int, minimum: int = 1) -> list[int]:
        """This state's buckets from `minimum` up to `top` (`ladder` with its growth)."""
        return ladder(top, minimum, self.bucket_growth)

    def zeroed(self, pages) -> PagedKVState:
        """The state with whole pages `pages` (host ids) zeroed in every layer, on the device
        (donates this state's pools), in blocks of `ZERO_BLOCK`: what a purge does to KV
        nobody may read again."""
        pools = self.pools
        for a in range(0, len(pages), ZERO_BLOCK):
            block = pages[a : a + ZERO_BLOCK]
            pools = pools.by_layer(
                _zero_pages, padded(block, self.bucket(len(block), 1, ZERO_BLOCK), self.num_pages)
            )
        return self if pools is self.pools else self.replace(pools=pools)

    # every layer's bands stacked, [L, P, page_size, *shape] storage (a copy: for inspection)
    moved = property(lambda self: jnp.stack(self.pools.moved))
    rotated = property(lambda self: jnp.stack(self.pools.rotated))
    page_size = property(lambda self: self.pools.page_size)
    moved_dtype = property(lambda self: self.pools.moved_dtype)
    rotated_dtype = property(lambda self: self.pools.rotated_dtype)
    num_layers = property(lambda self: self.pools.num_layers)
    positions = property(lambda self: self.lengths)  # i32[max_seqs] each one's next position
    num_pages = property(lambda self: self.refcount.shape[0])
    max_seqs = property(lambda self: self.lengths.shape[0])
    max_pages_per_seq = property(lambda self: self.page_table.shape[1])


def checked_growth(growth) -> int:
    """A `bucket_growth` setting, checked (None: `BUCKET_GROWTH`, read at the call)."""
    growth = BUCKET_GROWTH if growth is None else growth
    if not is_int(growth) or growth < 2:
        raise ValueError(f"bucket_growth={growth!r} must be an integer of at least 2")
    return int(growth)


def init_state(
    config,
    *,
    num_pages: int,
    page_size: int,
    max_seqs: int,
    kv_dtype=jnp.bfloat16,
    k_pe_dtype=None,
    max_seq_len: int | None = None,
    max_step_tokens: int = MAX_STEP_TOKENS,
    bucket_growth: int | None = None,
    mesh=None,
) -> PagedKVState:
    """An empty pool of `num_pages` pages of `page_size` slots for up to `max_seqs` sequences.

    `config`: a model's config (its family says the bands' shapes: `config.kv_bands()`).
    `kv_dtype` stores the moved band (MLA `c_kv`, GQA V); `k_pe_dtype` stores the rotated band
    (MLA `k_pe`, GQA K) and defaults to float32 whatever `kv_dtype` is: a band rounded to bf16
    after every splice drifts like a random walk (relative L2 5e-2 after 1000 splices, against
    1.7e-3 for a fresh bf16 prefill), while an fp32 band stays at the fresh-prefill error however
    many splices it takes (4e-4 at positions up to 1e5; `benchmarks/drift_study.py`). The price
    is ~11% more cache for DeepSeek shapes (a token's 512 bf16 + 64 fp32 values against 576
    bf16). `max_seq_len` bounds one sequence (default: the whole pool, capped by the model's
    max_position_embeddings; an explicit value may go past it: positions the model was not
    trained for are the caller's choice, as with a serving stack's max-model-length override).
    `max_step_tokens`: the most new tokens one step carries (a longer prefill runs in chunks of
    this many; `leyline_jax.paged.step_shapes` lists the shapes it allows). `bucket_growth`:
    steps, splice moves and zeroing pad to its powers (None: `BUCKET_GROWTH`, 2; larger: fewer
    shapes, more padding). `mesh`: a `leyline_jax.sharding.MeshConfig` to split every layer's
    pools by page over its `data` axis (None: the default device). Raises ValueError naming a
    bad argument.
    """
    sizes = {"num_pages": num_pages, "page_size": page_size, "max_seqs": max_seqs}
    sizes["max_step_tokens"] = max_step_tokens
    if max_seq_len is not None:
        sizes["max_seq_len"] = max_seq_len
    for name, v in sizes.items():
        if not is_int(v) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    bucket_growth = checked_growth(bucket_growth)
    num_pages, page_size, max_seqs = int(num_pages), int(page_size), int(max_seqs)
    if max_seq_len is None:
        max_seq_len = min(num_pages * page_size, config.max_position_embeddings)
    max_seq_len = int(max_seq_len)
    max_pages = pages_for(max_seq_len, page_size)
    kv_dtype = jnp.dtype(kv_dtype)
    k_pe_dtype = jnp.dtype(jnp.float32 if k_pe_dtype is None else k_pe_dtype)
    for name, dt in (("kv_dtype", kv_dtype), ("k_pe_dtype", k_pe_dtype)):
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"{name} must be a floating dtype, got {dt}")
    if mesh is not None and not hasattr(mesh, "pool_sharding"):
        raise ValueError(f"mesh must be a leyline_jax.sharding.MeshConfig, got {mesh!r}")
    layers, bands = config.num_hidden_layers, config.kv_bands()
    sharding = None if mesh is None else mesh.pool_sharding((num_pages, page_size))

    def band(shape, dtype):  # made where it lives: a big pool never passes through one device
        shape, dtype = (num_pages, page_size, *shape), storage_dtype(dtype)
        return tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(layers))

    pools = KVPools(
        moved=band(bands.moved, kv_dtype),
        rotated=band(bands.rotated, k_pe_dtype),
        page_size=page_size,
        moved_dtype=kv_dtype,
        rotated_dtype=k_pe_dtype,
        sharding=sharding,
    )
    empty = np.zeros(0, np.int32)
    return PagedKVState(
        pools=pools,
        page_table=_frozen(np.full((max_seqs, max_pages), num_pages, np.int32)),
        lengths=_frozen(np.zeros(max_seqs, np.int32)),
        token_ids=tuple(_frozen(empty.copy()) for _ in range(max_seqs)),
        active=_frozen(np.zeros(max_seqs, bool)),
        refcount=_frozen(np.zeros(num_pages, np.int32)),
        vocab_size=config.vocab_size,
        max_seq_len=max_seq_len,
        max_step_tokens=int(max_step_tokens),
        bucket_growth=bucket_growth,
    )


# ---- host views -------------------------------------------------------------------------------
def tokens(state: PagedKVState, seq: int) -> list[int]:
    """The token ids of sequence `seq` as it is now."""
    check_seq(state, seq, want_open=True)
    return state.token_ids[seq].tolist()


def compile_counts() -> dict[str, int]:
    """How many shapes the purge's page zeroing has compiled (tests and benchmarks count)."""
    return {"zero": _zero_pages._cache_size()}
