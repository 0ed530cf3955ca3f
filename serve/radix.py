"""The radix prefix cache: token-id prefixes -> the KV pages that hold them.

Host-side bookkeeping only (plain Python); the engine applies what it returns to the paged
state (`leyline_jax.paged.retain` / `release`), so the tree holds exactly one reference to
each page it lists and a page is freed only when no sequence references it either.

Granularity is the page: a node's edge is a run of whole pages (its key is `page_size` tokens
per page), so a cache hit hands a sequence full pages it never writes, and a page never mixes
the tokens of two edges. Edges split at page boundaries. Leaves whose pages nobody else holds
are evicted least recently used first.

What may enter the tree is the caller's business: the engine inserts only KV a fresh prefill of
the same tokens would give (never AMORTIZE-spliced KV, which belongs to its session lineage),
and purges the path of a FORGET-edited sequence from the first evicted token on.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "last_used")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None):
        self.key = key  # tokens of this edge: len(pages) * page_size of them
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}  # first page's tokens -> child
        self.parent = parent
        self.last_used = 0


class RadixCache:
    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.root = _Node((), [], None)
        self._clock = itertools.count(1)

    # ---- helpers ------------------------------------------------------------------------
    def _page(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        ps = self.page_size
        return tuple(int(t) for t in tokens[i * ps : (i + 1) * ps])

    def _common_pages(self, node: _Node, tokens: Sequence[int], first: int) -> int:
        """How many of `node`'s pages equal the token pages first, first+1, ... of `tokens`."""
        n = 0
        for j in range(len(node.pages)):
            page = self._page(tokens, first + j)
            if len(page) < self.page_size or page != self._page(node.key, j):
                break
            n += 1
        return n

    def _split(self, node: _Node, k: int) -> _Node:
        """Split `node`'s edge after k pages; returns the upper half (now `node`'s parent)."""
        ps = self.page_size
        upper = _Node(node.key[: k * ps], node.pages[:k], node.parent)
        upper.last_used = node.last_used
        node.parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[k * ps :], node.pages[k:], upper
        upper.children[node.key[:ps]] = node
        return upper

    def _walk(self, tokens: Sequence[int]):
        """Yield (node, first page index, common pages) along the path of `tokens`."""
        node, first = self.root, 0
        while True:
            child = node.children.get(self._page(tokens, first))
            if child is None:
                return
            k = self._common_pages(child, tokens, first)
            whole = k == len(child.pages)  # decided before the caller may split `child`
            yield child, first, k
            if not whole:
                return
            node, first = child, first + k

    # ---- public -------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> tuple[list[int], int]:
        """Longest cached prefix of `tokens` in whole pages (at most `max_tokens` tokens):
        (its pages, its length in tokens). Marks the path recently used."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        pages: list[int] = []
        now = next(self._clock)
        for node, _, k in self._walk(tokens[: limit - limit % self.page_size]):
            node.last_used = now
            pages += node.pages[:k]
        return pages, len(pages) * self.page_size

    def peek(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """`match` without marking the path used: (pages, tokens) of the longest cached prefix."""
        pages: list[int] = []
        for node, _, k in self._walk(tokens[: len(tokens) - len(tokens) % self.page_size]):
            pages += node.pages[:k]
        return pages, len(pages) * self.page_size

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache `tokens` (len(pages) whole pages) held in `pages`. Returns the pages the tree
        newly holds (the caller takes one reference to each); pages of prefixes already cached
        are not taken (the tree keeps its own)."""
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(f"{len(tokens)} tokens do not fill {len(pages)} pages of {ps}")
        now = next(self._clock)
        node, first = self.root, 0
        for child, first_, k in self._walk(tokens):
            child.last_used = now
            node, first = (self._split(child, k) if k < len(child.pages) else child), first_ + k
        if first == len(pages):
            return []
        leaf = _Node(tuple(int(t) for t in tokens[first * ps :]), list(pages[first:]), node)
        leaf.last_used = now
        node.children[leaf.key[:ps]] = leaf
        return list(leaf.pages)

    def evict(self, want: int, refcount: Sequence[int]) -> list[int]:
        """Drop least recently used leaves whose pages only the tree references (refcount 1)
        until `want` pages would be freed or none is left. Returns the pages to release.

        One walk of the tree collects the evictable leaves into a heap keyed by last use;
        each eviction pops the oldest, and a parent left childless (and evictable) joins the
        heap: O(n + k log n) for k evictions, not a rescan of the tree per eviction."""

        def evictable(n: _Node) -> bool:
            return not n.children and all(refcount[p] == 1 for p in n.pages)

        order = itertools.count()  # ties: no comparison of nodes
        heap = [(n.last_used, next(order), n) for n in self._nodes() if evictable(n)]
        heapq.heapify(heap)
        out: list[int] = []
        while len(out) < want and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            out += self._remove(leaf)
            if parent is not self.root and evictable(parent):
                heapq.heappush(heap, (parent.last_used, next(order), parent))
        return out

    def clear(self) -> list[int]:
        """Forget everything; returns every page the tree held (the caller releases them)."""
        out = self.pages()
        self.root.children.clear()
        return out

    def purge(self, tokens: Sequence[int], start: int) -> list[int]:
        """Forget every cached page on the path of `tokens` from the page holding token
        `start` on (the KV of everything after `start` was computed with tokens[start]...).
        Returns the pages to release."""
        cut = start // self.page_size
        for node, first, k in self._walk(tokens):
            if first + k > cut:  # this edge holds page `cut` of the path
                if cut > first:
                    self._split(node, cut - first)  # `node` keeps the pages from `cut` on
                return self._remove(node)
        return []

    def _remove(self, node: _Node) -> list[int]:
        """Detach `node` and its subtree; returns their pages."""
        del node.parent.children[node.key[: self.page_size]]
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out += n.pages
            stack += n.children.values()
        return out

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack += n.children.values()

    def pages(self) -> list[int]:
        """Every page the tree holds."""
        return [p for n in self._nodes() for p in n.pages]

    def __len__(self) -> int:
        return sum(1 for _ in self._nodes())
