"""Safetensors checkpoint files, read on demand: `Safetensors` (a directory's tensors as a mapping
of lazy tensors), `read_safetensors` (all of them at once), the checkpoint errors and the
loader's progress bar.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

# Above this many bytes (of params placed, or of tensors read) the loader shows a progress bar
# (unless told otherwise).
PROGRESS_BYTES = 256 << 20

# safetensors dtype names -> numpy dtypes (bfloat16 and float8 from ml_dtypes, as jax uses)
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, unexpected or mis-shaped tensors, bad files."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory or one of its files does not exist."""


@contextlib.contextmanager
def progress_bar(total: int, progress: bool | None) -> Iterator[Callable[[int], object]]:
    """`advance(nbytes)` for a bar of `total` bytes, shown above `PROGRESS_BYTES` unless told."""
    if not (total > PROGRESS_BYTES if progress is None else progress):
        yield lambda nbytes: None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="loading tensors") as bar:
        yield bar.update


def _shard_files(path: str) -> dict[str, list[str]]:
    """{file: the tensor names the index maps to it, or [] for every tensor of the file}."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e!r}") from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"{index} is not a valid safetensors index: weight_map must map tensor names "
                "to shard file names (strings)"
            )
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(os.path.join(path, fname), []).append(name)
    elif os.path.isfile(single):
        files = {single: []}
    else:
        raise CheckpointNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {path}"
        )
    for fname in files:
        if not os.path.isfile(fname):
            raise CheckpointNotFoundError(f"checkpoint shard {fname} does not exist")
    return files


def _header(fname: str, f: BinaryIO) -> tuple[int, dict[str, Any]]:
    """(byte offset of the data, {name: entry}) of the safetensors file `fname`, open as `f`.
    safetensors' own reader checks the file first (a valid header whose tensors cover the data
    exactly, so a truncated file fails here); only the header's bytes are read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(fname, framework="numpy"):
            pass
    except SafetensorError as e:
        raise CheckpointError(f"cannot read {fname}: {e}") from e
    size = int.from_bytes(f.read(8), "little")
    entries = json.loads(f.read(size))
    entries.pop("__metadata__", None)
    return 8 + size, entries


class _LazyTensor:
    """One tensor of a safetensors file: `shape`, `dtype` and `nbytes` without reading it;
    `np.asarray(t)` reads it (a fresh array each time)."""

    def __init__(self, files: Safetensors, name: str, fname: str, entry: Mapping[str, Any]):
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(f"tensor {name} in {fname} has unknown dtype {entry['dtype']}")
        self._files, self.name, self.fname = files, name, fname
        self.shape = tuple(entry["shape"])
        self.dtype = np.dtype(_DTYPES[entry["dtype"]])
        self.offset = entry["data_offsets"][0]  # from the start of the file's data
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None):
        a = self._files.read(self)
        return a if dtype is None else a.astype(dtype, copy=False)


class Safetensors(Mapping[str, _LazyTensor]):
    """The tensors of a checkpoint directory (`model.safetensors` or a sharded index), read
    only when asked for. Opening opens every file (until `close`) and checks it (missing,
    corrupt, truncated, an index naming a tensor its shard lacks), reading only the headers;
    reading a tensor reads exactly its bytes into a fresh array. A file removed or replaced
    by a rename after opening still reads as it was (its descriptor holds it); one cut short
    in place fails the read that meets its end. No memory map: the pages of a mapped file that
    reads touch count as the process's resident memory until it is unmapped, so one mapped
    shard would hold a whole shard's worth."""

    def __init__(self, path: str):
        self._tensors: dict[str, _LazyTensor] = {}
        self._open: dict[str, BinaryIO] = {}  # file name -> the file, unbuffered
        self._data_start: dict[str, int] = {}
        try:
            for fname, names in _shard_files(path).items():
                f = self._open[fname] = open(fname, "rb", buffering=0)
                self._data_start[fname], entries = _header(fname, f)
                for name in names:
                    if name not in entries:
                        raise CheckpointError(f"index maps {name} to {fname}, which lacks it")
                for name in names or entries:
                    self._tensors[name] = _LazyTensor(self, name, fname, entries[name])
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> _LazyTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def read(self, t: _LazyTensor) -> np.ndarray:
        """Raises `CheckpointError` if the file ends early (cut short since it was opened)."""
        f = self._open[t.fname]
        out = np.empty(t.shape, t.dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        start = self._data_start[t.fname] + t.offset
        f.seek(start)
        done = 0
        while done < t.nbytes:
            n = f.readinto(buf[done:])
            if not n:
                raise CheckpointError(
                    f"cannot read {t.fname}: it ends at byte {start + done}, inside tensor "
                    f"{t.name} (bytes {start}..{start + t.nbytes}): truncated since it was opened"
                )
            done += n
        return out

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self) -> Safetensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_safetensors(path: str | os.PathLike, *, progress: bool | None = None) -> dict[str, Any]:
    """All tensors of a checkpoint directory (`model.safetensors` or a sharded index) as numpy,
    at once (`load_model` reads them one at a time instead)."""
    with Safetensors(os.fspath(path)) as files:
        tensors = {}
        with progress_bar(sum(t.nbytes for t in files.values()), progress) as advance:
            for name, t in files.items():
                tensors[name] = np.asarray(t)
                advance(t.nbytes)
        return tensors
