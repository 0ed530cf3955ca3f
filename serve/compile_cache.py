"""JAX's persistent compilation cache, on by default for the command-line entry points.

A process compiles each step shape once (tens of programs for a demo, hundreds for a long
replay); with the cache on, a later process loads them from disk instead, so a second
`make run` starts in seconds. The library itself never turns it on: that is the embedding
program's choice (`enable` is public for it).

Where: `--compile-cache DIR` on the command line, else `$LEYLINE_COMPILE_CACHE`, else
`~/.cache/leyline_jax/xla`; `off` turns it off.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "LEYLINE_COMPILE_CACHE"
DEFAULT_DIR = Path.home() / ".cache" / "leyline_jax" / "xla"


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Keep compiled programs in `path` (None: `$LEYLINE_COMPILE_CACHE`, else `DEFAULT_DIR`;
    "off": no cache). Call before the first compilation. Returns the directory, or None."""
    where = os.environ.get(ENV, str(DEFAULT_DIR)) if path is None else str(path)
    if where.strip().lower() in ("", "off"):
        return None
    where = Path(where).expanduser()
    where.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(where))
    # a step compiles in about a second or less on CPU, but there are many: keep them all
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where
