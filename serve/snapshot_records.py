"""The checks of a session snapshot's records (`parse`): every session, radix path, pin and
lineage-tree path the meta lists is checked against the saved pages, the vocabulary and the
page size before anything enters the engine, and each record's tokens against those its pages
were saved with (`page_tokens`); a malformed one is a `CheckpointError` naming it
(`serve.snapshot` describes the format)."""

from __future__ import annotations

import numpy as np

from leyline_jax import allocator
from leyline_jax.hf_config import is_int
from leyline_jax.safetensors import CheckpointError
from serve import spans
from serve.engine.caches import OWN_LINEAGE


def parse(engine, meta: dict, arrays: dict) -> tuple:
    """The snapshot's sessions, prefixes, radix pins, lineage trees and pages, checked
    (CheckpointError when malformed)."""
    moved, rotated = arrays.get("moved"), arrays.get("rotated")
    pools = engine.state.pools
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
    r = _Records(moved.shape[1], engine.model.config.vocab_size, engine.page_size)
    sessions = r.check(meta.get("sessions"), r.session, "session")
    prefixes = r.check(meta.get("prefixes"), r.prefix, "prefix")
    pins = r.check(meta.get("radix_pins"), r.pin, "radix pin")
    trees = r.check(meta.get("lineage_trees"), r.tree, "lineage tree")
    paths = [(s["tokens"][: s["cached"]], s["pages"]) for s in sessions]
    paths += [(p["tokens"], p["pages"]) for p in prefixes]
    paths += [(p["tokens"], p["pages"]) for t in trees for p in t["paths"]]
    _check_bound(paths, arrays.get("page_tokens"), r.k, r.ps)
    return sessions, prefixes, pins, trees, moved, rotated


def page_tokens(paths, k: int, page_size: int) -> np.ndarray:
    """The token ids each of `k` pages holds KV for, [k, page_size] int32 (-1 past the last),
    from (tokens, pages) paths: page `pages[i]` holds `tokens[i * page_size:][:page_size]`.
    ValueError when two paths put different tokens on one page."""
    out = np.full((k, page_size), -1, np.int32)
    seen: dict[int, tuple] = {}  # page -> the tokens last bound to it (a shared page: once)
    for tokens, pages in paths:
        for i, j in enumerate(pages):
            seg = tuple(tokens[i * page_size : (i + 1) * page_size])
            if seen.get(j) == seg:
                continue
            have = out[j, : len(seg)]
            if ((have != -1) & (have != seg)).any():
                raise ValueError(f"two records put different tokens on page {j}")
            have[:] = seg
            seen[j] = seg
    return out


def _check_bound(paths, saved, k: int, page_size: int) -> None:
    """Every record's tokens are those its pages were saved with (`page_tokens`)."""
    shape = (k, page_size)
    if not isinstance(saved, np.ndarray) or saved.shape != shape or saved.dtype != np.int32:
        raise CheckpointError(f"the snapshot holds no [{k}, {page_size}] int32 page_tokens")
    try:
        found = page_tokens(paths, k, page_size)
    except ValueError as e:
        raise CheckpointError(f"the snapshot's records disagree: {e}") from None
    wrong = np.flatnonzero((found != saved).any(axis=1))
    if wrong.size:
        raise CheckpointError(
            f"the snapshot's records do not hold the tokens its page {int(wrong[0])} was saved "
            "with (a token changed, or pages moved between records)"
        )


class _Records:
    """Checks of a snapshot's records against its `k` saved pages, the vocabulary and the page
    size."""

    def __init__(self, k: int, vocab: int, page_size: int):
        self.k, self.vocab, self.ps, self.ids = k, vocab, page_size, set()

    @staticmethod
    def check(records, ok, what: str) -> list:
        if not isinstance(records, list):
            raise CheckpointError(f"the snapshot holds no {what} list")
        for rec in records:
            if not ok(rec):
                raise CheckpointError(
                    f"a malformed {what} record in the snapshot: {str(rec)[:200]}"
                )
        return records

    @staticmethod
    def ints(v, hi: int) -> bool:
        return isinstance(v, list) and all(is_int(x) and 0 <= x < hi for x in v)

    def path(self, p) -> bool:
        return (
            isinstance(p, dict)
            and self.ints(p.get("tokens"), self.vocab)
            and self.ints(p.get("pages"), self.k)
            and len(p["tokens"]) == len(p["pages"]) * self.ps
        )

    def session(self, r) -> bool:
        if not isinstance(r, dict) or not is_int(r.get("id")) or r["id"] < 0 or r["id"] in self.ids:
            return False
        self.ids.add(r["id"])
        own = f"{OWN_LINEAGE}{r['id']}"
        return (
            self.ints(r.get("tokens"), self.vocab)
            and is_int(r.get("cached"))
            and is_int(r.get("clean"))
            and 0 <= r["clean"] <= r["cached"] <= len(r["tokens"])
            and self.ints(r.get("pages"), self.k)
            and len(r["pages"]) == allocator.pages_for(r["cached"], self.ps)
            and len(set(r["pages"])) == len(r["pages"])
            and _spans(r.get("pins"), len(r["tokens"]))
            and isinstance(r.get("lineage"), str)
            and (r["lineage"] == own or not r["lineage"].startswith(OWN_LINEAGE))
            and isinstance(r.get("private"), bool)
            and isinstance(r.get("foreign"), bool)
            and isinstance(r.get("salt"), str)
        )

    def prefix(self, p) -> bool:
        if not self.path(p):
            return False
        lineages = p.get("lineages")
        return (
            isinstance(p.get("salt"), str)
            and isinstance(lineages, list)
            and len(lineages) == len(p["pages"])
            and all(x is None or isinstance(x, str) for x in lineages)
        )

    def pin(self, p) -> bool:
        return (
            isinstance(p, dict)
            and self.ints(p.get("tokens"), self.vocab)
            and len(p["tokens"]) % self.ps == 0
            and is_int(p.get("count"))
            and p["count"] >= 1
        )

    def tree(self, t) -> bool:
        return (
            isinstance(t, dict)
            and isinstance(t.get("lineage"), str)
            and isinstance(t.get("paths"), list)
            and all(self.path(p) for p in t["paths"])
        )


def _spans(pins, length: int) -> bool:
    try:
        spans.check_spans([tuple(p) for p in pins], length, "pinned span")
    except (TypeError, ValueError):
        return False
    return True
