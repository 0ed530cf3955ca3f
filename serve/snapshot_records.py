"""The checks of a session snapshot's records (`parse`): every session, radix path, pin and
lineage-tree path the meta lists is checked against the saved pages, the vocabulary and the
page size before anything enters the engine; a malformed one is a `CheckpointError` naming
it. Format 1's missing fields take their defaults (`serve.snapshot` describes the format)."""

from __future__ import annotations

from leyline_jax import allocator
from leyline_jax.loader import CheckpointError
from serve import spans
from serve.engine import OWN_LINEAGE
from serve.sampling import is_int


def parse(engine, meta: dict, arrays: dict) -> tuple:
    """The snapshot's sessions, prefixes, radix pins, lineage trees and pages, checked
    (CheckpointError when malformed); format 1's missing fields take their defaults."""
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
    pins = r.check(meta.get("radix_pins", []), r.pin, "radix pin")
    trees = r.check(meta.get("lineage_trees", []), r.tree, "lineage tree")
    return sessions, prefixes, pins, trees, moved, rotated


class _Records:
    """Checks of a snapshot's records against its `k` saved pages, the vocabulary and the page
    size (each fills in what format 1 lacks)."""

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
        defaults = {"pins": [], "lineage": own, "private": False, "foreign": False, "salt": ""}
        for key, default in defaults.items():
            r.setdefault(key, default)
        return (
            self.ints(r.get("tokens"), self.vocab)
            and is_int(r.get("cached"))
            and is_int(r.get("clean"))
            and 0 <= r["clean"] <= r["cached"] <= len(r["tokens"])
            and self.ints(r.get("pages"), self.k)
            and len(r["pages"]) == allocator.pages_for(r["cached"], self.ps)
            and len(set(r["pages"])) == len(r["pages"])
            and _spans(r["pins"], len(r["tokens"]))
            and isinstance(r["lineage"], str)
            and (r["lineage"] == own or not r["lineage"].startswith(OWN_LINEAGE))
            and isinstance(r["private"], bool)
            and isinstance(r["foreign"], bool)
            and isinstance(r["salt"], str)
        )

    def prefix(self, p) -> bool:
        if not self.path(p):
            return False
        lineages = p.setdefault("lineages", [None] * len(p["pages"]))
        return (
            isinstance(p.setdefault("salt", ""), str)
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
