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

import difflib
from collections.abc import Sequence

from leyline_jax.directives import Directive, Mode

MIN_KEEP = 16


def detect_edits(
    old: Sequence[int],
    new: Sequence[int],
    *,
    mode: Mode = Mode.AMORTIZE,
    min_keep: int = MIN_KEEP,
) -> tuple[list[Directive], list[int]]:
    """(directives in `old`'s coordinates, tokens to append after them) with
    `apply_to_list(old, directives) + tail == list(new)`. The tail is everything `new` has
    after the last token of `old` it keeps: an edit reaching `old`'s end becomes a deletion of
    old's end plus the tail, so the new tokens go through the batched, chunked prefill rather
    than a directive's fill."""
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
        if spans and not at_end and i1 - spans[-1][1] < min_keep:
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
    old: Sequence[int],
    new: Sequence[int],
    *,
    mode: Mode = Mode.AMORTIZE,
    min_keep: int = MIN_KEEP,
) -> tuple[list[Directive], list[int]]:
    """`detect_edits`, with a tail of at least one token: a turn's first output needs the
    logits of a token it feeds, so when the edits leave nothing to append (the new prompt ends
    in tokens the old list already held, or is the old list) the last token of `new` is cut by
    the edits and fed again. `apply_to_list(old, directives) + tail == list(new)` still holds."""
    ds, tail = detect_edits(old, new, mode=mode, min_keep=min_keep)
    if tail or not new:
        return ds, tail
    ds, tail = detect_edits(old, list(new)[:-1], mode=mode, min_keep=min_keep)
    return ds, tail + [int(new[-1])]
