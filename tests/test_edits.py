"""Edit detection: the derived directives turn the cached list into the new prompt."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from leyline_jax.directives import Directive, Mode, apply_to_list, validate
from serve.edits import compose, detect_edits, edits_and_feed


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


@st.composite
def explicit(draw):
    """(old, prompt, directives in the prompt's coordinates): the prompt extends old (or, one
    time in three, edits it too), the directives a random valid batch over the prompt."""
    old = draw(st.lists(st.integers(0, 5), min_size=1, max_size=40))
    prompt = old + draw(st.lists(st.integers(0, 5), max_size=12))
    if draw(st.integers(0, 2)) == 0:
        i = draw(st.integers(0, len(prompt) - 1))
        prompt[i] = (prompt[i] + 1) % 6
    cuts = sorted(draw(st.lists(st.integers(0, len(prompt)), min_size=2, max_size=6, unique=True)))
    ds = []
    for a, b in zip(cuts[::2], cuts[1::2], strict=False):
        repl = tuple(draw(st.lists(st.integers(0, 5), max_size=5)))
        mode = draw(st.sampled_from([Mode.AMORTIZE, Mode.FORGET]))
        ds.append(Directive(a, b, repl, mode))
    ds = validate(ds, len(prompt), vocab_size=6)
    assume(apply_to_list(prompt, ds))
    return old, prompt, ds


@settings(max_examples=400, deadline=None)
@given(explicit(), st.sampled_from([Mode.AMORTIZE, Mode.FORGET]))
def test_compose_rebuilds_the_edited_prompt(case, mode):
    old, prompt, ds = case
    out, tail = compose(old, prompt, ds, mode=mode)
    assert len(tail) >= 1
    assert validate(out, len(old), vocab_size=6) == [d for d in out if not d.is_noop]
    assert apply_to_list(old, out) + tail == apply_to_list(prompt, ds)
    if prompt[: len(old)] != old:
        # the harness edited the history too: one diff, in the strongest mode asked
        if mode is Mode.FORGET or any(d.mode is Mode.FORGET for d in ds):
            assert all(d.mode is Mode.FORGET for d in out)
        return
    # the prompt extends old: every directive starting inside old is kept with its own mode
    # and span (cut at old's end) whenever something is left to feed
    inside = [(d.start, min(d.end, len(old)), d.mode) for d in ds if d.start < len(old)]
    if [(d.start, d.end, d.mode) for d in out] != inside:
        assert len(apply_to_list(old, [d for d in ds if d.start < len(old)])) == len(
            apply_to_list(prompt, ds)
        ), "the exact path was left although it had a tail to feed"


def test_compose_keeps_each_directives_mode_and_span():
    old = list(range(50))
    prompt = old + [90, 91]
    ds = [Directive(5, 10, (70,), Mode.FORGET), Directive(20, 30, (), Mode.AMORTIZE)]
    out, tail = compose(old, prompt, ds)
    assert [(d.start, d.end, d.replacement, d.mode) for d in out] == [
        (5, 10, (70,), Mode.FORGET),
        (20, 30, (), Mode.AMORTIZE),
    ]
    assert tail == [90, 91]
    # straddling the session's end: cut there, the rest is prefilled with the tail
    out, tail = compose(old, prompt, [Directive(45, 51, (80, 81), Mode.AMORTIZE)])
    assert [(d.start, d.end, d.replacement) for d in out] == [(45, 50, (80, 81))]
    assert tail == [91]
    # the history edited elsewhere too: one diff of the edited prompt, in the strongest mode
    edited = [99] + prompt[1:]
    out, tail = compose(old, edited, [Directive(20, 30, (), Mode.FORGET)])
    assert out[0].start == 0 and all(d.mode is Mode.FORGET for d in out)
    assert apply_to_list(old, out) + tail == apply_to_list(edited, [Directive(20, 30, ())])
