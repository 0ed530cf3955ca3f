"""Pallas kernels, each beside a plain-jnp reference with the same signature.

Kernels take raw arrays and keyword-only static knobs; this package never imports `leyline_jax`.
"""
