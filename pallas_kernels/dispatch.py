"""The `impl` argument every kernel's dispatch takes: one owner for its names and defaults.

A kernel module says which accelerators it has a compiled kernel for (its `targets`, e.g.
("tpu", "gpu")); `resolve` turns an explicit `impl` into which implementation runs and how:

- None (not `resolve`'s: `on_platform`): chosen per platform when the program is lowered, not
  when it is traced (`jax.lax.platform_dependent`): each kernel module says which platform
  gets which kernel, every other one the jnp reference (CPU always). Only the platforms the
  program may be lowered for get a branch (`lowering_platforms`: jax's backend, or those named
  by `lowering_for`, as an export for another platform does): tracing the kernel branches
  costs 0.3-0.4 s a splice program against 0.02 s, for nothing on a CPU. The choice is part
  of the traced program, so a jitted function traced before `lowering_for` keeps its earlier
  one. One artifact for several
  platforms at once does not lower with jax 0.10 (a Pallas TPU call has no CPU lowering).
  From the same facts `per_layer_programs` says whether a step over every layer's pools is
  one program (accelerators) or one a layer (the jnp path on a CPU).
- "jnp": the reference.
- "pallas": the compiled kernel for this backend (on a backend it has no version for, the first
  target's kernel, which then fails to compile there).
- "interpret": that kernel under its interpreter (Pallas' generic one for the TPU kernel,
  Mosaic GPU's for the GPU kernel).
- "tpu_interpret": the TPU kernel under the TPU-semantics interpreter, which executes in-place
  aliasing as the hardware would (the generic interpreter gathers before it scatters).
- "gpu_interpret": the GPU kernel under Mosaic GPU's interpreter (simulated shared memory,
  barriers and copies).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import jax
from jax.experimental.pallas import tpu as pltpu

IMPLS = ("jnp", "pallas", "interpret", "tpu_interpret", "gpu_interpret")


class Impl(NamedTuple):
    name: str  # one of IMPLS
    target: str | None  # the kernel that runs: "tpu" or "gpu"; None for the jnp reference
    interpret: object  # what the kernel's `interpret=` takes; None for the jnp reference


_LOWERING_FOR = contextvars.ContextVar("lowering_for", default=None)


@contextlib.contextmanager
def lowering_for(*platforms: str):
    """Programs traced inside may be lowered for `platforms` ("cpu", "tpu", "cuda"): each gets
    its kernel's branch (an export from this machine for another platform traces inside)."""
    token = _LOWERING_FOR.set(frozenset(platforms))
    try:
        yield
    finally:
        _LOWERING_FOR.reset(token)


def lowering_platforms() -> frozenset[str]:
    """The platforms a program traced now may be lowered for: `lowering_for`'s, else jax's
    backend (a GPU backend: "cuda" and "rocm")."""
    chosen = _LOWERING_FOR.get()
    if chosen is not None:
        return chosen
    backend = jax.default_backend()
    return frozenset(("cuda", "rocm") if backend == "gpu" else (backend,))


def on_platform(reference, args: tuple, **kernels):
    """`reference(*args)`, or `kernels[p](*args)` on platform p ("tpu", "cuda", ...), the choice
    made when the program is lowered: each kept branch is traced, only the lowering platform's
    is compiled (the compiler never sees a conditional). Branches for platforms outside
    `lowering_platforms` are not traced at all."""
    kernels = {p: k for p, k in kernels.items() if p in lowering_platforms()}
    if not kernels:
        return reference(*args)
    return jax.lax.platform_dependent(*args, default=reference, **kernels)


def per_layer_programs(impl: str | None) -> bool:
    """Whether a step over every layer's pools runs as one compiled program a layer, called on
    each layer in turn (True), rather than one program over all of them (False). True only
    where the jnp path runs on a CPU (`impl` None or "jnp", and every platform the program may
    be lowered for is a CPU): a program a layer keeps compile time flat in depth there, where
    one program's grows with it. An accelerator runs one program (one dispatch, not one a
    layer), and so does a kernel's interpreter, which stands in for one. (Measured on the
    splice: `leyline_jax.splice`'s module docstring.)"""
    return impl in (None, "jnp") and lowering_platforms() <= {"cpu"}


def hopper() -> bool:
    """Whether a CUDA lowering may take a Mosaic GPU kernel (compute capability 9.x or 10.x:
    Hopper, datacenter Blackwell): False only when jax runs on another GPU now; a program
    traced elsewhere and lowered for CUDA assumes a Hopper (H100, H200)."""
    if jax.default_backend() != "gpu":
        return True
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    major = capability.split(".")[0]
    return major.isdigit() and int(major) in (9, 10)


def mosaic_gpu_interpret():
    """Mosaic GPU's interpreter's params (private in jax 0.10 and 0.11): simulated SMEM,
    barriers, TMA; memory never written reads 0 ("nan" does not take barriers)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(uninitialized_memory="zero")


def resolve(impl: str | None, targets: tuple[str, ...] = ("tpu",)) -> Impl:
    """`impl` -> `Impl` for a kernel with compiled versions for `targets` (see the module
    docstring; None: the kernel for the backend jax runs on now, where one is needed before
    lowering). Raises ValueError for a name outside IMPLS or an interpreter of a target the
    kernel lacks."""
    backend = jax.default_backend()
    native = backend if backend in targets else None
    if impl is None:
        impl = "pallas" if native else "jnp"
    if impl == "jnp":
        return Impl(impl, None, None)
    if impl == "pallas":
        return Impl(impl, native or targets[0], False)
    if impl == "interpret":
        return Impl(impl, native or targets[0], True)
    if impl == "tpu_interpret" and "tpu" in targets:
        return Impl(impl, "tpu", pltpu.InterpretParams())
    if impl == "gpu_interpret" and "gpu" in targets:
        return Impl(impl, "gpu", True)
    names = [n for n in IMPLS if not n.endswith("_interpret") or n.split("_")[0] in targets]
    raise ValueError(f"unknown impl {impl!r}: None, {', '.join(names)}")
