"""The page allocator: the one owner of page arithmetic and page references (host data only).

Every question about pages is asked here: how many pages a sequence of n tokens fills
(`pages_for`, the package's one ceiling division), which are free, what an append takes
(new pages, plus a copy of a shared partial last page: copy on write), what a directive batch
takes (`plan_edit`), what a serving turn may take (`turn_need`, `still_needs`,
`splice_need`), and every change of a reference: open, free, fork, adopt, retain, release.

A page is free when its reference count is 0; a page referenced more than once is never
written (an append copies it first). Each function here is pure on the state's host half
(`HostState`: page tables, lengths, token ids, open flags, refcounts; the state itself,
`leyline_jax.kv_state.PagedKVState`, builds on this module): it returns a new state whose
pools are the old ones. What the device must then do is returned beside it
(`Append`, `EditPlan`); only `release(zero=True)` touches the pools itself (it zeroes what it
frees). The checked entry points (`fork`, `free`, `retain`, `release`, `adopt`,
`check_appends`) raise before anything changes.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Self

import numpy as np

from leyline_jax.config import check_ids, check_tokens
from leyline_jax.hf_config import is_int


class HostState(Protocol):
    """What the allocator reads of a paged KV state: its host bookkeeping and sizes, `replace`
    (the next state, with changed fields) and `zeroed` (pages zeroed on the device)."""

    page_table: np.ndarray  # i32[max_seqs, max_pages_per_seq]; unused entries = num_pages
    lengths: np.ndarray  # i32[max_seqs] tokens cached per sequence
    token_ids: tuple[np.ndarray, ...]  # per sequence: i32[lengths[q]]
    active: np.ndarray  # bool[max_seqs] open sequences
    refcount: np.ndarray  # i32[num_pages] references to each page; 0 = free
    vocab_size: int
    max_seq_len: int
    page_size: int
    num_pages: int
    max_seqs: int
    max_pages_per_seq: int

    def replace(self, **changes) -> Self: ...

    def zeroed(self, pages) -> Self: ...


class OutOfPagesError(RuntimeError):
    """The page pool cannot hold the result. Raised before any state changes."""


class SequenceError(ValueError):
    """A sequence id that is out of range, not open, or already open."""


# ---- arithmetic ----------------------------------------------------------------------------
def pages_for(tokens, page_size: int):
    """Pages that hold `tokens` tokens (elementwise on numpy arrays): the ceiling division."""
    return -(-tokens // page_size)


def free_pages(state: HostState) -> np.ndarray:
    """i32[F] free page ids, lowest first."""
    return np.flatnonzero(state.refcount == 0).astype(np.int32)


def seq_pages(state: HostState, seq: int) -> np.ndarray:
    """i32[n] the pages sequence `seq` holds (its page-table row over its length)."""
    return state.page_table[seq, : pages_for(int(state.lengths[seq]), state.page_size)]


def table_references(state: HostState) -> np.ndarray:
    """i32[P]: how many open sequences' page tables list each page (within their lengths)."""
    counts = np.zeros(state.num_pages, np.int32)
    for q in np.flatnonzero(state.active):
        used = seq_pages(state, q)
        np.add.at(counts, used[used < state.num_pages], 1)
    return counts


def last_page_shared(state: HostState, seq: int) -> bool:
    """Whether `seq`'s partial last page is referenced by someone else too (an append copies
    it first)."""
    n, ps = int(state.lengths[seq]), state.page_size
    return bool(n % ps) and bool(state.refcount[state.page_table[seq, (n - 1) // ps]] > 1)


def append_pages(state: HostState, seq: int, count: int) -> int:
    """Pages appending `count` tokens to `seq` takes from the pool: the new pages it grows
    into, plus one copy of its partial last page when that page is shared."""
    ps, n = state.page_size, int(state.lengths[seq])
    grow = pages_for(n + count, ps) - pages_for(n, ps)
    return grow + int(count > 0 and last_page_shared(state, seq))


# ---- what a serving turn may take (the engine's admission asks these) ------------------------
def splice_need(page_size: int, length: int, first: int) -> int:
    """Pages a splice whose first edit starts at `first` may take from the pool, for a
    sequence `length` tokens long afterwards: it copies the kept tokens from that edit's page
    on into fresh pages before the old ones are released."""
    return pages_for(length, page_size) - first // page_size + 1


def turn_need(page_size: int, final: int, cut: int | None, first: int | None) -> tuple[int, int]:
    """(pages a turn may take from the pool at most, pages of its session's own it holds
    meanwhile) for a turn whose session ends `final` tokens long (prompt and token budget).
    `cut` None: the session starts from an empty sequence slot; else its KV keeps
    tokens[:cut], and `first` (None: no splice) is where its first spliced edit starts: a
    splice copies the kept tokens from that edit's page on into fresh pages before the old
    ones are released; without one, appending writes after the cut, copying a kept partial
    page first if it is shared."""
    if cut is None:
        return pages_for(final, page_size) + 1, 0
    held = pages_for(cut, page_size)
    if first is not None:
        return splice_need(page_size, final, first), held
    return pages_for(final, page_size) - held + int(cut % page_size > 0), held


def still_needs(state: HostState, seq: int, pending: int, new_left: int) -> int:
    """Pages a running turn may still take: `pending` prompt tokens and `new_left` tokens
    of its budget, past what `seq` holds (a shared last page is copied before it is written)."""
    ps, n = state.page_size, int(state.lengths[seq])
    grow = pages_for(n + pending + new_left, ps) - pages_for(n, ps)
    return grow + int(last_page_shared(state, seq))


# ---- host transitions (unchecked: the checked entry points below and the steps call them) ----
def _empty_row(state: HostState) -> np.ndarray:
    return np.full(state.max_pages_per_seq, state.num_pages, np.int32)


def _add_refs(refcount: np.ndarray, pages, delta: int) -> np.ndarray:
    out = refcount.copy()
    p = np.asarray(pages, np.int64).reshape(-1)
    np.add.at(out, p[p < out.shape[0]], delta)
    return out


def set_sequence(
    state: HostState, seq: int, row, tokens, *, active: bool = True, **changes
) -> HostState:
    """`seq` now holds `tokens` in the pages of page-table row `row` (i32[max_pages]);
    refcounts are the caller's (`changes` may carry new ones)."""
    table, lengths, flags = state.page_table.copy(), state.lengths.copy(), state.active.copy()
    table[seq], lengths[seq], flags[seq] = row, len(tokens), active
    ids = list(state.token_ids)
    ids[seq] = np.asarray(tokens, np.int32).reshape(-1).copy()
    return state.replace(
        page_table=table, lengths=lengths, active=flags, token_ids=tuple(ids), **changes
    )


def open_seq(state: HostState, seq: int) -> HostState:
    """Mark `seq` open and empty."""
    return set_sequence(state, seq, _empty_row(state), [])


def free_seq(state: HostState, seq: int) -> HostState:
    """Close `seq` and drop its page references (pages reaching 0 become free)."""
    refcount = _add_refs(state.refcount, seq_pages(state, seq), -1)
    return set_sequence(state, seq, _empty_row(state), [], active=False, refcount=refcount)


def fork_seq(state: HostState, src: int, dst: int) -> HostState:
    """Open `dst` as a copy of `src` that shares all of its pages (refcounts + 1)."""
    refcount = _add_refs(state.refcount, seq_pages(state, src), 1)
    row = state.page_table[src].copy()
    return set_sequence(state, dst, row, state.token_ids[src], refcount=refcount)


def retain_pages(state: HostState, pages) -> HostState:
    """Take one more reference to each page in `pages` (a holder outside any sequence, such as
    a prefix cache, keeps pages alive this way)."""
    return state.replace(refcount=_add_refs(state.refcount, pages, 1))


def release_pages(state: HostState, pages) -> tuple[HostState, np.ndarray]:
    """Drop one reference to each page in `pages` (distinct). Returns the state and i32[K] the
    pages nobody references any more (a caller purging their contents zeroes them)."""
    refcount = _add_refs(state.refcount, pages, -1)
    p = np.asarray(pages, np.int64).reshape(-1)
    dead = p[(p < state.num_pages)]
    return state.replace(refcount=refcount), dead[refcount[dead] == 0].astype(np.int32)


def adopt_prefix(state: HostState, seq: int, pages, tokens) -> HostState:
    """Open `seq` holding `tokens` whose KV already lives in `pages` (a prefix cache hit):
    every listed page gains a reference."""
    row = _empty_row(state)
    row[: len(pages)] = pages
    refcount = _add_refs(state.refcount, pages, 1)
    return set_sequence(state, seq, row, tokens, refcount=refcount)


@dataclasses.dataclass(frozen=True)
class Append:
    """What the device must do for an append the host planned: copy shared partial pages
    (`cow_src` -> `cow_dst`) before writing each new token to its slot."""

    slots: list[np.ndarray]  # per appended row: i32[count] destination slots
    cow_src: np.ndarray  # i32[K] shared pages to copy
    cow_dst: np.ndarray  # i32[K] the fresh copies


class _Taker:
    """A host copy of one row's bookkeeping that takes the lowest free pages in order."""

    def __init__(self, state: HostState, refcount: np.ndarray):
        self.ps, self.num_pages, self.refcount = state.page_size, state.num_pages, refcount
        self.free = list(np.flatnonzero(refcount == 0))

    def take(self, n: int, what: str) -> list[int]:
        if n > len(self.free):
            raise OutOfPagesError(
                f"{what} needs {n} pages; {len(self.free)} of {self.num_pages} are free"
            )
        got, self.free = self.free[:n], self.free[n:]
        self.refcount[got] += 1
        return [int(p) for p in got]

    def grow(self, row: np.ndarray, length: int, count: int, refs: np.ndarray, cow: list) -> None:
        """Give `row` (a sequence `length` tokens long) the pages `count` more tokens write: a
        copy of its partial last page first when refcounts `refs` say that page is shared (copy
        on write), then new pages."""
        ps, col = self.ps, (length - 1) // self.ps
        if count and length % ps and refs[row[col]] > 1:
            (new,) = self.take(1, "a copy on write")
            cow.append((int(row[col]), new))
            self.refcount[row[col]] -= 1
            row[col] = new
        a, b = pages_for(length, ps), pages_for(length + count, ps)
        row[a:b] = self.take(b - a, "the append")


def append(state: HostState, seqs, blocks) -> tuple[HostState, Append]:
    """Reserve slots for `blocks[i]` (token ids) at the end of open, distinct `seqs[i]`: take
    the lowest free pages, copy a partial last page shared before the step (copy on write),
    record the token ids. Returns the new state (pools untouched) and what the device step
    must do. Assumes the caller checked room (`check_appends`)."""
    ps = state.page_size
    taker = _Taker(state, state.refcount.copy())
    table, lengths, ids = state.page_table.copy(), state.lengths.copy(), list(state.token_ids)
    slots, cow = [], []
    for seq, block in zip(seqs, blocks, strict=True):
        n, count, row = int(lengths[seq]), len(block), table[seq]
        # shared as judged before the step: a page shared then is never written by it, even
        # once other rows' copies have left one sequence holding it
        taker.grow(row, n, count, state.refcount, cow)
        pos = n + np.arange(count)
        slots.append((row[pos // ps] * ps + pos % ps).astype(np.int32))
        lengths[seq] = n + count
        ids[seq] = np.concatenate([state.token_ids[seq], np.asarray(block, np.int32)])
    new = state.replace(
        page_table=table, refcount=taker.refcount, lengths=lengths, token_ids=tuple(ids)
    )
    src, dst = (np.asarray([c[k] for c in cow], np.int32) for k in (0, 1))
    return new, Append(slots, src, dst)


# ---- a directive batch's pages -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EditPlan:
    """What a directive batch does to one sequence's pages, decided on the host in the order
    the device then runs it: truncate at `cut` (FORGET), splice (the kept tokens from page
    `first_page` on move to fresh pages), append the re-prefilled tail. `state` is the host
    state afterwards (pools untouched: the caller runs the device part)."""

    state: HostState  # the sequence holds the edited tokens in `row`
    old_row: np.ndarray  # i32[max_pages] the row before (the splice's sources)
    row: np.ndarray  # i32[max_pages] the row after (destinations and fills)
    first_page: int | None  # the splice's first rebuilt page (None: no splice)
    dead: np.ndarray  # i32[D] pages the truncation freed: their KV is zeroed
    dead_slots: np.ndarray  # i32[S] slots past the cut on a kept partial page held alone
    cow: tuple[int, int] | None  # (shared page, its copy) before the tail is written


def plan_edit(
    state: HostState, seq: int, tokens: list[int], cut: int, first: int | None, spliced_len: int
) -> EditPlan:
    """The pages of an edit of open `seq` into `tokens` (the edited sequence): cut its KV at
    `cut` (the first FORGET's start, else its length), splice from token `first` on (None:
    no splice) leaving `spliced_len` tokens, then append the rest of `tokens`. Raises
    OutOfPagesError, before anything changes, if any of the three finds the pool short."""
    ps, p = state.page_size, state.num_pages
    n, old_row = int(state.lengths[seq]), state.page_table[seq].copy()
    row, refcount = old_row.copy(), state.refcount.copy()
    released = row[pages_for(cut, ps) : pages_for(n, ps)].copy()
    refcount = _add_refs(refcount, released, -1)
    dead = released[refcount[released] == 0].astype(np.int32)
    row[pages_for(cut, ps) :] = p
    dead_slots = np.zeros(0, np.int32)
    if cut < n and cut % ps and refcount[row[(cut - 1) // ps]] == 1:
        dead_slots = (row[(cut - 1) // ps] * ps + np.arange(cut % ps, ps)).astype(np.int32)
    taker = _Taker(state, refcount)
    first_page = None
    if first is not None:  # fresh pages first, then the old ones go
        first_page = first // ps
        end = pages_for(spliced_len, ps)
        fresh = taker.take(end - first_page, "the splice")
        gone = row[first_page : pages_for(cut, ps)].copy()
        row[first_page:] = p
        row[first_page:end] = fresh
        taker.refcount[:] = _add_refs(taker.refcount, gone, -1)
        taker.free = list(np.flatnonzero(taker.refcount == 0))
    cow: list = []
    taker.grow(row, spliced_len, len(tokens) - spliced_len, taker.refcount, cow)
    new = set_sequence(state, seq, row, tokens, refcount=taker.refcount)
    return EditPlan(new, old_row, row, first_page, dead, dead_slots, cow[0] if cow else None)


# ---- checked entry points ------------------------------------------------------------------
def check_seq(state: HostState, seq, *, want_open: bool | None = None) -> int:
    """Raise SequenceError unless `seq` is an int in range, open if `want_open`, not open if
    `want_open` is False."""
    if not is_int(seq):
        raise SequenceError(f"sequence id must be an int, got {seq!r}")
    if not 0 <= seq < state.max_seqs:
        raise SequenceError(f"sequence {seq} is out of range [0, {state.max_seqs})")
    if want_open and not state.active[seq]:
        raise SequenceError(f"sequence {seq} is not open")
    if want_open is False and state.active[seq]:
        raise SequenceError(f"sequence {seq} is already open")
    return int(seq)


def check_appends(state: HostState, seqs: list, counts: list) -> None:
    """Raise unless counts[i] tokens can be appended to open, distinct seqs[i] (ints, not
    coerced): SequenceError (an id, a repeat, past `max_seq_len`), OutOfPagesError."""
    for s in seqs:
        check_seq(state, s, want_open=True)
    if len(set(seqs)) != len(seqs):
        raise SequenceError(f"a sequence appears twice in one step: {seqs}")
    need = 0
    for s, n in zip(seqs, counts, strict=True):
        check_room(state, s, int(state.lengths[s]), n)
        need += append_pages(state, s, n)
    free = len(free_pages(state))
    if need > free:
        raise OutOfPagesError(
            f"appending to {len(seqs)} sequences needs {need} pages; {free} of "
            f"{state.num_pages} are free"
        )


def check_room(state: HostState, seq: int, length: int, count: int) -> None:
    if length + count > state.max_seq_len:
        raise SequenceError(
            f"sequence {seq} would hold {length + count} tokens, more than max_seq_len="
            f"{state.max_seq_len}"
        )


def fork(state: HostState, src: int, dst: int) -> HostState:
    """Open `dst` as a copy of open sequence `src`, sharing its pages."""
    src = check_seq(state, src, want_open=True)
    return fork_seq(state, src, check_seq(state, dst, want_open=False))


def free(state: HostState, seq: int) -> HostState:
    """Close open sequence `seq`, releasing its page references."""
    return free_seq(state, check_seq(state, seq, want_open=True))


def _page_list(state: HostState, pages) -> np.ndarray:
    p = check_ids(pages, state.num_pages, "page id", allow_empty=True)
    if len(np.unique(p)) != len(p):
        raise ValueError("page ids must be distinct")
    return p


def retain(state: HostState, pages) -> HostState:
    """Take a reference to each of `pages` (pages in use) for a holder outside any sequence,
    such as a prefix cache."""
    p = _page_list(state, pages)
    if (state.refcount[p] == 0).any():
        raise ValueError("only pages in use can be retained")
    return retain_pages(state, p)


def release(state: HostState, pages, *, zero: bool = False) -> HostState:
    """Drop a reference taken with `retain`; with `zero`, pages left unreferenced are zeroed
    (on the device). A page whose references all come from sequences' page tables is refused
    (ValueError): its holders free it with `free`. Donates `state` when zeroing."""
    p = _page_list(state, pages)
    outside = state.refcount - table_references(state)
    if (outside[p] < 1).any():
        bad = int(p[outside[p] < 1][0])
        raise ValueError(
            f"page {bad} holds no reference taken with retain (only sequences reference it)"
        )
    state, dead = release_pages(state, p)
    return state.zeroed(dead) if zero else state


def adopt(state: HostState, seq: int, pages, tokens, *, partial: bool = False) -> HostState:
    """Open `seq` as the `len(tokens)` tokens whose KV is held in the full pages `pages` (a
    prefix cache hit): the sequence shares those pages and appends after them. With `partial`
    the last page may be partly filled (a sequence restored from a snapshot): the sequence
    appends into it, copying it first while anyone else references it (copy on write)."""
    seq = check_seq(state, seq, want_open=False)
    p = check_ids(pages, state.num_pages, "page id", allow_empty=True)
    tokens = check_tokens(tokens, state.vocab_size, allow_empty=True)
    if len(tokens) > state.max_seq_len:
        raise ValueError(f"{len(tokens)} adopted tokens exceed max_seq_len={state.max_seq_len}")
    if partial:
        if len(p) != pages_for(len(tokens), state.page_size) or len(np.unique(p)) != len(p):
            raise ValueError("adopted tokens must fill the given distinct pages, the last in part")
    elif len(tokens) != len(p) * state.page_size:
        raise ValueError("adopted tokens must fill the given pages exactly")
    if (state.refcount[p] == 0).any():
        raise ValueError("adopted pages must be pages in use")
    return adopt_prefix(state, seq, p, tokens)
