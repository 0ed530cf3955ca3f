"""What the jax parts share besides `benchmarks.harness` (timing, the machine's rates measured in
the same run): the device's description, a random model made on the device, and the
implementation a lowered program runs (`kernel_in`; `Programs` for the programs a step runs
inside the library)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.device.shapes import SPEC_PEAKS
from leyline_jax.loader import model_from_params
from leyline_jax.model import CausalLM

# Custom-call targets of a lowered program -> the kernel a row names (none of them: "jnp", XLA's
# own code). Mosaic GPU and Mosaic TPU are the project's kernels; Triton (Pallas on GPU) and
# cuDNN's fused attention (a library attention, e.g. `jax.nn.dot_product_attention`) are named
# where a step calls them.
KERNEL_CALLS = {
    "mosaic_gpu": "mosaic_gpu",
    "tpu_custom_call": "tpu",
    "__gpu$xla.gpu.triton": "triton",
    "triton_kernel_call": "triton",
    "__cudnn$fmha": "cudnn",
}

# HOOK: the jitted programs of `leyline_jax.paged` a model step runs (one per kind of layer, or
# the whole model as one program), by module attribute. `Programs` records their calls to name a
# row's implementation from what ran; a name the module no longer has is passed over (the row
# then reads "unread"), so a step that moves to other programs needs their names added here.
STEP_PROGRAMS = ("leyline_jax.paged", ("layer_step", "_whole_step"))


def kernel_in(text: str) -> str | None:
    """The kernels a lowered program calls, "+"-joined in `KERNEL_CALLS` order ("mosaic_gpu",
    "tpu", "mosaic_gpu+cudnn"), or None (the jnp path: XLA's own code)."""
    found = dict.fromkeys(k for call, k in KERNEL_CALLS.items() if call in text)
    return "+".join(found) or None


def _abstract(x):
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def _signature(x):
    return (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else repr(x)


class Programs:
    """Inside `with Programs():` every call of the programs named by `STEP_PROGRAMS` is recorded
    (the module's attributes are replaced by recording wrappers, restored on exit), once per
    distinct static argument and argument shapes; `path()` then lowers each recorded program at
    those shapes (jax's trace cache returns the trace that ran, kernel branches included) and
    names the kernels they call. Wrap an untimed run (a warm-up): recording costs a pytree
    flatten per call."""

    def __init__(self, spec=STEP_PROGRAMS):
        self.module, self.names = importlib.import_module(spec[0]), spec[1]
        self.calls: dict = {}  # key -> (name, program, static, treedef, abstract leaves)
        self._saved: dict = {}

    def _wrap(self, name: str, program):
        def recording(static, *args, **kwargs):
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
            key = (name, static, treedef, tuple(map(_signature, leaves)))
            if key not in self.calls:
                self.calls[key] = (name, program, static, treedef, [_abstract(x) for x in leaves])
            return program(static, *args, **kwargs)

        return recording

    def __enter__(self) -> Programs:
        for name in self.names:
            if hasattr(self.module, name):
                self._saved[name] = getattr(self.module, name)
                setattr(self.module, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, program in self._saved.items():
            setattr(self.module, name, program)
        self._saved = {}

    def path(self) -> dict:
        """{"path": the kernels the recorded programs call ("+"-joined), "jnp" where none
        does, "unread" where no named program ran, "error: ..." where one does not lower;
        "programs": each program's name and kernel}."""
        programs, found = [], {}
        for name, program, static, treedef, leaves in self.calls.values():
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            try:
                kernel = kernel_in(program.lower(static, *args, **kwargs).as_text())
            except Exception as e:  # noqa: BLE001  (recorded: the row's numbers stand)
                return dict(path=f"error: {type(e).__name__}: {str(e)[:300]}", programs=programs)
            programs.append(dict(program=name, kernel=kernel))
            found |= dict.fromkeys((kernel or "").split("+"))
        found.pop("", None)
        path = "+".join(found) or ("jnp" if programs else "unread")
        return dict(path=path, programs=programs)


@contextlib.contextmanager
def recorded(into: dict):
    """`Programs` over the block; its `path()` written into `into` on a normal exit."""
    with Programs() as programs:
        yield programs
    into.update(programs.path())


def device_info() -> dict:
    d = jax.devices()[0]
    return dict(
        platform=d.platform,
        device_kind=d.device_kind,
        device_count=jax.device_count(),
        jax=jax.__version__,
        jaxlib=importlib.metadata.version("jaxlib"),
        spec_peaks=SPEC_PEAKS.get(d.device_kind),
    )


@functools.partial(jax.jit, static_argnums=1)
def _random_params(key, specs, std) -> list:
    """One array per (shape, dtype, is_norm) of `specs`, all in one program: one compile (a
    program per shape, or normals' erfinv, cost the CPU smoke seconds of compiling)."""
    keys = jax.random.split(key, len(specs))
    half = std * 3**0.5  # uniform on [-half, half] has standard deviation std
    return [
        jnp.ones(shape, dtype)
        if norm
        else jax.random.uniform(k, shape, jnp.float32, -half, half).astype(dtype)
        for (shape, dtype, norm), k in zip(specs, keys, strict=True)
    ]


def random_model(config, dtype=jnp.bfloat16, *, std: float = 0.02, seed: int = 0) -> CausalLM:
    """A model of `config` with random weights made on the default device from the abstract
    model's shapes (nothing is built on the host): norms 1, everything else uniform with
    standard deviation `std` (0.02, V2-Lite's initializer_range: 27 layers of bf16 activations
    stay finite; the generator is XLA's own, "rbg", quick to compile and to run). The
    routers' weights are random too, so tokens spread over the experts as a trained router
    spreads them rather than all picking the same few."""
    abstract = nnx.eval_shape(lambda: CausalLM(config, dtype))
    spec = nnx.to_pure_dict(nnx.split(abstract)[1])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(spec)
    specs = tuple(
        (tuple(leaf.shape), jnp.dtype(leaf.dtype), "norm" in jax.tree_util.keystr(path))
        for path, leaf in leaves
    )
    params = _random_params(jax.random.key(seed, impl="rbg"), specs, std)
    return model_from_params(config, jax.tree_util.tree_unflatten(treedef, params), dtype)
