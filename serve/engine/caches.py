"""The prefix caches and their lineage rule: which KV may be shared, with whom, and what a FORGET
takes back.

KV that AMORTIZE spliced (or MOVE copied) is not what a fresh prefill of the same tokens gives,
so it stays with the session (and its KV) that made it: a session tracks `clean`, the length of
the prefix whose KV a fresh prefill would reproduce, and only whole pages of that prefix enter
the radix cache, shared by every session of the same salt (a tenant's, or a caller's
`cache_salt`: each salt has a tree of its own, so a prefix one tenant cached is never found by
another, nor seen in its usage). A session that ran MOVE also caches its whole KV in
its lineage's private tree (`private`), which only later sessions of that lineage match; KV a
MOVE copied from another session's pages (`Session.foreign`) is never cached there. Radix
pages remember the lineage that cached them (`lineage_of`): MOVE copies only its own
lineage's. A FORGET purges the session's path in both trees from the first evicted token on,
before the edit runs: nothing computed with the evicted tokens stays reachable, and pages
nobody references afterwards are zeroed.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from leyline_jax.directives import Directive, Mode
from serve import forgotten
from serve.engine.pool import Pool
from serve.engine.types import Session
from serve.radix import RadixCache

# a session opened without a lineage has its own, "session:<id>": names with this prefix are
# the engine's, never a caller's
OWN_LINEAGE = "session:"


class PrefixCaches:
    def __init__(self, pool: Pool, enabled: bool, on_forget=None):
        self.pool, self.page_size = pool, pool.page_size
        self.on_forget = on_forget  # called with each FORGET's record (`serve.forgotten`)
        self._reported = None  # the last record reported (a batch is purged more than once)
        self.enabled = enabled
        self.shared: dict[str, RadixCache] = {}  # salt -> its radix cache ("": no salt)
        self.radix = self.tree("")  # the unsalted radix cache (None: no radix cache)
        self.private: dict[str, RadixCache] = {}  # lineage -> its MOVE sessions' KV
        self.lineage_of: dict[int, str] = {}  # radix page -> lineage of the session it came from

    def tree(self, salt: str) -> RadixCache | None:
        """The radix cache of sessions with `salt` (made on first use; None: no radix cache)."""
        if not self.enabled:
            return None
        if salt not in self.shared:
            self.shared[salt] = RadixCache(self.page_size)
        return self.shared[salt]

    def trees(self) -> list[RadixCache]:
        return [*self.shared.values(), *self.private.values()]

    def pages(self) -> list[int]:
        """Every page reference the trees hold (a page in two trees is listed twice)."""
        return [p for tree in self.trees() for p in tree.pages()]

    # ---- what enters ---------------------------------------------------------------------------
    def _insert(self, tree: RadixCache, s: Session, upto: int) -> list[int]:
        n = upto // self.page_size
        if n == 0:
            return []
        row = self.pool.seq_pages(s.seq)[:n]
        taken = tree.insert(list(s.tokens[: n * self.page_size]), row)
        self.pool.retain(taken)
        return taken

    def cache_prefix(self, s: Session) -> None:
        """Offer the whole pages of `s`'s clean prefix to the radix cache (and, after MOVE,
        its whole KV to its lineage's tree); each tree takes a reference to pages it newly
        holds."""
        if s.seq is None or not self.enabled:
            return
        for p in self._insert(self.tree(s.salt), s, min(s.clean, s.cached)):
            self.lineage_of[p] = s.lineage
        if s.private and not s.foreign and s.cached // self.page_size:
            tree = self.private.setdefault(s.lineage, RadixCache(self.page_size))
            self._insert(tree, s, s.cached)

    def restore_prefix(self, tokens: list[int], pages: list[int], lineages=None, salt="") -> int:
        """Take `tokens` held in `pages` (whole pages of clean KV) into the radix cache of
        `salt`; `lineages[i]`: the lineage that cached pages[i] (None: none). How many pages it
        took."""
        if not self.enabled:
            return 0
        taken = self.tree(salt).insert(tokens, pages)
        self.pool.retain(taken)
        for p, lineage in zip(pages, lineages or [None] * len(pages), strict=True):
            if lineage is not None and p in taken:
                self.lineage_of[p] = lineage
        return len(taken)

    def restore_tree(self, lineage: str, tokens: list[int], pages: list[int]) -> None:
        """Take a path of `lineage`'s private tree back (a snapshot's)."""
        if self.radix is not None:
            tree = self.private.setdefault(lineage, RadixCache(self.page_size))
            self.pool.retain(tree.insert(tokens, pages))

    # ---- what a turn finds -----------------------------------------------------------------------
    def match(self, s: Session, prompt: list[int]) -> tuple[list[int], int, int]:
        """(pages, tokens they hold, of those the clean ones) of the longest cached prefix of
        `prompt` that `s` may use: its salt's radix cache's, or its lineage's own if that reaches
        further (clean only as far as its pages are the radix cache's own). At least the
        prompt's last token is left to feed."""
        pages, hit = [], 0
        if self.enabled:
            pages, hit = self.tree(s.salt).match(prompt, max_tokens=len(prompt) - 1)
        clean = hit
        tree = self.private.get(s.lineage)
        if tree is not None:
            own, n = tree.match(prompt, max_tokens=len(prompt) - 1)
            if n > hit:
                same = 0
                while same < min(len(own), len(pages)) and own[same] == pages[same]:
                    same += 1
                pages, hit, clean = own, n, same * self.page_size
        return pages, hit, clean

    def locate(self, page_tokens: tuple[int, ...], s: Session) -> tuple[int, int] | None:
        """A clean page of `s`'s salt's radix cache holding exactly `page_tokens`, cached by
        `s`'s lineage: (page, its first token's position), or None."""
        found = self.tree(s.salt).locate(page_tokens) if self.enabled else None
        if found is not None and self.lineage_of.get(found[0]) == s.lineage:
            return found
        return None

    # ---- what leaves ---------------------------------------------------------------------------
    def purge(self, s: Session, ds: Sequence[Directive]) -> set[int]:
        """A batch with a FORGET: both trees forget the path of `s.tokens` (before the edit)
        from the first FORGET start on; pages nobody else holds are zeroed; `on_forget` gets
        the FORGET's record. Returns the purged pages of its lineage's private tree that other
        KV still holds (their sessions are `foreign` from now: `SessionTable.mark_foreign`).
        Idempotent."""
        forget = [d for d in ds if d.mode is Mode.FORGET]
        if not forget:
            return set()
        start = min(d.start for d in forget)
        rec = forgotten.record(s, start, self.page_size)
        if self.on_forget is not None and rec != self._reported:
            self.on_forget(rec)  # first: a log that cannot be written stops the FORGET
            self._reported = rec
        if self.enabled:
            self.pool.release(self.tree(s.salt).purge(list(s.tokens), start), zero=True)
        private = self.private.get(s.lineage)
        if private is None:
            return set()
        pages = private.purge(list(s.tokens), start)
        self.pool.release(pages, zero=True)
        return {p for p in pages if self.pool.state.refcount[p] > 0}  # in another's KV still

    def evict(self, want: int) -> int:
        """Evict up to `want` pages only the trees hold, least recently used leaves first
        (the radix caches', then each lineage tree's); how many pages came back."""
        trees = self.trees()
        held = collections.Counter(p for tree in trees for p in tree.pages())
        for tree in trees:
            # a page another tree also holds is evictable here when only the trees hold it
            refs = self.pool.state.refcount.copy()
            for p, n in (held - collections.Counter(tree.pages())).items():
                refs[p] -= n
            pages = tree.evict(want, refs)
            if pages:
                self.pool.release(pages)
                return len(pages)
        return 0

    def drop_lineage(self, lineage: str) -> None:
        """Drop a lineage's tree (its last session closed and no later one can join it)."""
        tree = self.private.pop(lineage, None)
        if tree is not None:
            self.pool.release(tree.clear())

    def clear(self) -> None:
        """Every tree drops every reference it holds."""
        for tree in self.trees():
            self.pool.release(tree.clear())
