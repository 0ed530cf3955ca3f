"""Property test: random directive batches of all four modes interleaved with appends, forks
and frees keep every invariant of the paged state and agree with a plain list-of-tokens model
(token ids, lengths, positions; DECAY through the positions it reports keeping). Invalid batches
raise DirectiveError and leave the state bit-identical."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from test_kv_state_props import MAX_LEN, PAGE, SEQS, check_invariants, empty_state, snapshot

import leyline_jax as ll

M = ll.Mode
# a MOVE source: (position, length, tokens before it in the replacement, corruption): the
# source copies the sequence's tokens unless corrupted ("token": one copied token changed;
# "shift": the position one on from the copied tokens; "past": placed to end past the sequence)
source = st.tuples(
    st.integers(0, 30),
    st.integers(1, 4),
    st.integers(0, 2),
    st.sampled_from([None] * 7 + ["token", "shift", "past"]),
)
# (start, width, replacement length, mode, in range?, DECAY budget, MOVE sources): spans are
# folded into the current length unless the flag asks for raw (possibly out-of-range) values
directive = st.tuples(
    st.integers(0, 30),
    st.integers(0, 8),
    st.integers(0, 6),
    st.sampled_from([M.AMORTIZE, M.FORGET, M.DECAY, M.DECAY, M.MOVE, M.MOVE, M.MOVE]),
    st.sampled_from([True] * 7 + [False]),
    st.integers(-1, 9),
    st.lists(source, min_size=1, max_size=2),
)
step_of = {
    "edit": st.tuples(
        st.just("edit"),
        st.sampled_from([0, 1, 0, 1, 0, 1, 2, 3]),  # mostly the two sequences opened first
        st.lists(directive, min_size=1, max_size=3),
    ),
    "append": st.tuples(st.just("append"), st.integers(0, SEQS - 1), st.integers(1, 8)),
    "fork": st.tuples(st.just("fork"), st.integers(0, SEQS - 1), st.integers(0, SEQS - 1)),
    "free": st.tuples(st.just("free"), st.integers(0, SEQS - 1)),
}
# edits half the steps (one_of would weigh its branches alike, and drops repeated ones)
ops = st.sampled_from(["edit"] * 3 + ["append", "fork", "free"]).flatmap(step_of.__getitem__)


SRC = (0, 1, 0, None)  # a drawn source, for hand-written examples (only MOVE reads them)


def make_directive(raw, cur, rng):
    """The drawn directive against the sequence `cur` (None: not open)."""
    a, w, r, mode, fold, budget, srcs = raw
    n = len(cur) if cur else 0
    start = a % (n + 1) if fold else a
    w = min(w, n - start) if fold else w
    rep = rng.integers(0, 256, r).tolist()
    if mode is M.DECAY:
        return ll.Directive(start, start + w, rep, mode, budget=budget)
    if mode is not M.MOVE:
        return ll.Directive(start, start + w, rep, mode)
    rep, sources = [], []
    for pos, length, gap, corrupt in srcs:
        rep += rng.integers(0, 256, gap).tolist()
        p = pos % n if n else pos
        length = max(1, min(length, n - p))
        chunk = list(cur[p : p + length]) if cur else rng.integers(0, 256, length).tolist()
        if corrupt == "token":
            chunk[-1] = (chunk[-1] + 1) % 256
        at = {"shift": p + 1, "past": max(n - length + 1, 0)}.get(corrupt, p)
        sources.append(ll.Source(len(rep), at, length))
        rep += chunk
    return ll.Directive(
        start, start + w, rep + rng.integers(0, 256, r // 2).tolist(), mode, sources=sources
    )


def noop(d) -> bool:
    """Replaces nothing by nothing (a DECAY is an edit: what it keeps is chosen later)."""
    return d.start == d.end and not d.replacement and d.mode is not M.DECAY


def valid_batch(ds, tokens) -> bool:
    """Independent statement of the validity rule: in range; edits (no-ops aside) disjoint with
    distinct starts; every MOVE source is the sequence's own tokens, wholly before the batch's
    first FORGET (from there on the KV was computed with tokens the FORGET evicts). A DECAY
    names no source: past a FORGET it is text, re-prefilled with the rest."""
    length = len(tokens)
    if any(not 0 <= d.start <= d.end <= length for d in ds):
        return False
    real = sorted((d for d in ds if not noop(d)), key=lambda d: (d.start, d.end))
    if any(a.end > b.start or a.start == b.start for a, b in zip(real, real[1:], strict=False)):
        return False
    cut = min([d.start for d in real if d.mode is M.FORGET], default=length)
    return all(
        x.position + x.length <= cut
        and list(tokens[x.position : x.position + x.length])
        == list(d.replacement[x.offset : x.offset + x.length])
        for d in real
        for x in d.sources
    )


def kept_count(d) -> int:
    return min(d.budget, d.end - d.start) if d.mode is M.DECAY else 0


def new_length(tokens, ds) -> int:
    return len(tokens) + sum(
        len(d.replacement) + kept_count(d) - (d.end - d.start) for d in ds if not noop(d)
    )


def edited(tokens, ds, kept) -> list[int]:
    """The list model: each edit's span replaced by its replacement, a DECAY's by the tokens it
    kept (`kept`, positions before the batch) followed by its replacement."""
    out, cursor = [], 0
    for d in sorted((d for d in ds if not noop(d)), key=lambda d: d.start):
        keep = [tokens[p] for p in kept if d.start <= p < d.end] if d.mode is M.DECAY else []
        out += list(tokens[cursor : d.start]) + keep + list(d.replacement)
        cursor = d.end
    return out + list(tokens[cursor:])


def check_applied(applied, tokens, ds, new) -> None:
    """DECAY keeps exactly min(budget, width) of its span, sorted; the report adds up; `moved`
    counts the MOVE sources and DECAY's kept tokens spliced before the first FORGET."""
    real = sorted((d for d in ds if not noop(d)), key=lambda d: d.start)
    kept = list(applied.kept)
    assert kept == sorted(set(kept))
    decays = [d for d in real if d.mode is M.DECAY]
    assert all(any(d.start <= p < d.end for d in decays) for p in kept)
    for d in decays:
        assert sum(d.start <= p < d.end for p in kept) == kept_count(d)
    assert applied.length == len(new)
    assert applied.reused + applied.spliced + applied.prefilled == len(new)
    cut = min([d.start for d in real if d.mode is M.FORGET], default=len(tokens))
    before = [d for d in real if d.end <= cut]
    assert applied.moved == sum(sum(x.length for x in d.sources) + kept_count(d) for d in before)
    assert applied.moved <= applied.spliced


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(ops, min_size=6, max_size=20), seed=st.integers(0, 2**16))
# a DECAY past the batch's FORGET is text re-prefilled with the rest (nothing of it moves)
@example(
    steps=[("edit", 0, [(0, 2, 1, M.FORGET, True, 0, [SRC]), (6, 3, 0, M.DECAY, True, 2, [SRC])])],
    seed=0,
)
def test_directives_keep_invariants(small_model, steps, seed):
    model = small_model
    rng = np.random.default_rng(seed)
    state = empty_state(model)
    seqs: dict[int, list[int]] = {}
    for step in [("append", 0, 12), ("fork", 0, 1), *steps]:
        before = snapshot(state)
        free = int((np.asarray(state.refcount) == 0).sum())
        kind = step[0]
        try:
            if kind == "append":
                _, s, n = step
                toks = rng.integers(0, 256, n).tolist()
                state, _ = ll.prefill(model, state, s, toks)
                seqs.setdefault(s, []).extend(toks)
            elif kind == "edit":
                _, s, raw = step
                cur = seqs.get(s)
                if any(x[3] is M.DECAY and x[5] < 0 for x in raw):
                    with pytest.raises(ll.DirectiveError, match="budget"):
                        [make_directive(x, cur, rng) for x in raw]
                    event("edit rejected (negative budget)")
                    raise _Rejected
                ds = [make_directive(x, cur, rng) for x in raw]
                ok = cur is not None and valid_batch(ds, cur)
                n_new = new_length(cur, ds) if ok else 0
                if not (ok and 0 < n_new <= MAX_LEN):
                    with pytest.raises(ll.DirectiveError):
                        ll.apply_directives(model, state, s, ds)
                    why = "not open" if cur is None else "invalid" if not ok else "length"
                    event(f"edit rejected ({why})")
                    raise _Rejected
                try:
                    state, applied = ll.apply_directives(model, state, s, ds, report=True)
                except ll.OutOfPagesError:
                    # never needs more than rebuilding the whole sequence plus one copy
                    assert free < -(-n_new // PAGE) + 1
                    event("edit out of pages")
                    raise _Rejected from None
                new = edited(cur, ds, applied.kept)
                assert len(new) == n_new
                check_applied(applied, cur, ds, new)
                seqs[s] = new
                for mode in {d.mode for d in ds if not noop(d)}:
                    event(f"edit applied with {mode.name}")
                if applied.moved:
                    event("edit moved KV (MOVE or DECAY)")
            elif kind == "fork":
                _, a, b = step
                state = ll.fork(state, a, b)
                seqs[b] = list(seqs[a])
            else:
                state = ll.free(state, step[1])
                seqs.pop(step[1])
        except (ll.SequenceError, ll.OutOfPagesError, _Rejected):
            for x, y in zip(snapshot(state), before, strict=True):
                np.testing.assert_array_equal(x, y)
            continue
        check_invariants(state, seqs)
        np.testing.assert_array_equal(
            np.asarray(state.positions), np.asarray(state.lengths)
        )  # next position = length


class _Rejected(Exception):
    """A step the test expected (and saw) rejected."""


def test_snapshot_helper_sees_changes(small_model):
    """The bit-identity check above can fail: any applied edit changes the snapshot."""
    state = empty_state(small_model)
    state, _ = ll.prefill(small_model, state, 0, [1, 2, 3, 4, 5])
    before = snapshot(state)
    state = ll.apply_directive(small_model, state, 0, ll.Directive(1, 2, [9, 9]))
    assert any(not np.array_equal(x, y) for x, y in zip(snapshot(state), before, strict=True))
    assert jax.tree.structure(state) is not None
