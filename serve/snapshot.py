"""Durable sessions: the serving engine's sessions saved to a snapshot and restored in a new
process, so that a session's next turn reuses its KV exactly as before the restart.

A snapshot (`checkpoints.sessions`: atomic, crash-safe) holds two arrays and a JSON meta:
- `moved` / `rotated`: the distinct KV pages the snapshot needs, every layer's bands stacked,
  [L, K, page_size, *band] in the pools' storage dtypes (a 16-bit band as its raw uint16 bits:
  bit-exact). A page several sessions or radix nodes share (forks, prefix hits) is saved once.
- `page_tokens`: [K, page_size] int32, the token ids each saved page holds KV for (-1 past its
  last), so each record's tokens are bound to its pages: a restore whose records put other
  tokens on a page (a changed token id, page lists moved between sessions) is refused.
- `layout`: what the pages mean, so another engine is refused: the format version, the model's
  family and whole config, a checksum of its params' bits, page_size, the bands' shapes and
  dtypes.
- `sessions`, least recently used first: id, tokens, `cached` (tokens[:cached] are in the KV),
  `clean` (tokens[:clean] hold the KV a fresh prefill gives; KV past it is AMORTIZE-spliced
  and serves its own session only) and `pages` (indices into the saved pages: the session's
  page-table row over tokens[:cached]).
  A session's `pins` (PIN spans), `lineage` (its own, "session:<id>", or a caller's name),
  `salt` (whose radix cache it shares) and MOVE flags (`private`, `foreign`) come back as they
  were.
- `prefixes`: the radix cache's path along each session's tokens (in its salt's cache) and
  every pinned path (tokens, page indices, the salt, and the lineage that cached each page:
  MOVE copies only its own lineage's), so a session's next turn, offloaded or not, finds what
  it would have found (the cache holds only clean KV, so lineage is kept). Other radix entries
  are not saved.
- `radix_pins`: each pinned prefix and how many `pin_prefix` calls hold it.
- `lineage_trees`: each lineage's private tree (the KV its MOVE sessions hold past their clean
  prefix), whole: every root-to-leaf path.
- `forgotten`: how many FORGETs of the log beside it (`serve.forgotten`) it reflects; a restore
  applies the later ones to what it read.
- `extra`: the caller's own JSON-able data, returned by `restore`.

This is format 3, the one format `restore` reads: a snapshot of an older format is refused
with a `CheckpointError` that says how to keep its sessions (restore it on a release that
reads it, and save it there: that writes format 3).

A session with a turn in flight (running or queued) is saved as what its KV holds,
tokens[:cached] (none, if it is offloaded too; the turn itself is not saved: its caller
submits it again, e.g. as a whole prompt); an idle offloaded session keeps its token list with
nothing cached. Radix paths are taken along the whole token list either way.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from pathlib import Path

from checkpoints.layout import differences, layout
from checkpoints.sessions import read_snapshot, write_snapshot
from leyline_jax.safetensors import CheckpointError
from serve import forgotten
from serve import snapshot_records as records
from serve.engine import Engine
from serve.engine.caches import OWN_LINEAGE

FORMAT = 3  # the layout above


def save(engine: Engine, root: str | os.PathLike, extra: dict | None = None) -> Path:
    """Snapshot every session of `engine` under `root` (`checkpoints.sessions.write_snapshot`:
    the previous snapshot stays current until this one is complete). Call it between engine
    steps; the engine is not changed (pages are read from the device, nothing is donated).
    `extra`: JSON-able data stored beside the sessions (ValueError otherwise, before anything
    is written). Returns the snapshot's directory."""
    return capture(engine, root, extra)()


def capture(
    engine: Engine, root: str | os.PathLike, extra: dict | None = None
) -> Callable[[], Path]:
    """`save` in two steps: what the engine holds, read now (between steps: its pages copied to
    the host), and the function that writes it, which any thread may call while the engine
    steps on (the server's snapshots do, off the engine's thread)."""
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict or None, got {type(extra).__name__}")
    st = engine.state
    index: dict[int, int] = {}  # pool page -> its index among the saved pages

    bound: list[tuple[list[int], list[int]]] = []  # (tokens, saved pages): `page_tokens`

    def refs(pages, tokens) -> list[int]:
        out = [index.setdefault(int(p), len(index)) for p in pages]
        bound.append((tokens, out))
        return out

    caches = engine.caches

    def path(tokens, pages) -> dict:
        tokens = list(tokens)
        return {"tokens": tokens, "pages": refs(pages, tokens)}

    def prefix(tokens, salt="") -> dict | None:
        pages, n = caches.tree(salt).peek(tokens)
        lineages = [caches.lineage_of.get(p) for p in pages]
        return {**path(tokens[:n], pages), "lineages": lineages, "salt": salt} if n else None

    sessions, prefixes, pins, trees = [], [], [], []
    for s in sorted(engine.sessions.values(), key=lambda s: s.last_used):
        cached = s.cached if s.seq is not None else 0
        whole = s.token_list()  # an idle offloaded session stays packed
        tokens = whole[:cached] if engine.table.busy(s) else whole
        row = engine.pool.seq_pages(s.seq) if cached else []
        if cached and st.token_ids[s.seq].tolist() != tokens[:cached]:
            raise RuntimeError(f"session {s.id}: its tokens do not describe its sequence's KV")
        rec = {"id": s.id, "tokens": tokens, "cached": cached, "clean": min(s.clean, cached)}
        rec |= {"pins": [list(p) for p in s.pins if p[1] <= len(tokens)], "lineage": s.lineage}
        rec |= {"salt": s.salt}
        rec |= {"private": s.private, "foreign": s.foreign}
        sessions.append({**rec, "pages": refs(row, tokens[:cached])})
        if engine.radix is not None and (p := prefix(whole, s.salt)):  # a later turn's hit
            prefixes.append(p)
    if engine.radix is not None:
        for tokens, count in engine.radix.pin_ends():
            prefixes.append(prefix(tokens))  # a pinned path is cached: never None
            pins.append({"tokens": tokens, "count": count})
    for lineage, tree in caches.private.items():
        trees.append({"lineage": lineage, "paths": [path(*p) for p in tree.paths()]})
    moved, rotated = engine.read_pages(list(index))  # in index order
    try:
        held = records.page_tokens(bound, len(index), engine.page_size)
    except ValueError as e:
        raise RuntimeError(f"the engine's records disagree: {e}") from e
    meta = {
        "format": FORMAT,
        "layout": layout(engine.model, engine.state.pools),
        "sessions": sessions,
        "prefixes": prefixes,
        "radix_pins": pins,
        "lineage_trees": trees,
        "forgotten": len(forgotten.Log(root).records()),  # FORGETs this snapshot reflects
        "extra": {} if extra is None else extra,
    }
    arrays = {"moved": moved, "rotated": rotated, "page_tokens": held}
    return functools.partial(write_snapshot, root, arrays, meta)


def restore(engine: Engine, root: str | os.PathLike, *, merge: bool = False) -> dict | None:
    """Recreate the sessions of the snapshot under `root` in `engine`, a fresh engine (no
    sessions; ValueError otherwise; `merge`: one serving its own, each saved session then gets
    a new id, its own lineage renamed alike, `extra["session_ids"]` maps them) of the same
    model and pool layout. Each session gets its
    saved id, tokens, cached KV (the saved pages written bit-exact into freshly allocated ones
    and adopted by a sequence: `Engine.restore_session`) and lineage: its clean prefix and the
    saved radix paths enter the radix cache, spliced KV does not. Refcounts are exact
    afterwards (one reference per page-table row and radix node holding a page); later
    `open_session` ids do not collide. FORGETs logged after the snapshot are applied first
    (`serve.forgotten.redact`). Returns the snapshot's `extra` ({} when it was saved
    without; None when there is no snapshot: the engine is untouched).

    Raises, before the engine changes: ValueError naming what differs for another layout
    (model family, config field, params, page_size, band shapes or dtypes), for a pool with
    too few free pages or sequence slots, or sessions longer than `max_seq_len`;
    CheckpointError for a damaged or malformed snapshot, or one of another format."""
    if engine.sessions and not merge:
        raise ValueError(
            f"restore needs a fresh engine; this one has {len(engine.sessions)} sessions"
        )
    pools, free = engine.state.pools, engine.pool.free_count()
    page = sum(math.prod(p.shape[1:]) * p.dtype.itemsize for p in (*pools.moved, *pools.rotated))
    page += engine.page_size * 4  # its token ids (`page_tokens`)
    snap = read_snapshot(root, max_bytes=page * free + (1 << 20))  # what the pool can take
    if snap is None:
        return None
    arrays, meta = snap
    if (found := meta.get("format")) != FORMAT:
        raise CheckpointError(
            f"session snapshot format {found!r}; this release reads format {FORMAT} only. To "
            "keep its sessions, restore it on a server of a release that reads it and save it "
            "there again (POST /v1/snapshot, or stop that server): it is then format 3"
        )
    saved = meta.get("layout")
    if not isinstance(saved, dict):
        raise CheckpointError("the snapshot holds no layout")
    diffs = differences(saved, layout(engine.model, engine.state.pools))
    if diffs:
        raise ValueError("the snapshot does not fit this engine: " + "; ".join(diffs))
    sessions, prefixes, pins, trees, moved, rotated = records.parse(engine, meta, arrays)
    later = forgotten.Log(root).since(meta.get("forgotten", 0))  # FORGETs after the snapshot
    cut = forgotten.redact(later, sessions, prefixes, pins, trees)
    st = engine.state
    k, free = moved.shape[1], engine.pool.free_count()
    if k > free:
        raise ValueError(
            f"the snapshot holds {k} KV pages; this engine's pool has {free} free of {st.num_pages}"
        )
    slots, free_slots = sum(1 for r in sessions if r["cached"]), st.max_seqs - int(st.active.sum())
    if slots > free_slots:
        raise ValueError(
            f"the snapshot has {slots} sessions holding KV; this engine has {free_slots} free "
            "sequence slots"
        )
    long = [r for r in sessions if len(r["tokens"]) > st.max_seq_len]
    if long:
        raise ValueError(
            f"session {long[0]['id']} holds {len(long[0]['tokens'])} tokens, more than this "
            f"engine's max_seq_len={st.max_seq_len}"
        )
    ids = _renumber(engine, sessions, prefixes, trees) if merge else None
    pages = engine.pool.load_pages(moved, rotated)  # each page: one loader reference
    for p in prefixes:  # first: the tree maps each saved path to its saved pages
        take = engine.caches.restore_prefix
        take(p["tokens"], pages[p["pages"]].tolist(), p["lineages"], p["salt"])
    for t in trees:
        for p in t["paths"]:
            engine.caches.restore_tree(t["lineage"], p["tokens"], pages[p["pages"]].tolist())
    for r in sessions:  # least recently used first: the engine's LRU order is kept
        kw = {k: r[k] for k in ("cached", "clean", "lineage", "private", "foreign", "salt")}
        kw |= {"pages": pages[r["pages"]].tolist(), "pins": [tuple(p) for p in r["pins"]]}
        engine.restore_session(r["id"], r["tokens"], **kw)
    for p in pins:
        for _ in range(p["count"]):
            engine.radix.pin(p["tokens"])
    engine.pool.release(pages)  # drop the loader's references
    extra = dict(meta.get("extra") or {})
    if cut:
        extra["forgotten_sessions"] = sorted({ids[c] if ids else c for c in cut})
    return extra if ids is None else extra | {"session_ids": ids}


def _renumber(engine: Engine, sessions, prefixes, trees) -> dict[int, int]:
    """New ids for saved sessions joining a live engine (above every id it gave out), in the
    records, with their own lineages renamed alike; {saved id: new id}."""
    new = engine.table.reserve(len(sessions))
    ids = {r["id"]: n for r, n in zip(sessions, new, strict=True)}
    own = {f"{OWN_LINEAGE}{a}": f"{OWN_LINEAGE}{b}" for a, b in ids.items()}
    for r in sessions:
        r["id"], r["lineage"] = ids[r["id"]], own.get(r["lineage"], r["lineage"])
    for p in prefixes:
        p["lineages"] = [own.get(x, x) for x in p["lineages"]]
    for t in trees:
        t["lineage"] = own.get(t["lineage"], t["lineage"])
    return ids
