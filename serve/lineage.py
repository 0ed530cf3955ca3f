"""Lineage: which KV may be shared through the radix cache, and what a FORGET takes back.

KV that AMORTIZE spliced (or MOVE copied) is not what a fresh prefill of the same tokens gives,
so it stays with the session (and its KV) that made it: a session tracks `clean`, the length of
the prefix whose KV a fresh prefill would reproduce, and only whole pages of that prefix enter
the radix cache (`cache_prefix`). A FORGET purges the radix path of the session's pre-edit
tokens from the first evicted token on, before the edit runs (`purge`): nothing computed with
the evicted tokens stays reachable, and pages nobody references afterwards are zeroed.
"""

from __future__ import annotations

from collections.abc import Sequence

from leyline_jax import allocator
from leyline_jax.directives import Directive, Mode
from leyline_jax.kv_state import PagedKVState
from serve.budget import KVPlan
from serve.radix import RadixCache

# a session opened without a lineage has its own, "session:<id>": names with this prefix are
# the engine's, never a caller's
OWN_LINEAGE = "session:"


def cache_prefix(
    radix: RadixCache | None, state: PagedKVState, seq: int, tokens: Sequence[int], clean: int
) -> tuple[PagedKVState, list[int]]:
    """Offer the whole pages of `seq`'s clean prefix (tokens[:clean], cached) to the tree; the
    state takes a reference for each page the tree newly holds. Returns (state, those pages)."""
    ps = state.page_size
    n = clean // ps
    if radix is None or n == 0:
        return state, []
    row = state.page_table[seq, :n]
    taken = radix.insert(list(tokens[: n * ps]), [int(p) for p in row])
    return (allocator.retain(state, taken) if taken else state), taken


def purge(
    radix: RadixCache | None, state: PagedKVState, tokens: Sequence[int], ds: Sequence[Directive]
) -> PagedKVState:
    """A batch with a FORGET: the tree forgets the path of `tokens` (the session before the
    edit) from the first FORGET start on; pages nobody else holds are zeroed. Idempotent."""
    forget = [d for d in ds if d.mode is Mode.FORGET]
    if not forget or radix is None:
        return state
    pages = radix.purge(list(tokens), forget[0].start)
    return allocator.release(state, pages, zero=True) if pages else state


def clean_after_edit(clean: int, kvp: KVPlan) -> int:
    """A session's clean prefix after its KV is edited: a splice ends it at the first spliced
    edit (KV after it was moved and rotated), a cut at the cut."""
    if kvp.splices:
        clean = min(clean, kvp.splices[0].start)
    return min(clean, kvp.cut)
