"""A FORGET that holds across restarts: a log of what each FORGET forgot, beside the snapshots.

A snapshot is a copy, and one taken before a FORGET still holds the evicted tokens and the KV
computed with them. So every FORGET is reported (`Engine.on_forget`) and, on a server with a
snapshot directory, appended to `ROOT/forgotten.jsonl` (`Log.append`: one line, fsync'd before
the turn that forgets runs); a snapshot notes how many lines the log had when it was taken, and
a restore applies the later ones (`redact`) to what it read, before anything enters the engine:

- the session that forgot comes back cut at the first evicted token (tokens, KV pages, clean
  prefix and pins; its next turn prefills the rest again), and is listed in the restored
  `extra` under `"forgotten_sessions"` so its caller drops its own state of it (the HTTP
  server: its remembered replies);
- every saved radix path of its salt and lineage-tree path of its lineage holding the page of
  the first evicted token comes back cut before that page, and pins of such paths are dropped,
  as the FORGET purged them in memory;
- sessions of its lineage whose saved KV holds such a page come back `foreign` (their KV is
  never cached for the lineage again), as in memory.

A line holds the session id, the position, the salt, the lineage, the page size and the
SHA-256 of the tokens up to the end of the first evicted token's page — no token of the text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from leyline_jax import allocator
from leyline_jax.hf_config import is_int
from leyline_jax.safetensors import CheckpointError

NAME = "forgotten.jsonl"


def _page_end(start: int, page_size: int) -> int:
    """The end of the page holding token `start`: what a record's hash covers."""
    return (start // page_size + 1) * page_size


def page_hash(tokens, upto: int) -> str | None:
    """SHA-256 of tokens[:upto] as int32 (None when there are fewer tokens)."""
    if len(tokens) < upto:
        return None
    return hashlib.sha256(np.asarray(tokens[:upto], np.int32).tobytes()).hexdigest()


def record(session, start: int, page_size: int) -> dict:
    """What a FORGET from `start` in `session` (its tokens before the edit) forgot."""
    return {
        "session": session.id,
        "start": start,
        "salt": session.salt,
        "lineage": session.lineage,
        "page_size": page_size,
        "page_hash": page_hash(session.tokens, _page_end(start, page_size)),
    }


class Log:
    """`ROOT/forgotten.jsonl`, appended durably (one line a FORGET, fsync'd)."""

    def __init__(self, root: str | os.PathLike):
        self.path = Path(root) / NAME

    def append(self, rec: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> list[dict]:
        """Every FORGET logged (a last line cut short by a crash is not one: its turn never
        ran); CheckpointError for a damaged log."""
        if not self.path.is_file():
            return []
        text = self.path.read_text(encoding="utf-8")
        lines = text.split("\n")
        out = []
        for n, line in enumerate(lines, 1):
            try:
                out.append(_checked(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                if line and (n < len(lines) - 1 or text.endswith("\n")):
                    raise CheckpointError(f"{self.path}:{n} is damaged: {e}") from e
        return out

    def since(self, seen) -> list[dict]:
        """The FORGETs logged after the first `seen` (a snapshot's count of those it holds)."""
        if not is_int(seen) or seen < 0:
            raise CheckpointError(f"the snapshot's forgotten={seen!r} is not a count")
        return self.records()[seen:]


def _checked(rec) -> dict:
    ok = isinstance(rec, dict) and all(is_int(rec[k]) for k in ("session", "start", "page_size"))
    ok = ok and isinstance(rec["salt"], str) and isinstance(rec["lineage"], str)
    if not ok or rec["page_size"] < 1 or not isinstance(rec["page_hash"], (str, type(None))):
        raise ValueError("not a FORGET record")
    return rec


def _holds(rec: dict, tokens) -> bool:
    """Whether `tokens` hold the page of the first token `rec` forgot (its SHA-256 matches)."""
    upto = _page_end(rec["start"], rec["page_size"])
    return rec["page_hash"] is not None and page_hash(tokens, upto) == rec["page_hash"]


def redact(records, sessions, prefixes, pins, trees) -> list[int]:
    """Apply FORGET `records` (later than the snapshot) to its parsed parts, in place; the ids
    of the sessions cut."""
    cut_ids = []
    for rec in records:
        ps, start = rec["page_size"], rec["start"]
        page = start // ps  # the first evicted token's page: paths holding it are cut there
        holds = functools.partial(_holds, rec)

        for r in sessions:
            if r["id"] == rec["session"] and len(r["tokens"]) > start:
                r["tokens"], r["cached"] = r["tokens"][:start], min(r["cached"], start)
                r["clean"] = min(r["clean"], r["cached"])
                r["pages"] = r["pages"][: allocator.pages_for(r["cached"], ps)]
                r["pins"] = [p for p in r["pins"] if p[1] <= start]
                cut_ids.append(r["id"])
            elif r["lineage"] == rec["lineage"] and holds(r["tokens"][: r["cached"]]):
                r["foreign"] = True
        paths = [p for p in prefixes if p["salt"] == rec["salt"]]
        paths += [p for t in trees if t["lineage"] == rec["lineage"] for p in t["paths"]]
        for p in paths:
            if holds(p["tokens"]):
                p["tokens"], p["pages"] = p["tokens"][: page * ps], p["pages"][:page]
                if "lineages" in p:  # a radix path's: who cached each page
                    p["lineages"] = p["lineages"][:page]
        pins[:] = [p for p in pins if not (rec["salt"] == "" and holds(p["tokens"]))]
    prefixes[:] = [p for p in prefixes if p["pages"]]
    for t in trees:
        t["paths"] = [p for p in t["paths"] if p["pages"]]
    return cut_ids
