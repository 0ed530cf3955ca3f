"""Edit detection: the derived directives turn the cached list into the new prompt."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from leyline_jax.directives import Mode, apply_to_list, validate
from serve.edits import detect_edits, edits_and_feed


def test_stub_replacing_a_tool_output_is_one_directive_and_a_tail():
    system, tool, user = list(range(100, 140)), list(range(500, 800)), [7, 8, 9]
    old = system + tool + user + [1, 2]
    stub = [42, 43, 44]
    new = system + stub + user + [1, 2] + [60, 61, 62]
    ds, tail = detect_edits(old, new)
    assert [(d.start, d.end, d.replacement) for d in ds] == [(40, 340, (42, 43, 44))]
    assert tail == [60, 61, 62]
    assert ds[0].mode is Mode.AMORTIZE


def test_pure_extension_and_identity():
    assert detect_edits([1, 2, 3], [1, 2, 3, 4]) == ([], [4])
    assert detect_edits([1, 2, 3], [1, 2, 3]) == ([], [])


def test_short_kept_runs_fold_into_one_edit():
    old = list(range(100))
    new = old[:10] + [900, 901] + old[12:14] + [902] + old[15:]  # 2 kept tokens between edits
    ds, tail = detect_edits(old, new)
    assert len(ds) == 1 and (ds[0].start, ds[0].end) == (10, 15) and tail == []
    ds, _ = detect_edits(old, new, min_keep=1)
    assert len(ds) == 2  # without folding the two edits stay apart


def test_an_edit_at_the_end_is_a_deletion_and_tail():
    ds, tail = detect_edits([1, 2, 3, 4], [1, 2, 9])
    assert [(d.start, d.end, d.replacement) for d in ds] == [(2, 4, ())] and tail == [9]


@st.composite
def edited(draw):
    old = draw(st.lists(st.integers(0, 5), min_size=1, max_size=60))
    n = draw(st.integers(0, 4))
    cuts = sorted(draw(st.lists(st.integers(0, len(old)), min_size=2 * n, max_size=2 * n)))
    new, cursor = [], 0
    for a, b in zip(cuts[::2], cuts[1::2], strict=True):
        new += old[cursor:a] + draw(st.lists(st.integers(0, 5), max_size=8))
        cursor = b
    new += old[cursor:] + draw(st.lists(st.integers(0, 5), max_size=10))
    return old, new


@settings(max_examples=300, deadline=None)
@given(edited(), st.integers(1, 20))
def test_derived_directives_rebuild_the_new_prompt(case, min_keep):
    old, new = case
    ds, tail = detect_edits(old, new, min_keep=min_keep)
    assert validate(ds, len(old), vocab_size=6) == [d for d in ds if not d.is_noop]
    assert apply_to_list(old, ds) + tail == new
    # no directive inserts at the very end: anything after old's last kept token is tail
    assert not ds or ds[-1].start < len(old)


def test_a_prompt_ending_in_old_tokens_still_feeds_one():
    """The new prompt inserts before tokens the old list ends with (a reply that happens to end
    like the previous turn's output): the edits alone leave nothing to append. The tail then
    holds the last token, and everything else still comes from the directives (a replay once
    lost this tail and the session's tokens no longer matched its cache)."""
    old = list(range(40)) + [7, 8, 9]  # ... plus a previous turn's output
    new = list(range(40)) + [50, 51] + [7] + [52] * 20 + [8, 9]
    ds, tail = detect_edits(old, new)
    assert tail == [] and apply_to_list(old, ds) == new
    ds, tail = edits_and_feed(old, new)
    assert tail and tail[-1] == 9 and apply_to_list(old, ds) + tail == new
    # an unchanged prompt: its last token is cut and fed again
    ds, tail = edits_and_feed(old, old)
    assert [(d.start, d.end) for d in ds] == [(42, 43)] and tail == [9]


@settings(max_examples=300, deadline=None)
@given(edited(), st.integers(1, 20))
def test_edits_and_feed_always_feed_a_token(case, min_keep):
    old, new = case
    assume(new)  # an empty prompt is refused before edit detection
    ds, tail = edits_and_feed(old, new, min_keep=min_keep)
    assert len(tail) >= 1
    assert validate(ds, len(old), vocab_size=6) == [d for d in ds if not d.is_noop]
    assert apply_to_list(old, ds) + tail == new
