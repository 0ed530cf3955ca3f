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

from leyline_jax import allocator
from leyline_jax.directives import Directive, Mode


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
    while it does), for a session whose KV holds tokens[:kvp.cut] (`kvp` None: an empty slot):
    `leyline_jax.allocator.turn_need`."""
    final = len(plan.prompt) + max_new
    if kvp is None:
        return allocator.turn_need(page_size, final, None, None)
    first = kvp.splices[0].start if kvp.splices else None
    return allocator.turn_need(page_size, final, kvp.cut, first)
