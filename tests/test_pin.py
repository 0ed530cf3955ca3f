"""PIN and MOVE bookkeeping on the host: radix pins (pin/unpin/evict/purge), the radix content
index (`locate`), and pinned messages in the policies.

The property test drives random inserts/pins/unpins/evictions/purges against a dict of pin
counts and a refcount list kept as the engine keeps it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.policies import STUB, ClearToolUses, Truncate
from serve.radix import RadixCache
from tests.test_policies_traces import conv, tool_contents

PS = 4


def toks(*pages):
    """Tokens of whole pages: page i is (v, v, v, v) for each value v given."""
    return [v for v in pages for _ in range(PS)]


def page(v):
    return (v,) * PS


def ones(n=64):
    return np.ones(n, int)


# ---- radix pins ---------------------------------------------------------------------------


def test_a_pinned_prefix_survives_eviction_and_rejoins_lru_once_unpinned():
    r = RadixCache(PS)
    r.insert(toks(1, 2, 3), [0, 1, 2])
    r.insert(toks(5, 6), [3, 4])
    r.insert(toks(7), [5])
    assert r.pin(toks(1, 2, 9)) == [0, 1]  # the cached part of the path: (1, 2)
    assert len(r) == 4  # the edge (1,2,3) split at the pinned boundary
    assert sorted(r.pinned_pages()) == [0, 1]
    # every other evictable leaf goes, and (1,2) would be next once (3) is gone: it stays
    assert sorted(r.evict(100, ones())) == [2, 3, 4, 5]
    assert r.pages() == [0, 1] and r.evict(100, ones()) == []
    # unpinned, it is an ordinary leaf again, evicted least recently used first
    r.insert(toks(8), [6])
    r.match(toks(8))  # (8) is now more recent than (1, 2)
    assert r.unpin(toks(1, 2)) == [0, 1] and r.pinned_pages() == []
    assert r.evict(1, ones()) == [0, 1]
    assert r.pages() == [6]


def test_pins_nest_per_page_and_bad_unpins_change_nothing():
    r = RadixCache(PS)
    r.insert(toks(1, 2, 3), [0, 1, 2])
    r.insert(toks(5), [3])
    assert r.pin(toks(1, 2, 3), n_tokens=9) == [0, 1]  # 9 tokens: two whole pages
    assert r.pin(toks(1, 2, 3)) == [0, 1, 2]
    assert r.unpin(toks(1, 2, 3)) == [0, 1, 2]  # (1,2) still pinned once, (3) not
    assert sorted(r.pinned_pages()) == [0, 1]
    before = (len(r), sorted(r.pages()))
    with pytest.raises(ValueError, match="not pinned"):
        r.unpin(toks(1, 2, 3))  # page (3) is not pinned: nothing changes, (1,2) included
    with pytest.raises(ValueError, match="not pinned"):
        r.unpin(toks(5))
    assert (len(r), sorted(r.pages())) == before and sorted(r.pinned_pages()) == [0, 1]
    assert sorted(r.evict(100, ones())) == [2, 3]
    assert r.unpin(toks(1, 2)) == [0, 1] and r.pinned_pages() == []
    with pytest.raises(ValueError, match="not pinned"):
        r.unpin(toks(1, 2))
    assert r.pin(toks(9)) == [] and r.unpin(toks(9)) == []  # nothing cached on that path


def test_unpin_of_a_prefix_of_a_pinned_edge_splits_it_without_changing_anything_else():
    r = RadixCache(PS)
    r.insert(toks(1, 2, 3), [0, 1, 2])
    r.insert(toks(4), [3])
    with pytest.raises(ValueError):
        r.unpin(toks(1, 2))  # would split (1,2,3) if it went ahead: it does not
    assert len(r) == 2
    r.pin(toks(1, 2, 3))
    assert r.unpin(toks(1)) == [0]  # only the first page loses its pin
    assert sorted(r.pinned_pages()) == [1, 2] and len(r) == 3


def test_pins_survive_a_later_split_by_insert():
    r = RadixCache(PS)
    r.insert(toks(1, 2, 3), [0, 1, 2])
    r.pin(toks(1, 2, 3))
    assert r.insert(toks(1, 2, 9), [7, 8, 9]) == [9]  # splits the pinned edge after (1, 2)
    assert sorted(r.pinned_pages()) == [0, 1, 2]
    assert r.evict(100, ones()) == [9]
    assert r.unpin(toks(1, 2, 3)) == [0, 1, 2]
    assert sorted(r.evict(100, ones())) == [0, 1, 2]


def test_evict_still_needs_refcount_one_for_unpinned_pages():
    r = RadixCache(PS)
    r.insert(toks(1, 2), [0, 1])
    refcount = ones()
    refcount[1] = 2  # a sequence holds page 1
    assert r.evict(100, refcount) == []


def test_forget_beats_a_pin():
    r = RadixCache(PS)
    r.insert(toks(1, 2, 3), [0, 1, 2])
    r.insert(toks(4), [3])
    r.pin(toks(1, 2, 3))
    r.pin(toks(4))
    assert sorted(r.purge(toks(1, 2, 3), 5)) == [1, 2]  # from the page of token 5 on
    assert sorted(r.pinned_pages()) == [0, 3]
    assert r.locate(page(2)) is None and r.locate(page(3)) is None
    assert r.unpin(toks(1, 2, 3)) == [0]  # unpins only what is still cached
    assert sorted(r.clear()) == [0, 3]
    assert r.pinned_pages() == [] and r.locate(page(4)) is None


# ---- radix content index ------------------------------------------------------------------


def test_locate_finds_pages_at_their_positions_through_splits():
    r = RadixCache(PS)
    r.insert(toks(1, 2, 3), [10, 11, 12])
    assert r.locate(page(2)) == (11, 4) and r.locate(page(3)) == (12, 8)
    assert r.locate(page(9)) is None
    assert r.locate([1, 1, 1, 2]) is None  # the whole page must match
    with pytest.raises(ValueError, match="one page"):
        r.locate((1,) * (PS + 1))
    # a split: the lower half (3) now starts its own edge, still at token 8
    r.insert(toks(1, 2, 7), [20, 21, 22])
    assert r.locate(page(3)) == (12, 8) and r.locate(page(7)) == (22, 8)
    assert r.locate(page(1)) == (10, 0) and r.locate(page(2)) == (11, 4)
    r.pin(toks(1))  # a pin's split too
    assert r.locate(page(2)) == (11, 4) and r.locate(page(3)) == (12, 8)


def test_locate_prefers_the_most_recently_used_copy_and_forgets_what_goes():
    r = RadixCache(PS)
    r.insert(toks(1, 2, 3), [10, 11, 12])
    r.insert(toks(2), [30])  # the same tokens as page 11, at position 0
    assert r.locate(page(2)) == (30, 0)  # inserted last
    r.match(toks(1, 2))
    assert r.locate(page(2)) == (11, 4)
    assert r.locate(page(2)) == (11, 4)  # locate does not mark anything used
    r.touch(30)
    assert r.locate(page(2)) == (30, 0)
    assert r.evict(1, ones()) == [10, 11, 12]  # (1,2,3) is the older leaf now: it goes
    assert r.locate(page(3)) is None and r.locate(page(2)) == (30, 0)
    r.insert(toks(1, 2, 3), [40, 41, 42])
    assert r.locate(page(2)) == (41, 4)
    assert sorted(r.purge(toks(1, 2, 3), 4)) == [41, 42]  # splits (1,2,3) after (1)
    assert r.locate(page(2)) == (30, 0) and r.locate(page(1)) == (40, 0)
    assert sorted(r.clear()) == [30, 40]
    assert r.locate(page(2)) is None and r.locate(page(1)) is None


# ---- the property test ----------------------------------------------------------------------


OPS = ["insert", "insert", "pin", "pin", "unpin", "evict", "evict", "purge", "release"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(OPS),
            st.lists(st.integers(0, 1), min_size=1, max_size=5),
            st.integers(0, 24),
            st.booleans(),
        ),
        min_size=4,
        max_size=40,
    )
)
def test_pins_against_a_dict_and_an_engine_refcount(ops):
    """Pinned pages are never evicted; every evicted page had refcount 1 (the tree's own
    reference); the pinned pages are exactly those the reference counts; `locate` answers a
    page with those tokens at the position where it was cached, or None when none is held."""
    r = RadixCache(PS)
    refcount = [0] * 200
    pins: dict[int, int] = {}  # page -> pin count
    where: dict[int, tuple[tuple, int]] = {}  # page the tree took -> (its tokens, position)
    live: list[list[int]] = []  # pages held by running sequences
    nxt = 0
    for op, values, n, hold in ops:
        t = toks(*values)
        covered = r.peek(t[: n - n % PS])[0]  # what pin/unpin with n_tokens=n cover
        if op == "insert":  # as the engine: match, allocate the rest, insert, maybe finish
            hit, _ = r.match(t)
            fresh = list(range(nxt, nxt + len(values) - len(hit)))
            nxt += len(fresh)
            seq = hit + fresh
            for p in hit:
                refcount[p] += 1
            for p in fresh:
                refcount[p] = 1
            for p in r.insert(t, seq):
                refcount[p] += 1
                where[p] = (tuple(t[seq.index(p) * PS :][:PS]), seq.index(p) * PS)
            if hold:
                live.append(seq)
            else:
                for p in seq:
                    refcount[p] -= 1
        elif op == "release" and live:
            for p in live.pop(0):
                refcount[p] -= 1
        elif op == "pin":
            assert r.pin(t, n) == covered
            for p in covered:
                pins[p] = pins.get(p, 0) + 1
        elif op == "unpin":
            before = (len(r), sorted(r.pinned_pages()))
            if any(pins.get(p, 0) == 0 for p in covered):
                with pytest.raises(ValueError):
                    r.unpin(t, n)
                assert (len(r), sorted(r.pinned_pages())) == before
            else:
                assert r.unpin(t, n) == covered
                for p in covered:
                    pins[p] -= 1
        elif op == "evict":
            out = r.evict(n, refcount)
            for p in out:
                assert pins.get(p, 0) == 0 and refcount[p] == 1
                refcount[p] -= 1
                del where[p]
        elif op == "purge":
            for p in r.purge(t, n):
                refcount[p] -= 1
                pins.pop(p, None)
                del where[p]
        held = r.pages()
        assert sorted(held) == sorted(where) and all(refcount[p] >= 1 for p in held)
        assert sorted(r.pinned_pages()) == sorted(p for p, c in pins.items() if c)
        counts = {p: node.pins for node in r._nodes() for p in node.pages if node.pins}
        assert counts == {p: c for p, c in pins.items() if c}  # the counts, not only which
        for v in range(2):
            found = r.locate(page(v))
            if found is None:
                assert all(key != page(v) for key, _ in where.values())
            else:
                assert where[found[0]] == (page(v), found[1])


# ---- policies -------------------------------------------------------------------------------


def pin_tools(msgs, *which):
    """Mark the tool messages numbered `which` (0 = oldest) pinned."""
    tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
    for w in which:
        msgs[tools[w]]["pinned"] = True
    return msgs


def test_truncate_never_stubs_a_pinned_tool_output():
    m = pin_tools(conv(5), 0)
    out = Truncate(keep=2).apply("s", m)
    stubbed = [c == STUB for c in tool_contents(out)]
    assert stubbed == [False, True, True, False, False]  # keep counts every tool turn
    out = Truncate(keep=2).apply("s", pin_tools(conv(5), 3))
    assert [c == STUB for c in tool_contents(out)] == [True, True, True, False, False]


def test_clear_tool_uses_never_clears_a_pinned_tool_output():
    p = ClearToolUses(trigger_tool_uses=1, keep=1)
    m = pin_tools(conv(4), 0)
    out = p.apply("s", m)
    assert [c == STUB for c in tool_contents(out)] == [False, True, True, False]
    assert p.applied("s", m)[0] == 2  # the pinned one is not counted as cleared
    # clear_at_least counts only what would be cleared: two outputs of 50 words are too few
    q = ClearToolUses(trigger_tool_uses=1, keep=1, clear_at_least=150)
    assert STUB not in tool_contents(q.apply("s", pin_tools(conv(4), 0, 1)))
    assert STUB in tool_contents(q.apply("s", conv(4)))


def test_clear_tool_uses_leaves_pinned_messages_whole_even_if_cleared_before():
    p = ClearToolUses(trigger_tool_uses=1, keep=1, clear_tool_inputs=True)
    assert tool_contents(p.apply("s", conv(4)))[:3] == [STUB] * 3
    m = pin_tools(conv(4), 0)  # tool 0 pinned after it was cleared
    m[4]["pinned"] = True  # the assistant message that called tool 1 (tool 1 is not pinned)
    out = p.apply("s", m)
    whole = tool_contents(conv(4))
    assert tool_contents(out) == [whole[0], STUB, STUB, whole[3]]
    args = [x["tool_calls"][0]["function"]["arguments"] for x in out if x.get("tool_calls")]
    assert args == ['{"arg": "x"}', '{"arg": "x"}', "{}", '{"arg": "x"}']
    # two outputs cleared, 63 - 7 tokens each (249 and 28 characters at 4 per token), and one
    # call's arguments blanked, 3 - 1 tokens ('{"arg": "x"}' is 12 characters, "{}" is 2)
    assert p.applied("s", m) == (2, 2 * 56 + 2)
    assert tool_contents(p.apply("s", conv(4)))[:3] == [STUB] * 3  # unpinned: cleared again
