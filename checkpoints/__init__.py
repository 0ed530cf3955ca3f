"""Checkpoint tooling: orbax save/restore of converted params, tiny test checkpoints.

Imports `leyline_jax`; `leyline_jax` never imports this package.
"""

from checkpoints.orbax_io import restore_params, save_params

__all__ = ["restore_params", "save_params"]
