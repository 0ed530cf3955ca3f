"""Atomic snapshot files: named numpy arrays (orbax-checkpoint) and a JSON meta, kept under a
root directory so that a crash at any moment leaves the last good snapshot readable.

On disk, under `root`:

    snapshot-000012/        the current snapshot: the highest-numbered `snapshot-N`
      snapshot.json         format version, each array's shape / dtype / crc32, the meta and
                            its SHA-256 (a changed meta is a damaged snapshot, not a lie)
      arrays/               the arrays that hold data, one orbax StandardCheckpointer tree
    .tmp-snapshot-000013/   a write in progress, or what a write that died left
    .lock                   held (flock) exclusively by a writer, shared by readers

Why a crash cannot lose the last good snapshot. A snapshot is written whole under a temporary
name (`.tmp-snapshot-N`, N above every number in use), every file and directory in it is
fsynced, and only then is the directory renamed to `snapshot-N` and `root` fsynced. A rename
is atomic (POSIX), so no reader ever sees a `snapshot-N` that is not complete, and the rename
is the one step that makes the new snapshot current: killed before it, the previous
snapshot is still the highest-numbered one; killed after it, the new one is, whole (the
fsyncs make that hold across a power loss too, not only a killed process). The rule "current
= highest-numbered `snapshot-N`" needs no pointer file: a `LATEST` file would be a second
commit that must be kept in step with the directories (written, fsynced, replaced, fsynced)
and one more way for the two to disagree. Older snapshots are removed only once the rename is
durable; a removal cut short leaves a lower-numbered directory that is never read, and the
next write removes it with any temporary leftovers.

One writer at a time per root (the lock serialises writers across processes; a killed
writer's lock is released by the kernel). Readers take the lock shared, so a write's removal
of the previous snapshot never pulls it from under a reader.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from leyline_jax.safetensors import CheckpointError

FORMAT = 2  # the layout of snapshot.json and arrays/ described above (1: no meta checksum)
META_FILE = "snapshot.json"
ARRAYS_DIR = "arrays"
LOCK_FILE = ".lock"
_DONE = re.compile(r"snapshot-(\d+)")
_TEMP = re.compile(r"\.tmp-snapshot-(\d+)")
_ARRAY_NAME = re.compile(r"[A-Za-z0-9_]+")


def write_snapshot(
    root: str | os.PathLike, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]
) -> Path:
    """Write `arrays` (names of letters, digits and `_`; numpy arrays of any shape, empty ones
    included, stored bit-exact) and `meta` (JSON-able) as a new snapshot under `root`
    (created if missing), make it the current one, then remove older ones. Returns the new
    snapshot's directory.

    Raises ValueError for a bad name, a value that is not a numpy array, or `meta` that is not
    a JSON-able dict, before anything is written. An error (or a kill) during the write
    leaves the previous snapshot current (see the module docstring); an error after the new
    snapshot became current (removing older ones) leaves the new one current."""
    root = Path(root).absolute()
    manifest = {}
    for name, a in arrays.items():
        if not isinstance(name, str) or not _ARRAY_NAME.fullmatch(name):
            raise ValueError(f"array name {name!r} must be letters, digits and '_'")
        if not isinstance(a, np.ndarray):
            raise ValueError(f"array {name!r} must be a numpy array, got {type(a).__name__}")
        manifest[name] = {"shape": list(a.shape), "dtype": a.dtype.name, "crc32": _crc(a)}
    if not isinstance(meta, Mapping):
        raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        doc = {"format": FORMAT, "arrays": manifest, "meta": dict(meta)}
        text = json.dumps(doc | {"meta_sha256": _digest(doc["meta"])})
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-able: {e}") from e
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root, exclusive=True):
        _clear_leftovers(root)
        number = 1 + max((n for n, _ in _entries(root)), default=0)
        temp = root / f".tmp-snapshot-{number:06d}"
        temp.mkdir()
        stored = {k: a for k, a in arrays.items() if a.size}
        if stored:  # orbax refuses empty arrays: the manifest alone describes those
            _write_arrays(temp / ARRAYS_DIR, stored)
        _write_meta(temp / META_FILE, text)
        _fsync_tree(temp)
        done = root / f"snapshot-{number:06d}"
        _commit(temp, done)
        _remove_old(root, done)
    return done


def read_snapshot(
    root: str | os.PathLike, max_bytes: int | None = None
) -> tuple[dict[str, np.ndarray], dict] | None:
    """The current snapshot under `root` as (arrays, meta), or None when there is none (no
    root, or no complete snapshot: leftovers of interrupted writes are ignored). Raises
    CheckpointError naming the snapshot and what is wrong when the current one is damaged
    (unreadable or malformed snapshot.json, another format, a meta that does not match its
    SHA-256, arrays the manifest makes larger than `max_bytes` in all (default: this machine's
    memory; checked before anything is allocated), missing or corrupt array data: every
    array's shape, dtype and crc32 are checked against the manifest)."""
    root = Path(root).absolute()
    if not root.is_dir():
        return None
    if max_bytes is None:
        max_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with _locked(root, exclusive=False):
        current = _current(root)
        return None if current is None else _read(current, max_bytes)


# ---- the writer's steps (each one a function, so a test can interrupt any of them) -----------
def _checkpointer() -> ocp.StandardCheckpointer:
    """Orbax's checkpointer for this process alone: a snapshot is host arrays one process
    writes or reads, in a multi-process group too (orbax would otherwise wait for every
    process at its barriers)."""
    import jax

    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"leyline-snapshot-{me}"
    )
    return ocp.StandardCheckpointer(multiprocessing_options=alone)


def _write_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    with _checkpointer() as ckptr:
        ckptr.save(path, dict(arrays))
        ckptr.wait_until_finished()


def _write_meta(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path` (orbax's own files included), deepest
    first, so the rename that follows publishes data that is on disk."""
    for folder, _, files in os.walk(path, topdown=False):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def _commit(temp: Path, done: Path) -> None:
    """The one step that makes the new snapshot current: an atomic rename, made durable."""
    os.rename(temp, done)
    _fsync(done.parent)


def _remove_old(root: Path, keep: Path) -> None:
    """Remove every snapshot and leftover but `keep` (the current one), once it is current."""
    _remove([p for _, p in _entries(root) if p != keep], root)


def _clear_leftovers(root: Path) -> None:
    """Before a write: remove what earlier writes left (temporary directories, snapshots
    older than the current one)."""
    current = _current(root)
    _remove([p for _, p in _entries(root) if p != current], root)


# ---- helpers ----------------------------------------------------------------------------------
def _digest(meta: dict) -> str:
    """SHA-256 of the meta's canonical JSON (what a read recomputes)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data) if a.size else 0


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(paths: list[Path], root: Path) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    if paths:
        _fsync(root)


def _entries(root: Path) -> list[tuple[int, Path]]:
    """(number, path) of every snapshot directory, complete or temporary."""
    out = []
    for p in root.iterdir():
        m = _DONE.fullmatch(p.name) or _TEMP.fullmatch(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return out


def _current(root: Path) -> Path | None:
    done = [(n, p) for n, p in _entries(root) if _DONE.fullmatch(p.name)]
    return max(done)[1] if done else None


@contextlib.contextmanager
def _locked(root: Path, *, exclusive: bool) -> Iterator[None]:
    path = root / LOCK_FILE
    if exclusive:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    else:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # no writer ever ran here
            yield
            return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"snapshot {path} is damaged: {what}")


def _read(path: Path, max_bytes: int) -> tuple[dict[str, np.ndarray], dict]:
    try:
        doc = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise _damaged(path, f"{META_FILE} cannot be read ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict):
        raise _damaged(path, f"{META_FILE} holds no meta object")
    if doc.get("format") != FORMAT:
        raise CheckpointError(
            f"snapshot {path} has format {doc.get('format')!r}; this version reads {FORMAT}"
        )
    if doc.get("meta_sha256") != _digest(doc["meta"]):
        raise _damaged(path, "its meta does not match its SHA-256 (changed after it was written)")
    manifest = doc.get("arrays")
    if not isinstance(manifest, dict):
        raise _damaged(path, f"{META_FILE} holds no array manifest")
    specs = {}
    for name, entry in manifest.items():
        try:
            shape = tuple(int(d) for d in entry["shape"])
            dtype = jnp.dtype(entry["dtype"])
            crc = int(entry["crc32"])
            if min(shape, default=0) < 0:
                raise ValueError("a negative dimension")
        except (KeyError, TypeError, ValueError) as e:
            raise _damaged(path, f"the manifest entry of array {name!r} is malformed") from e
        specs[name] = (shape, dtype, crc)
    size = sum(math.prod(s) * d.itemsize for s, d, _ in specs.values())
    if size > max_bytes:
        raise _damaged(path, f"its manifest declares {size} bytes of arrays, over {max_bytes}")
    stored = {k: np.zeros(s, d) for k, (s, d, _) in specs.items() if math.prod(s)}
    got = {}
    if stored:
        try:
            with _checkpointer() as ckptr:
                got = ckptr.restore(path / ARRAYS_DIR, stored)
        except Exception as e:  # orbax and tensorstore raise many kinds: one error for all
            raise _damaged(path, f"its arrays cannot be read ({type(e).__name__}: {e})") from e
    arrays = {}
    for name, (shape, dtype, crc) in specs.items():
        a = np.asarray(got[name]) if name in stored and name in got else None
        if name not in stored:
            a = np.zeros(shape, dtype)
        if a is None or a.shape != shape or a.dtype != dtype or _crc(a) != crc:
            raise _damaged(
                path, f"array {name!r} does not match its manifest (shape, dtype, crc32)"
            )
        arrays[name] = a
    return arrays, doc["meta"]
