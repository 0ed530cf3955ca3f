"""Checkpoint tooling: orbax save/restore of converted params, atomic snapshot files (a
serving engine's sessions go through them), tiny test checkpoints (`checkpoints.tiny`) and
random checkpoints at real model shapes, written streaming (`checkpoints.random_hf`).

Imports `leyline_jax`; `leyline_jax` never imports this package.
"""

from checkpoints.orbax_io import restore_params, save_params
from checkpoints.sessions import read_snapshot, write_snapshot

__all__ = ["read_snapshot", "restore_params", "save_params", "write_snapshot"]
