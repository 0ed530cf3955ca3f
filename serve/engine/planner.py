"""The host planner: what a turn does to its session's tokens and KV. Pure functions of plain
data (token lists, spans, directives): no engine, no device; the scheduler and the runner ask.

- `plan_turn`: the turn's directives (a whole prompt diffed against the session, or explicit
  ones) and its prompt, checked against the session's tokens and pins.
- `kv_plan`: what of the cached KV the turn keeps, splices and cuts; `movable` makes a MOVE
  whose sources the KV does not keep a plain AMORTIZE.
- `move_plan`: MOVE's sources for the tokens a turn would prefill.
- `clean_after_edit`: how much of the KV a fresh prefill would still reproduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from leyline_jax import directives as dv
from leyline_jax.directives import Directive, Mode, Source
from serve import spans
from serve.edits import compose


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


def edits_of(
    tokens: list[int], prompt: list[int] | None, directives, new_tokens, mode: Mode, pins
) -> tuple[list[Directive], list[int]]:
    """(directives in the session's coordinates, new tokens) of a turn: a whole prompt
    (`prompt`, with explicit `directives` in its own coordinates) is diffed against the
    session's `tokens` (`serve.edits.compose`); else the directives are taken as given."""
    if prompt is not None:
        return compose(tokens, prompt, directives, mode=mode, protect=pins)
    return list(directives), list(new_tokens)


def plan_turn(tokens: list[int], ds: list[Directive], new: list[int], pins) -> TurnPlan:
    """The turn's plan from its resolved directives (DECAY already resolved into MOVEs) and
    new tokens. Raises DirectiveError (a ValueError) for what the session refuses: a turn that
    leaves it empty, a directive cutting into a pin."""
    edited = dv.apply_to_list(tokens, ds)
    if not new and not edited:
        raise dv.DirectiveError("the turn would leave the session empty: it adds no token")
    prompt = edited + list(new)
    spans.check_pins(pins, pin_edits(tokens, ds, prompt))
    return TurnPlan(ds, prompt)


def pin_edits(tokens: list[int], ds, prompt: list[int]) -> list[Directive]:
    """The directives that edit the session's text, for its pins: all but a deletion of its
    end whose tokens the prompt feeds again at the same place (how a turn re-feeds a cached
    last token: `serve.edits.edits_and_feed`), which changes no token."""
    out, shift = [], 0
    for d in ds:
        at = d.start + shift
        refeed = (
            not d.replacement
            and d.end == len(tokens)
            and prompt[at : at + d.end - d.start] == tokens[d.start : d.end]
        )
        if not refeed:
            out.append(d)
        shift += d.delta
    return out


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


def movable(kvp: KVPlan) -> tuple[KVPlan, int]:
    """The plan with every spliced MOVE whose sources the KV does not hold through the cut
    made a plain AMORTIZE (the same text, its replacement prefilled); and how many were."""
    out, plain = [], 0
    for d in kvp.splices:
        if any(not x.pages and x.position + x.length > kvp.cut for x in d.sources):
            d = dataclasses.replace(d, mode=Mode.AMORTIZE, sources=())
            plain += 1
        out.append(d)
    return dataclasses.replace(kvp, splices=out), plain


def clean_after_edit(clean: int, kvp: KVPlan) -> int:
    """A session's clean prefix after its KV is edited: a splice ends it at the first spliced
    edit (KV after it was moved and rotated), a cut at the cut."""
    if kvp.splices:
        clean = min(clean, kvp.splices[0].start)
    return min(clean, kvp.cut)


def move_plan(
    prompt: Sequence[int],
    kept: int,
    page_size: int,
    locate: Callable[[tuple[int, ...]], tuple[int, int] | None],
) -> Directive | None:
    """MOVE for the tokens a turn would prefill, prompt[kept:] (its KV holds prompt[:kept]):
    scanning left to right, a run of at least a page of tokens that the session's own KV
    holds at another position (prompt[:kept]) is taken from there, extended as far as it
    matches; failing that, a whole page a shared cache holds with exactly the next page of
    tokens (`locate(tokens)` -> (page, position) or None, the caller's lineage rule applied).
    Returns one insertion at `kept` whose replacement runs to the last such run (its gaps are
    prefilled), or None; at least the prompt's last token is left to feed."""
    ps, limit = page_size, len(prompt) - 1
    own: dict[tuple[int, ...], int] = {}
    for p in range(kept - ps, -1, -1):  # the earliest occurrence of each page of tokens
        own[tuple(prompt[p : p + ps])] = p
    sources, o = [], kept
    while o + ps <= limit:
        key = tuple(prompt[o : o + ps])
        p = own.get(key)
        if p is not None:
            n = ps
            while o + n < limit and p + n < kept and prompt[o + n] == prompt[p + n]:
                n += 1
            sources.append(Source(o - kept, p, n))
            o += n
            continue
        found = locate(key)
        if found is not None:
            sources.append(Source(o - kept, found[1], ps, pages=(found[0],)))
            o += ps
            continue
        o += 1
    if not sources:
        return None
    end = kept + sources[-1].offset + sources[-1].length
    return Directive(kept, kept, prompt[kept:end], Mode.MOVE, sources=tuple(sources))
