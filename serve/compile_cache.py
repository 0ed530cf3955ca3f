"""JAX's persistent compilation cache, on by default for the command-line entry points.

A process compiles each step shape once (tens of programs for a demo, hundreds for a long
replay); with the cache on, a later process loads them from disk instead, so a second
`make run` starts in seconds. The library itself never turns it on: that is the embedding
program's choice (`enable` is public for it).

Where: `--compile-cache DIR` on the command line, else `$LEYLINE_COMPILE_CACHE`, else
`~/.cache/leyline_jax/xla`; `off` turns it off.

Beside the programs, `kept` keeps other slow-to-make text a start needs (a GGUF file's
tokenizer, which transformers takes about 7 s to build) in `DIR-text`, so a warm start reads it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import jax

ENV = "LEYLINE_COMPILE_CACHE"
DEFAULT_DIR = Path.home() / ".cache" / "leyline_jax" / "xla"
_text_dir: Path | None = None  # where `kept` keeps text; None: the cache is off


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Keep compiled programs in `path` (None: `$LEYLINE_COMPILE_CACHE`, else `DEFAULT_DIR`;
    "off": no cache). Call before the first compilation. Returns the directory, or None."""
    global _text_dir
    where = os.environ.get(ENV, str(DEFAULT_DIR)) if path is None else str(path)
    if where.strip().lower() in ("", "off"):
        _text_dir = None
        return None
    where = Path(where).expanduser()
    where.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(where))
    # a step compiles in about a second or less on CPU, but there are many: keep them all
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _text_dir = where.with_name(where.name + "-text")
    return where


def kept(key: str, make: Callable[[], str]) -> str:
    """`make()`, kept under `key` (any string naming what it is made from) while the cache is
    on: a later process reads the text back instead of making it again."""
    if _text_dir is None:
        return make()
    f = _text_dir / hashlib.sha256(key.encode()).hexdigest()
    if f.is_file():
        return f.read_text()
    text = make()
    _text_dir.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(f)  # whole or not at all
    return text
