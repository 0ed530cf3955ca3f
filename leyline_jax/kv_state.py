"""The paged KV state: device pools of KV pages, and their bookkeeping on the host.

Layout. Per layer, the two bands of every cached token (the band a splice moves: MLA's latent
`c_kv`, GQA's V; and the band it moves and rotates: MLA's `k_pe`, GQA's K) live in pages of
`page_size` slots, in two separate device arrays (a splice rotates one only); every layer
has its own pair, so a step reads and writes one layer's pages in place (one stacked array per
band made XLA copy a layer's whole pool out of it for each attention call). Token i of
sequence q lives at page `page_table[q, i // page_size]`, offset `i % page_size`. Unused
page-table entries hold `num_pages` ("nowhere"): gathers through them read nothing that is
used, scatters through them are dropped.

Host and device. The bookkeeping (page tables, lengths, token ids, open flags, page refcounts)
is host data (numpy, read-only arrays); only the pools (`KVPools`) live on the device. Every
allocation, fork, free and reference count is decided on the host with no device read, and
the pools change only through jitted, donated steps (`leyline_jax.paged`, the directives).
The state is still a value: each operation returns a new `PagedKVState` (host arrays are
copied where they change, never written in place) and consumes the pools of the one it was
given.

Sharing. Pages carry reference counts; a page is free when its count is 0; a page referenced
more than once is never written (copy on write). Every decision about pages and references is
`leyline_jax.allocator`' (the allocator); this module holds the state and the pools' device
operations.

Storage. A 16-bit float band (the bf16 moved band by default) is stored as its raw bits (uint16) and
viewed as floats only where rows are read (`from_storage`): XLA:CPU runs a float-16 scatter by
converting the whole pool to f32 and back (two full-pool passes for every write), and a
bitcast of the pool costs the same; an integer pool is scattered in place. `moved_dtype` /
`rotated_dtype` on the pools say what the stored bits mean.

The host operations here assume valid arguments: the public wrappers (`leyline_jax.paged`)
check first, so an error is raised before anything changes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from leyline_jax.allocator import OutOfPagesError, SequenceError, check_seq, pages_for
from leyline_jax.config import is_int

# The most new tokens one step carries by default (`init_state`'s `max_step_tokens`)
MAX_STEP_TOKENS = 1024
# A state's buckets are powers of this by default (`init_state`'s `bucket_growth`, read when a
# state is made): two, measured against the padding it saves (BENCHMARKS.md, issue 27)
BUCKET_GROWTH = 2
# Pages are zeroed in blocks of at most this many (each bucketed): a bounded set of shapes
ZERO_BLOCK = 64

__all__ = ["OutOfPagesError", "SequenceError", "KVPools", "PagedKVState", "init_state", "tokens"]


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


def storage_dtype(dtype):
    """What a band of `dtype` is stored as: its raw bits for 16-bit floats, else itself."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.uint16)
    return dtype


def to_storage(x, dtype):
    """Values -> storage: cast to `dtype`, then to its storage bits (bit-exact)."""
    x = x.astype(dtype)
    st = storage_dtype(dtype)
    return x if st == x.dtype else jax.lax.bitcast_convert_type(x, st)


def from_storage(x, dtype):
    """Storage -> values of `dtype` (bit-exact; apply to gathered rows, not to a pool)."""
    dtype = jnp.dtype(dtype)
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPools:
    """The device half of the state: every layer's pages (what jitted steps take and donate).

    Two bands per layer, named by what a splice does to them (the attention family says what
    they hold, `config.kv_bands()`): `moved` is copied bit-exact (MLA: the latent `c_kv`; GQA:
    V) and `rotated` is moved and rotated by RoPE (MLA: `k_pe`; GQA: K). A band's slot holds
    `[width]` (one row: MLA) or `[rows, width]` (one row per KV head: GQA), each row in the
    halves layout for the rotated band."""

    moved: tuple[jax.Array, ...]  # per layer [P, page_size, *moved_shape], storage dtype
    rotated: tuple[jax.Array, ...]  # per layer [P, page_size, *rotated_shape], storage dtype
    page_size: int = dataclasses.field(metadata=dict(static=True))
    moved_dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))  # what moved's bits mean
    rotated_dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))
    # where every layer's arrays live under a device mesh (split by page), None on one device
    sharding: jax.sharding.Sharding | None = dataclasses.field(
        default=None, metadata=dict(static=True)
    )

    num_pages = property(lambda self: self.moved[0].shape[0])
    num_layers = property(lambda self: len(self.moved))

    def kernel_impl(self, impl: str | None) -> str | None:
        """The kernel implementation a step over these pools uses: `impl` on one device; the
        jnp path under a mesh of several devices, which XLA's SPMD partitioner can split too (a
        compiled Pallas kernel is one opaque call it cannot: a Mosaic TPU kernel over sharded
        operands does not even lower, and the queries' heads are split by the params' rules
        even where the pools are whole on each device; the lowering gate found it at 1x8)."""
        if impl is None and self.sharding is not None and len(self.sharding.device_set) > 1:
            return "jnp"
        return impl

    def with_bands(self, moved, rotated) -> KVPools:
        """The pools holding new per-layer arrays. Every step that changes the pools returns
        them through here: under a mesh each array is kept at `sharding` (traced inside a
        jitted step, that pins the step's output to its input's placement, so donated pools
        are updated in place and the next step sees the same shardings: no recompile)."""
        if self.sharding is not None:
            pin = functools.partial(jax.lax.with_sharding_constraint, shardings=self.sharding)
            moved, rotated = tuple(map(pin, moved)), tuple(map(pin, rotated))
        return dataclasses.replace(self, moved=tuple(moved), rotated=tuple(rotated))

    def layer(self, i: int) -> KVPools:
        """Layer `i`'s pages alone, as pools of one layer (the same arrays)."""
        return dataclasses.replace(self, moved=(self.moved[i],), rotated=(self.rotated[i],))

    def by_layer(self, program, *args, **kwargs) -> KVPools:
        """The pools after `program(pools of one layer, *args, **kwargs)` (a jitted, donating
        step that returns them) ran on each layer in turn: one compiled program serves every
        layer, however many there are."""
        out = [program(self.layer(i), *args, **kwargs) for i in range(self.num_layers)]
        moved, rotated = tuple(o.moved[0] for o in out), tuple(o.rotated[0] for o in out)
        return dataclasses.replace(self, moved=moved, rotated=rotated)

    def map(self, fn) -> KVPools:
        """The pools with `fn(layer_pool)` applied to every layer's arrays of both bands."""
        return self.with_bands([fn(a) for a in self.moved], [fn(a) for a in self.rotated])


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


# ---- device operations on the pools (traced inside jitted steps) -------------------------------
def copy_pages(pools: KVPools, src, dst) -> KVPools:
    """Copy whole pages src[k] -> dst[k] in every layer (i32[K]; dst = P drops; padding pairs
    are (P, P): a source out of range is clipped, read and dropped with its destination)."""
    return pools.map(lambda a: a.at[dst].set(a.at[src].get(mode="clip"), mode="drop"))


def zero_pages(pools: KVPools, pages) -> KVPools:
    """Zero whole pages in every layer (i32[K]; P drops)."""
    return pools.map(lambda a: a.at[pages].set(0, mode="drop"))


_zero_pages = jax.jit(zero_pages, donate_argnums=0)


def zero_slots(pools: KVPools, slots) -> KVPools:
    """Zero single slots (i32[K] `page * page_size + offset`; P * page_size drops)."""
    ps = pools.page_size
    page, off = slots // ps, slots % ps
    return pools.map(lambda a: a.at[page, off].set(0, mode="drop"))


def read_pages(pools: KVPools, pages) -> tuple[jax.Array, jax.Array]:
    """Every layer's two bands at whole pages `pages` (i32[K]; an id out of range is clipped),
    stacked: (moved [L, K, page_size, *moved_shape], rotated [L, K, page_size, *rotated_shape])
    in the storage dtypes (a 16-bit band's raw bits: copying them is bit-exact)."""

    def take(band):
        return jnp.stack([a.at[pages].get(mode="clip") for a in band])

    return take(pools.moved), take(pools.rotated)


def write_pages(
    pools: KVPools,
    pages,  # i32[K] destination pages; P drops
    moved: jax.Array,  # [L, K, page_size, *moved_shape], moved's storage dtype
    rotated: jax.Array,  # [L, K, page_size, *rotated_shape], rotated's storage dtype
) -> KVPools:
    """Overwrite whole pages with stored bits: layer l's page pages[k] <- moved[l, k] and
    rotated[l, k] (the inverse of `read_pages`, bit-exact)."""

    def put(band, rows):
        return tuple(a.at[pages].set(rows[i], mode="drop") for i, a in enumerate(band))

    return pools.with_bands(put(pools.moved, moved), put(pools.rotated, rotated))


def write_kv(
    pools: KVPools,
    layer: int,
    slots: jax.Array,  # i32[T] destination slots; P * page_size drops
    moved: jax.Array,  # [T, *moved_shape]
    rotated: jax.Array,  # [T, *rotated_shape]
) -> KVPools:
    """Store one layer's two bands at `slots` (cast to the storage dtypes)."""
    ps = pools.page_size
    page, off = slots // ps, slots % ps

    def put(band, rows, dtype):  # in place on the storage pool (see the module docstring)
        new = band[layer].at[page, off].set(to_storage(rows, dtype), mode="drop")
        return band[:layer] + (new,) + band[layer + 1 :]

    return pools.with_bands(
        put(pools.moved, moved, pools.moved_dtype), put(pools.rotated, rotated, pools.rotated_dtype)
    )


def gather_slots(pools: KVPools, layer: int, slots) -> tuple[jax.Array, jax.Array]:
    """Layer `layer`'s two bands at `slots` (i32[S]) as values: (moved [S, ...], rotated)."""
    ps = pools.page_size
    page, off = slots // ps, slots % ps
    return (
        from_storage(pools.moved[layer][page, off], pools.moved_dtype),
        from_storage(pools.rotated[layer][page, off], pools.rotated_dtype),
    )


# ---- host views -------------------------------------------------------------------------------
def tokens(state: PagedKVState, seq: int) -> list[int]:
    """The token ids of sequence `seq` as it is now."""
    check_seq(state, seq, want_open=True)
    return state.token_ids[seq].tolist()


def compile_counts() -> dict[str, int]:
    """How many shapes the purge's page zeroing has compiled (tests and benchmarks count)."""
    return {"zero": _zero_pages._cache_size()}
