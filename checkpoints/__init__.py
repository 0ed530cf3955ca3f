"""Checkpoint tooling: orbax save/restore of converted params (`checkpoints.orbax_io`), atomic
snapshot files a serving engine's sessions go through (`checkpoints.sessions`), tiny test
checkpoints (`checkpoints.tiny`) and random checkpoints at real model shapes, written streaming
(`checkpoints.random_hf`).

Imports `leyline_jax`; `leyline_jax` never imports this package.
"""
