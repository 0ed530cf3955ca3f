"""The radix prefix cache (host bookkeeping): match, insert, split, evict, purge, references.

The reference is a plain dict from page-aligned token prefixes to the page that holds their last
page; hypothesis drives random inserts/matches/evictions/purges against it.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.radix import RadixCache

PS = 4


def toks(*pages):
    """Tokens of whole pages: page i is (v, v, v, v) for each value v given."""
    return [v for v in pages for _ in range(PS)]


def test_match_insert_split():
    r = RadixCache(PS)
    assert r.match(toks(1, 2, 3)) == ([], 0)
    assert r.insert(toks(1, 2, 3), [10, 11, 12]) == [10, 11, 12]
    assert r.match(toks(1, 2, 3, 4)) == ([10, 11, 12], 12)
    assert r.match(toks(1, 2) + [3, 3]) == ([10, 11], 8)  # a partial page never matches
    assert r.match(toks(1, 2, 3), max_tokens=9) == ([10, 11], 8)
    # a branch after two pages splits the edge; the shared pages are not taken again
    assert r.insert(toks(1, 2, 7), [20, 21, 22]) == [22]
    assert len(r) == 3  # (1,2) -> {(3), (7)}
    assert r.match(toks(1, 2, 7)) == ([10, 11, 22], 12)
    assert r.match(toks(1, 2, 3)) == ([10, 11, 12], 12)
    assert sorted(r.pages()) == [10, 11, 12, 22]
    assert r.insert(toks(1, 2), [30, 31]) == []  # already cached


def test_evict_lru_leaves_only_when_unreferenced():
    r = RadixCache(PS)
    r.insert(toks(1, 2, 3), [0, 1, 2])
    r.insert(toks(1, 2, 4), [0, 1, 3])
    r.insert(toks(5), [4])
    r.match(toks(1, 2, 3))  # (1,2,3) is now the most recently used
    refcount = np.ones(8, int)
    refcount[4] = 2  # a sequence also holds page 4: evicting it frees nothing
    out = r.evict(1, refcount)
    assert out == [3]  # the least recently used leaf whose pages only the tree holds
    out = r.evict(10, refcount)
    # (1,2,3) leaf, then its parent (1,2) once it is a leaf; page 4 is never evicted
    assert sorted(out) == [0, 1, 2] and r.pages() == [4]


def test_insert_that_splits_an_edge_stops_there():
    """Found by the property test below: inserting a path that leaves an edge mid-way splits
    the edge; the walk must stop at the split and not continue into the lower half's children
    (whose pages belong to another prefix)."""
    r = RadixCache(PS)
    r.insert(toks(0, 0), [0, 1])
    r.insert(toks(0, 0, 1), [0, 1, 2])
    assert r.insert(toks(0, 1), [5, 6]) == [6]  # (0) is cached; (0, 1) is new
    assert r.match(toks(0, 1)) == ([0, 6], 2 * PS)
    assert r.match(toks(0, 0, 1)) == ([0, 1, 2], 3 * PS)
    assert sorted(r.pages()) == [0, 1, 2, 6]


def test_purge_removes_the_path_from_the_page_of_start():
    r = RadixCache(PS)
    r.insert(toks(1, 2, 3, 4), [0, 1, 2, 3])
    r.insert(toks(1, 2, 3, 9), [0, 1, 2, 8])
    r.insert(toks(1, 6), [0, 5])
    # a FORGET at token 9 (inside page 2) of the sequence (1,2,3,4): pages from 2 on go,
    # including the (1,2,3,9) branch that shares page 2's tokens
    out = r.purge(toks(1, 2, 3, 4), 9)
    assert sorted(out) == [2, 3, 8]
    assert r.match(toks(1, 2, 3, 4)) == ([0, 1], 8)
    assert r.match(toks(1, 6)) == ([0, 5], 8)  # other branches stay
    assert r.purge(toks(7, 7), 0) == []  # not cached: nothing to do
    assert r.purge(toks(1, 2), 100) == []  # beyond what is cached


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "match", "evict", "purge"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=5),
            st.integers(0, 20),
        ),
        max_size=25,
    )
)
def test_against_a_dict_of_prefixes(ops):
    """Every cached prefix the tree returns is one that was inserted (and not purged or
    evicted) with the same pages; the tree holds each page once."""
    r = RadixCache(PS)
    model: dict[tuple, int] = {}  # page-aligned prefix -> page holding its last page
    next_page = 0
    for op, values, n in ops:
        t = toks(*values)
        if op == "insert":
            pages = list(range(next_page, next_page + len(values)))
            next_page += len(values)
            taken = r.insert(t, pages)
            for i in range(len(values)):
                key = tuple(t[: (i + 1) * PS])
                if key not in model:
                    model[key] = pages[i]
                    assert pages[i] in taken
        elif op == "match":
            pages, hit = r.match(t)
            assert hit == len(pages) * PS
            for i in range(len(pages)):
                assert model[tuple(t[: (i + 1) * PS])] == pages[i]
            # the match is the longest: the next page is not cached
            assert tuple(t[: hit + PS]) not in model or hit + PS > len(t)
        elif op == "evict":
            gone = set(r.evict(n, np.ones(next_page + 1, int)))
            model = {k: v for k, v in model.items() if v not in gone}
        else:  # purge from token n
            gone = set(r.purge(t, n))
            cut = n // PS
            if cut < len(values):  # the subtree under page `cut` of t's path goes
                head = tuple(t[: (cut + 1) * PS])
                model = {k: v for k, v in model.items() if k[: len(head)] != head}
            assert not gone & set(model.values())
        held = r.pages()
        assert len(held) == len(set(held)) and set(held) == set(model.values())


def _naive_evict(r: RadixCache, want: int, refcount) -> list[int]:
    """The eviction rule written plainly: rescan the whole tree for the least recently used
    leaf whose pages only the tree holds, drop it, repeat."""
    out: list[int] = []
    while len(out) < want:
        leaves = [
            n for n in r._nodes() if not n.children and all(refcount[p] == 1 for p in n.pages)
        ]
        if not leaves:
            break
        out += r._remove(min(leaves, key=lambda n: n.last_used))
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=12),
    st.lists(st.integers(0, 40), max_size=8),
    st.sets(st.integers(0, 60), max_size=10),
    st.integers(0, 30),
)
def test_heap_eviction_is_the_lru_rule(paths, touched, held, want):
    """The heap eviction drops exactly the pages, in the order, that rescanning the tree per
    eviction would (pages in `held` are also referenced by a sequence: not evictable)."""
    import copy

    r = RadixCache(PS)
    nxt = 0
    for values in paths:
        r.insert(toks(*values), list(range(nxt, nxt + len(values))))
        nxt += len(values)
    for i in touched:  # mark some paths recently used
        r.match(toks(*paths[i % len(paths)]))
    refcount = np.ones(nxt + 61, int)
    refcount[list(held)] = 2
    naive = copy.deepcopy(r)
    assert r.evict(want, refcount) == _naive_evict(naive, want, refcount)
    assert sorted(r.pages()) == sorted(naive.pages())
