"""Spans a session marks on its tokens: pinned spans (PIN) and scratch spans (SCRATCH).

Host arithmetic only. A span is `(start, end)` in the session's token coordinates, 0 <= start <
end. A directive *cuts into* a span when it deletes or replaces one of the span's tokens, or
inserts strictly inside it; an insertion at either boundary, or an edit wholly before or after,
leaves the span's tokens as they are (they only shift by the edits before them).
"""

from __future__ import annotations

from collections.abc import Sequence

from leyline_jax.directives import Directive, DirectiveError

Span = tuple[int, int]


def check_spans(spans, length: int, what: str) -> list[Span]:
    """`spans` as sorted (start, end) int pairs inside [0, length), non-overlapping; raises
    DirectiveError naming `what` otherwise."""
    try:
        out = sorted((int(a), int(b)) for a, b in spans)
        bad = [x for x in spans if any(isinstance(v, bool) or int(v) != v for v in x)]
    except (TypeError, ValueError) as e:
        raise DirectiveError(f"{what} must be (start, end) pairs of ints: {e}") from e
    if bad:
        raise DirectiveError(f"{what} must be (start, end) pairs of ints, got {bad[0]!r}")
    for a, b in out:
        if not 0 <= a < b <= length:
            raise DirectiveError(
                f"{what} ({a}, {b}) is empty or outside the {length} tokens it marks"
            )
    for (_, b), (c, _) in zip(out, out[1:], strict=False):
        if c < b:
            raise DirectiveError(f"{what} overlap: {out}")
    return out


def cuts_into(d: Directive, span: Span) -> bool:
    a, b = span
    if d.start == d.end:
        return a < d.start < b
    return d.start < b and d.end > a


def check_pins(pins: Sequence[Span], directives: Sequence[Directive]) -> None:
    """Raise DirectiveError if a directive cuts into a pinned span without `override_pin`."""
    for d in directives:
        hit = [p for p in pins if cuts_into(d, p)]
        if hit and not d.override_pin:
            raise DirectiveError(
                f"directive [{d.start}, {d.end}) cuts into pinned span {hit[0]}: unpin it, "
                "or pass override_pin=True to edit it anyway (the pin is then dropped)"
            )


def remap(spans: Sequence[Span], directives: Sequence[Directive]) -> list[Span]:
    """The spans after a (resolved) directive batch: each shifted by the edits before it; a
    span an edit cut into is dropped."""
    out = []
    for a, b in spans:
        if any(cuts_into(d, (a, b)) for d in directives):
            continue
        shift = sum(d.delta for d in directives if d.end <= a)
        out.append((a + shift, b + shift))
    return out


def find_tagged(tokens: Sequence[int], open_tag: Sequence[int], close_tag: Sequence[int]):
    """Spans of `tokens` from each occurrence of `open_tag` through the next `close_tag`
    (inclusive; an unclosed block runs to the end)."""
    toks, o, c = list(tokens), list(open_tag), list(close_tag)
    out, i = [], 0
    while o and i + len(o) <= len(toks):
        if toks[i : i + len(o)] != o:
            i += 1
            continue
        j = i + len(o)
        while c and j + len(c) <= len(toks) and toks[j : j + len(c)] != c:
            j += 1
        end = j + len(c) if c and j + len(c) <= len(toks) else len(toks)
        out.append((i, end))
        i = end
    return out
