"""Edit detection: from a session's cached token list and a harness's new full prompt, the batch
of span directives that turns one into the other, plus the appended tail.

An agent harness that edits its own history (drops a stale tool output, retries a call) resends
the whole prompt; diffing it against what the session holds gives the directives, so a harness
that knows nothing of directives still gets splices instead of a re-prefill from the first
changed token.

    directives, tail = detect_edits(old, new)
    assert apply_to_list(old, directives) + tail == new

Spans come from `difflib.SequenceMatcher` over the tokens after the common prefix (no junk
heuristic: every token counts). Kept runs shorter than `min_keep` tokens between two edits are
folded into one directive: a few shared tokens (punctuation, a role marker) inside a replaced
region are not worth a separate edit, each of which costs a prefill call.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

from leyline_jax.directives import Directive, Mode, apply_to_list

MIN_KEEP = 16


def detect_edits(
    old: Sequence[int],
    new: Sequence[int],
    *,
    mode: Mode = Mode.AMORTIZE,
    min_keep: int = MIN_KEEP,
    protect: Sequence[tuple[int, int]] = (),
) -> tuple[list[Directive], list[int]]:
    """(directives in `old`'s coordinates, tokens to append after them) with
    `apply_to_list(old, directives) + tail == list(new)`. The tail is everything `new` has
    after the last token of `old` it keeps: an edit reaching `old`'s end becomes a deletion of
    old's end plus the tail, so the new tokens go through the batched, chunked prefill rather
    than a directive's fill. A kept run that overlaps a `protect` span (a pinned one) is never
    folded into the edits around it."""
    old, new = [int(t) for t in old], [int(t) for t in new]
    p = 0
    while p < len(old) and p < len(new) and old[p] == new[p]:
        p += 1
    if p == len(old):  # pure extension
        return [], new[p:]
    spans: list[list[int]] = []  # [i1, i2, j1, j2] in full coordinates, merged
    sm = difflib.SequenceMatcher(None, old[p:], new[p:], autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        i1, i2, j1, j2 = i1 + p, i2 + p, j1 + p, j2 + p
        at_end = i1 == i2 == len(old)  # an insertion after the end stays the tail
        kept = (spans[-1][1], i1) if spans else (i1, i1)
        pinned = any(a < kept[1] and b > kept[0] for a, b in protect)
        if spans and not at_end and i1 - spans[-1][1] < min_keep and not pinned:
            spans[-1][1], spans[-1][3] = i2, j2  # fold the short kept run into the edit
        else:
            spans.append([i1, i2, j1, j2])
    tail: list[int] = []
    if spans and spans[-1][1] == len(old):  # the edit reaching the end: cut there, append rest
        i1, _, j1, j2 = spans.pop()
        tail = new[j1:j2]
        if i1 < len(old):  # a deletion (nothing downstream to keep), then the tail
            spans.append([i1, len(old), j1, j1])
    directives = [Directive(i1, i2, tuple(new[j1:j2]), mode) for i1, i2, j1, j2 in spans]
    return directives, tail


def edits_and_feed(
    old: Sequence[int], new: Sequence[int], **options
) -> tuple[list[Directive], list[int]]:
    """`detect_edits(old, new, **options)` (`mode`, `min_keep`, `protect`), with a tail of at
    least one token: a turn's first output needs the
    logits of a token it feeds, so when the edits leave nothing to append (the new prompt ends
    in tokens the old list already held, or is the old list) the last token of `new` is cut by
    the edits and fed again. `apply_to_list(old, directives) + tail == list(new)` still holds."""
    ds, tail = detect_edits(old, new, **options)
    if tail or not new:
        return ds, tail
    ds, tail = detect_edits(old, list(new)[:-1], **options)
    return ds, tail + [int(new[-1])]


def strongest(modes) -> Mode:
    """FORGET if any of `modes` is FORGET (its guarantee covers an AMORTIZE edit's span too),
    else AMORTIZE."""
    return Mode.FORGET if any(m is Mode.FORGET for m in modes) else Mode.AMORTIZE


def compose(
    old: Sequence[int],
    prompt: Sequence[int],
    directives: Sequence[Directive] = (),
    *,
    mode: Mode = Mode.AMORTIZE,
    min_keep: int = MIN_KEEP,
    protect: Sequence[tuple[int, int]] = (),
) -> tuple[list[Directive], list[int]]:
    """A whole prompt with explicit `directives` in the prompt's own coordinates (a valid,
    sorted batch for `prompt`: `directives.validate`), against a session's tokens `old`:
    (directives in old's coordinates, a tail of at least one token) with
    `apply_to_list(old, ds) + tail == apply_to_list(prompt, directives)`.

    When the prompt extends `old` (the session's tokens are its prefix: the history re-sent
    as it was, plus the new turn), each directive is kept exactly, with its own mode: a
    directive inside `old` as given, one reaching past `old`'s end cut at that end (the part
    past it is the tail, which is prefilled anyway), one wholly in the tail applied to the tail.
    Otherwise (the harness also edited the history itself), or when that would leave nothing to
    feed, the edited prompt is diffed against `old` (`edits_and_feed`) in the strongest of
    `mode` and the directives' modes: an explicit FORGET keeps its guarantee, at the cost of
    re-prefilling from the first edit."""
    old, prompt = [int(t) for t in old], [int(t) for t in prompt]
    final = apply_to_list(prompt, directives)
    if not directives:
        return edits_and_feed(old, prompt, mode=mode, min_keep=min_keep, protect=protect)
    n = len(old)
    if prompt[:n] == old:
        inside = [d for d in directives if d.start < n]
        # each as given (its mode, sources, pin override), its end cut at old's end
        ds = [dataclasses.replace(d, end=min(d.end, n)) for d in inside]
        kept = len(apply_to_list(old, ds))
        tail = final[kept:]
        if tail and apply_to_list(old, ds) == final[:kept]:
            return ds, tail
    m = strongest([mode, *(d.mode for d in directives)])
    return edits_and_feed(old, final, mode=m, min_keep=min_keep, protect=protect)
