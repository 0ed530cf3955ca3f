"""The radix prefix cache: token-id prefixes -> the KV pages that hold them.

Host-side bookkeeping only (plain Python); the engine applies what it returns to the paged
state (`leyline_jax.allocator.retain` / `release`): the tree holds one reference to each page
it lists, and a page is freed only when no sequence references it either.

Granularity is the page: a node's edge is a run of whole pages (its key is `page_size` tokens
per page), so a cache hit hands a sequence full pages it never writes, and a page never mixes
the tokens of two edges. Edges split at page boundaries. Leaves whose pages nobody else holds
are evicted least recently used first.

Pins (PIN): `pin` holds the cached pages on a path against eviction, with a count per node
(pins nest; `unpin` undoes one); a pinned node and its ancestors are never evicted. FORGET
beats a pin: `purge` and `clear` drop pinned pages too, pins included.

Content index (MOVE): `locate` finds a cached page by its tokens alone, wherever on a path it
sits, so KV computed at one position can be moved to another instead of prefilled.

What may enter a tree is the caller's business (`serve.engine.caches`: the shared tree holds
only KV a fresh prefill gives, a lineage's private tree its MOVE sessions' KV; a FORGET purges
the edited path from the first evicted token on).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "last_used", "start", "pins")

    def __init__(
        self, key: tuple[int, ...], pages: list[int], parent: _Node | None, start: int = 0
    ):
        self.key = key  # tokens of this edge: len(pages) * page_size of them
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}  # first page's tokens -> child
        self.parent = parent
        self.last_used = 0
        self.start = start  # pages on the path above this edge
        self.pins = 0  # pin count, the same for every page of the edge


class RadixCache:
    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.root = _Node((), [], None)
        self._clock = itertools.count(1)
        # content index: a page's tokens -> the pages holding them; page -> (node, index)
        self._by_tokens: dict[tuple[int, ...], set[int]] = {}
        self._at: dict[int, tuple[_Node, int]] = {}

    def _page(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(int(t) for t in tokens[i * self.page_size : (i + 1) * self.page_size])

    def _common_pages(self, node: _Node, tokens: Sequence[int], first: int) -> int:
        """How many of `node`'s pages equal the token pages first, first+1, ... of `tokens`."""
        n = 0
        for j in range(len(node.pages)):
            page = self._page(tokens, first + j)
            if len(page) < self.page_size or page != self._page(node.key, j):
                break
            n += 1
        return n

    def _index(self, node: _Node) -> None:
        """Enter (or re-enter, after a split) `node`'s pages in the content index."""
        for j, p in enumerate(node.pages):
            self._at[p] = (node, j)
            self._by_tokens.setdefault(self._page(node.key, j), set()).add(p)

    def _unindex(self, node: _Node) -> None:
        """Take `node`'s pages out of the content index (they leave the tree)."""
        for j, p in enumerate(node.pages):
            del self._at[p]
            key = self._page(node.key, j)
            self._by_tokens[key].discard(p)
            if not self._by_tokens[key]:
                del self._by_tokens[key]

    def _split(self, node: _Node, k: int) -> _Node:
        """Split `node`'s edge after k pages; returns the upper half (now `node`'s parent).
        Both halves keep the edge's pins and last use."""
        ps = self.page_size
        upper = _Node(node.key[: k * ps], node.pages[:k], node.parent, node.start)
        upper.last_used, upper.pins = node.last_used, node.pins
        node.parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[k * ps :], node.pages[k:], upper
        node.start += k
        upper.children[node.key[:ps]] = node
        self._index(upper)
        self._index(node)
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

    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> tuple[list[int], int]:
        """Longest cached prefix of `tokens` in whole pages (at most `max_tokens` tokens):
        (its pages, its length in tokens). Marks the path recently used."""
        pages: list[int] = []
        now = next(self._clock)
        for node, k in self._covered(tokens, max_tokens):
            node.last_used = now
            pages += node.pages[:k]
        return pages, len(pages) * self.page_size

    def peek(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """`match` without marking the path used: (pages, tokens) of the longest cached prefix."""
        pages = [p for node, k in self._covered(tokens, None) for p in node.pages[:k]]
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
        leaf = _Node(tuple(int(t) for t in tokens[first * ps :]), list(pages[first:]), node, first)
        leaf.last_used = now
        node.children[leaf.key[:ps]] = leaf
        self._index(leaf)
        return list(leaf.pages)

    def _covered(self, tokens: Sequence[int], n_tokens: int | None) -> list[tuple[_Node, int]]:
        """(node, pages of it covered) along the longest cached page-aligned prefix of
        `tokens` (at most `n_tokens` tokens)."""
        limit = len(tokens) if n_tokens is None else min(n_tokens, len(tokens))
        return [(n, k) for n, _, k in self._walk(tokens[: limit - limit % self.page_size])]

    def _pin_path(self, path: list[tuple[_Node, int]], delta: int) -> list[int]:
        """Add `delta` to the pin count of the covered pages of `path`; returns them."""
        out: list[int] = []
        for node, k in path:
            if k < len(node.pages):  # the prefix ends inside this edge: pin exactly its pages
                node = self._split(node, k)
            node.pins += delta
            out += node.pages
        return out

    def pin(self, tokens: Sequence[int], n_tokens: int | None = None) -> list[int]:
        """Pin the cached whole pages of the longest cached prefix of `tokens` (at most
        `n_tokens` tokens) against eviction: their pin count goes up by one. Returns the
        pages pinned ([] where nothing is cached). Pins do not mark the path used; `purge`
        and `clear` still drop pinned pages."""
        return self._pin_path(self._covered(tokens, n_tokens), +1)

    def unpin(self, tokens: Sequence[int], n_tokens: int | None = None) -> list[int]:
        """Undo one `pin` of the same prefix: the pin count of each cached page of the longest
        cached prefix of `tokens` (at most `n_tokens` tokens) goes down by one; unpinned pages
        return to LRU eviction. Returns the pages unpinned ([] where nothing is cached).
        Raises ValueError, before changing anything, if one of those pages is not pinned
        (a prefix pinned and then purged is unpinned only as far as it is still cached)."""
        path = self._covered(tokens, n_tokens)
        for node, _ in path:
            if node.pins == 0:
                pos = node.start * self.page_size
                raise ValueError(
                    f"unpin: the cached page at token {pos} of this prefix is not pinned"
                )
        return self._pin_path(path, -1)

    def pinned_pages(self) -> list[int]:
        """Every page with a pin count above zero."""
        return [p for n in self._nodes() if n.pins for p in n.pages]

    def locate(self, page_tokens: Sequence[int]) -> tuple[int, int] | None:
        """A cached page holding exactly `page_tokens` (page_size token ids) wherever it sits:
        (page, position of its first token on its cached path), the most recently used of
        several, or None. Does not mark anything used (`touch` does); the answer holds until
        the next `evict`, `purge` or `clear`. O(copies of that page's tokens in the tree)."""
        key = tuple(int(t) for t in page_tokens)
        if len(key) != self.page_size:
            raise ValueError(f"locate takes one page: {self.page_size} tokens, got {len(key)}")
        found = self._by_tokens.get(key)
        if not found:
            return None
        page = max(found, key=lambda p: self._at[p][0].last_used)
        node, j = self._at[page]
        return page, (node.start + j) * self.page_size

    def touch(self, page: int) -> None:
        """Mark the path down to `page` (a page the tree holds) recently used, as `match` does."""
        now = next(self._clock)
        node = self._at[page][0]
        while node is not self.root:
            node.last_used = now
            node = node.parent

    def evict(self, want: int, refcount: Sequence[int]) -> list[int]:
        """Drop least recently used leaves whose pages only the tree references (refcount 1)
        and nobody pinned, until `want` pages would be freed or none is left. Returns the pages
        to release.

        One walk of the tree collects the evictable leaves into a heap keyed by last use;
        each eviction pops the oldest, and a parent left childless (and evictable) joins the
        heap: O(n + k log n) for k evictions, not a rescan of the tree per eviction."""

        def evictable(n: _Node) -> bool:
            return not n.children and not n.pins and all(refcount[p] == 1 for p in n.pages)

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
        """Forget everything, pinned pages too; every page the tree held (the caller releases)."""
        out = self.pages()
        self.root.children.clear()
        self._by_tokens.clear()
        self._at.clear()
        return out

    def purge(self, tokens: Sequence[int], start: int) -> list[int]:
        """Forget every cached page on the path of `tokens` from the page holding token
        `start` on (the KV of everything after `start` was computed with tokens[start]...).
        Pinned pages go too, with their pins: a FORGET guarantee beats a pin. Returns the
        pages to release."""
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
            self._unindex(n)
            out += n.pages
            stack += n.children.values()
        return out

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack += n.children.values()

    def _path(self, node: _Node) -> tuple[list[int], list[int]]:  # root .. node: tokens, pages
        toks, pages = [], []
        while node is not self.root:
            toks, pages, node = list(node.key) + toks, node.pages + pages, node.parent
        return toks, pages

    def paths(self) -> list[tuple[list[int], list[int]]]:
        """(tokens, pages) of every root-to-leaf path: inserted into an empty tree, the same
        content (a snapshot's copy)."""
        return [self._path(n) for n in self._nodes() if not n.children]

    def pin_ends(self) -> list[tuple[list[int], int]]:
        """(a pinned prefix's tokens, how many `pin`s of exactly it are held): pinned that many
        times in a rebuilt tree, every pin count comes back."""
        ends = [(n, n.pins - sum(c.pins for c in n.children.values())) for n in self._nodes()]
        return [(self._path(n)[0], own) for n, own in ends if own > 0]

    def pages(self) -> list[int]:
        """Every page the tree holds."""
        return [p for n in self._nodes() for p in n.pages]

    def __len__(self) -> int:
        return sum(1 for _ in self._nodes())
