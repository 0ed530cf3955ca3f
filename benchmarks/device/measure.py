"""What the jax parts share besides `benchmarks.harness` (timing, the machine's rates measured in
the same run): the device's description, and a random model made on the device."""

from __future__ import annotations

import functools
import importlib.metadata

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.device.shapes import SPEC_PEAKS
from leyline_jax.loader import model_from_params
from leyline_jax.model import CausalLM


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
