"""The KV pools: every layer's pages on the device, and the operations jitted steps run on them.

Layout. Per layer, the two bands of every cached token (the band a splice moves: MLA's latent
`c_kv`, GQA's V; and the band it moves and rotates: MLA's `k_pe`, GQA's K) live in pages of
`page_size` slots, in two separate device arrays (a splice rotates one only); every layer
has its own pair, so a step reads and writes one layer's pages in place (one stacked array per
band made XLA copy a layer's whole pool out of it for each attention call). Slot
`page * page_size + offset` is a token's place; which page holds which token is the host
state's (`leyline_jax.kv_state`). Page id `num_pages` is "nowhere": gathers through it are
clipped, scatters through it dropped, so padded (bucketed) operands change nothing.

Storage. A 16-bit float band (the bf16 moved band by default) is stored as its raw bits (uint16) and
viewed as floats only where rows are read (`from_storage`): XLA:CPU runs a float-16 scatter by
converting the whole pool to f32 and back (two full-pool passes for every write), and a
bitcast of the pool costs the same; an integer pool is scattered in place. `moved_dtype` /
`rotated_dtype` on the pools say what the stored bits mean.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


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


# ---- device operations (traced inside jitted steps) ------------------------------------------
def copy_pages(pools: KVPools, src, dst) -> KVPools:
    """Copy whole pages src[k] -> dst[k] in every layer (i32[K]; dst = P drops; padding pairs
    are (P, P): a source out of range is clipped, read and dropped with its destination)."""
    return pools.map(lambda a: a.at[dst].set(a.at[src].get(mode="clip"), mode="drop"))


def zero_pages(pools: KVPools, pages) -> KVPools:
    """Zero whole pages in every layer (i32[K]; P drops)."""
    return pools.map(lambda a: a.at[pages].set(0, mode="drop"))


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
