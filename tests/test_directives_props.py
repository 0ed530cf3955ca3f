"""Property test: random directive batches interleaved with appends, forks and frees keep every
invariant of the paged state and agree with a plain list-of-tokens model (token ids, lengths,
positions). Invalid batches raise DirectiveError and leave the state bit-identical."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_kv_state_props import MAX_LEN, PAGE, SEQS, check_invariants, empty_state, snapshot

import leyline_jax as ll
from leyline_jax.directives import apply_to_list

# (start, width, replacement length, mode, in range?): starts are folded into the current
# length unless the last flag asks for a raw (possibly out-of-range) value
directive = st.tuples(
    st.integers(0, 30),
    st.integers(0, 8),
    st.integers(0, 6),
    st.sampled_from(list(ll.Mode)),
    st.booleans() | st.just(True),
)
ops = st.one_of(
    st.tuples(st.just("append"), st.integers(0, SEQS - 1), st.integers(1, 8)),
    st.tuples(
        st.just("edit"), st.integers(0, SEQS - 1), st.lists(directive, min_size=1, max_size=3)
    ),
    st.tuples(st.just("fork"), st.integers(0, SEQS - 1), st.integers(0, SEQS - 1)),
    st.tuples(st.just("free"), st.integers(0, SEQS - 1)),
)


def valid_batch(ds, length) -> bool:
    """Independent statement of DESIGN.md §2's validity rule."""
    if any(not 0 <= d.start <= d.end <= length for d in ds):
        return False
    real = sorted((d for d in ds if not d.is_noop), key=lambda d: (d.start, d.end))
    return all(
        a.end <= b.start and a.start != b.start for a, b in zip(real, real[1:], strict=False)
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(ops, min_size=3, max_size=14), seed=st.integers(0, 2**16))
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
                n = len(cur) if cur else 0
                ds = [
                    ll.Directive(
                        a % (n + 1) if fold else a,
                        (a % (n + 1) if fold else a) + w,
                        rng.integers(0, 256, r).tolist(),
                        mode,
                    )
                    for a, w, r, mode, fold in raw
                ]
                ok = cur is not None and valid_batch(ds, len(cur))
                new = apply_to_list(cur, ds) if ok else None
                ok = ok and 0 < len(new) <= MAX_LEN
                if not ok:
                    with pytest.raises(ll.DirectiveError):
                        ll.apply_directives(model, state, s, ds)
                    event("edit rejected")
                    raise _Rejected
                try:
                    state = ll.apply_directives(model, state, s, ds)
                except ll.OutOfPagesError:
                    # never needs more than rebuilding the whole sequence plus one copy
                    assert free < -(-len(new) // PAGE) + 1
                    event("edit out of pages")
                    raise _Rejected from None
                seqs[s] = new
                forget = any(d.mode is ll.Mode.FORGET for d in ds)
                event(f"edit applied ({'forget' if forget else 'amortize only'})")
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
