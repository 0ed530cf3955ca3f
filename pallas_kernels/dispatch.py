"""The `impl` argument every kernel's dispatch takes: one owner for its names and defaults."""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu

IMPLS = ("jnp", "pallas", "interpret", "tpu_interpret")


def resolve(impl: str | None) -> tuple[str, object]:
    """`impl` -> (name, what `pallas_call(interpret=...)` takes; None for "jnp").

    None: the compiled kernel on TPU, the jnp reference elsewhere. "jnp": the reference;
    "pallas": the compiled kernel; "interpret": the kernel under Pallas' generic interpreter;
    "tpu_interpret": under the TPU-semantics interpreter (in-place aliasing executed as the
    hardware would). Raises ValueError for any other value."""
    if impl is None:
        impl = "pallas" if jax.default_backend() == "tpu" else "jnp"
    if impl == "jnp":
        return impl, None
    if impl == "pallas":
        return impl, False
    if impl == "interpret":
        return impl, True
    if impl == "tpu_interpret":
        return impl, pltpu.InterpretParams()
    raise ValueError(f"unknown impl {impl!r}: None, {', '.join(IMPLS)}")
