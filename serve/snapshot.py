"""Durable sessions: the serving engine's sessions saved to a snapshot and restored in a new
process, so that a session's next turn reuses its KV exactly as before the restart.

A snapshot (`checkpoints.sessions`: atomic, crash-safe) holds two arrays and a JSON meta:
- `moved` / `rotated`: the distinct KV pages the snapshot needs, every layer's bands stacked,
  [L, K, page_size, *band] in the pools' storage dtypes (a 16-bit band as its raw uint16 bits:
  bit-exact). A page several sessions or radix nodes share (forks, prefix hits) is saved once.
- `layout`: what the pages mean, so another engine is refused: the format version, the model's
  family and whole config, a checksum of its params' bits, page_size, the bands' shapes and
  dtypes.
- `sessions`, least recently used first: id, tokens, `cached` (tokens[:cached] are in the KV),
  `clean` (tokens[:clean] hold the KV a fresh prefill gives; KV past it is AMORTIZE-spliced
  and serves its own session only) and `pages` (indices into the saved pages: the session's
  page-table row over tokens[:cached]).
- `prefixes`: the radix cache's path along each session's tokens (tokens and page indices),
  so a session's next turn, offloaded or not, finds what it would have found (the cache holds
  only clean KV, so lineage is kept). Radix entries on no session's path are not saved.
- `extra`: the caller's own JSON-able data, returned by `restore`.

A session with a turn in flight (running or queued) is saved as what its KV holds,
tokens[:cached] (none, if it is offloaded too; the turn itself is not saved: its caller
submits it again, e.g. as a whole prompt); an idle offloaded session keeps its token list with
nothing cached. Radix paths are taken along the whole token list either way.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.sessions import read_snapshot, write_snapshot
from leyline_jax import allocator, paged
from leyline_jax.loader import CheckpointError
from serve.engine import Engine
from serve.sampling import is_int

FORMAT = 1  # the meta's layout described above


def save(engine: Engine, root: str | os.PathLike, extra: dict | None = None) -> Path:
    """Snapshot every session of `engine` under `root` (`checkpoints.sessions.write_snapshot`:
    the previous snapshot stays current until this one is complete). Call it between engine
    steps; the engine is not changed (pages are read from the device, nothing is donated).
    `extra`: JSON-able data stored beside the sessions (ValueError otherwise, before anything
    is written). Returns the snapshot's directory."""
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict or None, got {type(extra).__name__}")
    st = engine.state
    index: dict[int, int] = {}  # pool page -> its index among the saved pages

    def refs(pages) -> list[int]:
        return [index.setdefault(int(p), len(index)) for p in pages]

    sessions, prefixes = [], []
    for s in sorted(engine.sessions.values(), key=lambda s: s.last_used):
        busy = s.active is not None or bool(s.queue)
        cached = s.cached if s.seq is not None else 0
        tokens = list(s.tokens[:cached] if busy else s.tokens)
        row = engine.pool.seq_pages(s.seq) if cached else []
        if cached and st.token_ids[s.seq].tolist() != tokens[:cached]:
            raise RuntimeError(f"session {s.id}: its tokens do not describe its sequence's KV")
        rec = {"id": s.id, "tokens": tokens, "cached": cached, "clean": min(s.clean, cached)}
        sessions.append({**rec, "pages": refs(row)})
        if engine.radix is not None:
            pages, n = engine.radix.peek(s.tokens)  # the whole list: what a later turn finds
            if n:
                prefixes.append({"tokens": list(s.tokens[:n]), "pages": refs(pages)})
    moved, rotated = paged.read_pages(st, list(index))  # in index order
    meta = {
        "format": FORMAT,
        "layout": layout(engine),
        "sessions": sessions,
        "prefixes": prefixes,
        "extra": {} if extra is None else extra,
    }
    return write_snapshot(root, {"moved": moved, "rotated": rotated}, meta)


def restore(engine: Engine, root: str | os.PathLike) -> dict | None:
    """Recreate the sessions of the snapshot under `root` in `engine`, a fresh engine (no
    sessions; ValueError otherwise) of the same model and pool layout. Each session gets its
    saved id, tokens, cached KV (the saved pages written bit-exact into freshly allocated ones
    and adopted by a sequence: `Engine.restore_session`) and lineage: its clean prefix and the
    saved radix paths enter the radix cache, spliced KV does not. Refcounts are exact
    afterwards (one reference per page-table row and radix node holding a page); later
    `open_session` ids do not collide. Returns the snapshot's `extra` ({} when it was saved
    without; None when there is no snapshot: the engine is untouched).

    Raises, before the engine changes: ValueError naming what differs for another layout
    (model family, config field, params, page_size, band shapes or dtypes), for a pool with
    too few free pages or sequence slots, or sessions longer than `max_seq_len`;
    CheckpointError for a damaged or malformed snapshot."""
    if engine.sessions:
        raise ValueError(
            f"restore needs a fresh engine; this one has {len(engine.sessions)} sessions"
        )
    snap = read_snapshot(root)
    if snap is None:
        return None
    arrays, meta = snap
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"session snapshot format {meta.get('format')!r}; this reads {FORMAT}"
        )
    saved = meta.get("layout")
    if not isinstance(saved, dict):
        raise CheckpointError("the snapshot holds no layout")
    diffs = differences(saved, layout(engine))
    if diffs:
        raise ValueError("the snapshot does not fit this engine: " + "; ".join(diffs))
    sessions, prefixes, moved, rotated = _parse(engine, meta, arrays)
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
    pages = engine.pool.load_pages(moved, rotated)  # each page: one loader reference
    for p in prefixes:  # first: the tree maps each saved path to its saved pages
        engine.restore_prefix(p["tokens"], pages[p["pages"]].tolist())
    for r in sessions:  # least recently used first: the engine's LRU order is kept
        engine.restore_session(
            r["id"],
            r["tokens"],
            pages=pages[r["pages"]].tolist(),
            cached=r["cached"],
            clean=r["clean"],
        )
    engine.pool.release(pages)  # drop the loader's references
    return meta.get("extra") or {}


def layout(engine: Engine) -> dict[str, Any]:
    """What saved KV pages mean for `engine` (JSON-able): two engines may exchange snapshots
    iff these are equal. `params` is a checksum of the model's params' bits."""
    cfg, pools = engine.model.config, engine.state.pools
    bands = cfg.kv_bands()
    return {
        "family": cfg.model_type,
        "config": json.loads(json.dumps(cfg.to_dict())),
        "params": params_checksum(engine.model),
        "num_layers": pools.num_layers,
        "page_size": pools.page_size,
        "moved_shape": list(bands.moved),
        "rotated_shape": list(bands.rotated),
        "moved_dtype": jnp.dtype(pools.moved_dtype).name,
        "rotated_dtype": jnp.dtype(pools.rotated_dtype).name,
    }


def differences(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """What differs between a snapshot's layout and an engine's, one line each (a config's
    fields one by one)."""
    out = []
    for key in sorted(set(saved) | set(mine)):
        a, b = saved.get(key), mine.get(key)
        if a == b:
            continue
        if key == "config" and isinstance(a, dict) and isinstance(b, dict):
            fields = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
            out += [f"config.{f}: snapshot {a.get(f)!r}, engine {b.get(f)!r}" for f in fields]
        elif key == "params":
            out.append(f"params: the model's weights differ (checksum {a} vs {b})")
        else:
            out.append(f"{key}: snapshot {a!r}, engine {b!r}")
    return out


@jax.jit
def _bit_sums(leaves):  # list of arrays -> u32[len(leaves)]
    def one(x):
        b = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1).astype(jnp.uint32)
        w = jnp.arange(b.shape[0], dtype=jnp.uint32) % 65521 + 1  # position-weighted
        return jnp.sum(b * w, dtype=jnp.uint32)  # wraps: integer sums are exact anywhere

    return jnp.stack([one(x) for x in leaves])


def params_checksum(model) -> str:
    """A checksum of every param's name, shape, dtype and bits (position-weighted byte sums on
    the device, then sha256 on the host): tells another checkpoint or dtype from this one. Not
    cryptographic; computed in integers, so it does not depend on the backend."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    sums = _bit_sums([jnp.asarray(x) for _, x in flat])
    with jax.transfer_guard_device_to_host("allow"):
        sums = np.asarray(sums)
    h = hashlib.sha256()
    for (path, x), v in zip(flat, sums, strict=True):
        h.update(f"{jax.tree_util.keystr(path)}|{x.shape}|{jnp.dtype(x.dtype).name}|{v};".encode())
    return h.hexdigest()[:16]


def _parse(engine: Engine, meta: dict, arrays: dict) -> tuple[list, list, np.ndarray, np.ndarray]:
    """The snapshot's sessions, prefixes and pages, checked (CheckpointError when malformed)."""
    moved, rotated = arrays.get("moved"), arrays.get("rotated")
    pools, ps = engine.state.pools, engine.page_size
    for name, a, pool in (("moved", moved, pools.moved[0]), ("rotated", rotated, pools.rotated[0])):
        if (
            a is None
            or a.ndim < 2
            or a.shape[0] != pools.num_layers
            or a.shape[2:] != pool.shape[1:]
        ):
            raise CheckpointError(f"the snapshot's {name} pages do not have the layout's shape")
        if a.dtype != pool.dtype or a.shape[1] != moved.shape[1]:
            raise CheckpointError(
                f"the snapshot's {name} pages: dtype {a.dtype}, {a.shape[1]} pages"
            )
    k, vocab = moved.shape[1], engine.model.config.vocab_size

    def ints(v, hi: int) -> bool:
        return isinstance(v, list) and all(is_int(x) and 0 <= x < hi for x in v)

    sessions, prefixes = meta.get("sessions"), meta.get("prefixes")
    if not isinstance(sessions, list) or not isinstance(prefixes, list):
        raise CheckpointError("the snapshot holds no session list")
    ids = set()
    for r in sessions:
        ok = (
            isinstance(r, dict)
            and is_int(r.get("id"))
            and r["id"] >= 0
            and r["id"] not in ids
            and ints(r.get("tokens"), vocab)
            and is_int(r.get("cached"))
            and is_int(r.get("clean"))
            and 0 <= r["clean"] <= r["cached"] <= len(r["tokens"])
            and ints(r.get("pages"), k)
            and len(r["pages"]) == allocator.pages_for(r["cached"], ps)
            and len(set(r["pages"])) == len(r["pages"])
        )
        if not ok:
            raise CheckpointError(f"a malformed session record in the snapshot: {str(r)[:200]}")
        ids.add(r["id"])
    for p in prefixes:
        ok = (
            isinstance(p, dict)
            and ints(p.get("tokens"), vocab)
            and ints(p.get("pages"), k)
            and len(p["tokens"]) == len(p["pages"]) * ps
        )
        if not ok:
            raise CheckpointError(f"a malformed prefix record in the snapshot: {str(p)[:200]}")
    return sessions, prefixes, moved, rotated
