"""Admission and the page budget: what a turn does to its session's KV, and how many pages it
may take from the pool. Host arithmetic only (the engine decides; nothing here changes state).

A turn is admitted only when the free pages, less what running turns may still take
(`still_needs`), cover the most it can take (`need`); a turn that cuts its session's KV cuts it
before that count, so what the cut frees is already back. Every bound here is an upper bound: a
turn never runs out of pages mid-way, and one admitted as fitting an otherwise empty pool
(`need <= num_pages - held`) can always get its pages once other turns finish.
"""

from __future__ import annotations

import dataclasses

from leyline_jax import kv_state as kv
from leyline_jax.directives import Directive, Mode
from leyline_jax.kv_state import PagedKVState


@dataclasses.dataclass(frozen=True)
class TurnPlan:
    """What an admitted turn does: a validated directive batch (the session's coordinates),
    then the turn's whole prompt (the edited list and the new tokens after it)."""

    directives: list[Directive]
    prompt: list[int]


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """How an admitted turn edits its session's KV (which holds tokens[:cached]): splice the
    AMORTIZE `splices` (each ending before `cut`), truncate at `cut` (both in the session's
    coordinates); the KV then holds prompt[:kept] and the ragged step feeds prompt[kept:]."""

    splices: list[Directive]
    cut: int
    kept: int


def kv_plan(cached: int, plan: TurnPlan) -> KVPlan:
    """How the turn edits the KV of a session holding tokens[:cached]: cut it at the latest
    point that keeps every token it may (no later than the first FORGET; not inside or at the
    end of an edit: an edit with nothing cached after it is not spliced, its replacement is
    fed), splice the AMORTIZE edits before the cut, and leave at least one prompt token to feed
    (a turn's first output needs logits). Tokens known but not cached (the previous turn's last
    output) are never fed only to be deleted: past `cached` everything is fed after the edit.
    `kept` 0: nothing cached survives."""
    ds = plan.directives
    cut = min([cached] + [d.start for d in ds if d.mode is Mode.FORGET])
    while cut > 0:
        inside = [d.start for d in ds if d.start < cut <= d.end]
        if inside:
            cut = inside[0]
            continue
        splices = [d for d in ds if d.end < cut]
        kept = cut + sum(d.delta for d in splices)
        if kept < len(plan.prompt):
            return KVPlan(splices, cut, kept)
        cut -= 1
    return KVPlan([], 0, 0)


def need(page_size: int, plan: TurnPlan, max_new: int, kvp: KVPlan | None) -> tuple[int, int]:
    """(pages the turn may take from the pool at most, pages of the session's own it holds
    while it does), for a session whose KV holds tokens[:kvp.cut] (`kvp` None: an empty slot).
    The session keeps its pages up to the cut: a splice copies the kept tokens after its first
    edit into fresh pages (from that edit's page on) before the old ones are released; without
    one, appending writes after the cut, copying a kept partial page first if it is shared."""
    ps = page_size
    final = len(plan.prompt) + max_new
    if kvp is None:
        return -(-final // ps) + 1, 0
    held = -(-kvp.cut // ps)
    if kvp.splices:
        return splice_need(ps, final, kvp.splices[0].start), held
    return -(-final // ps) - held + int(kvp.cut % ps > 0), held


def splice_need(page_size: int, length: int, first: int) -> int:
    """Pages a splice whose first edit starts at `first` may take from the pool, for a
    sequence `length` tokens long afterwards: it copies the kept tokens from that edit's page
    on into fresh pages before the old ones are released."""
    return -(-length // page_size) - first // page_size + 1


def still_needs(state: PagedKVState, seq: int, pending: int, new_left: int) -> int:
    """Pages a running turn may still take: `pending` prompt tokens and `new_left` tokens
    of its budget, past what `seq` holds (a shared last page is copied before it is written)."""
    ps = state.page_size
    n = int(state.lengths[seq])
    final = n + pending + new_left
    return -(-final // ps) - (-(-n // ps)) + int(bool(kv.last_page_shared(state, seq)))
