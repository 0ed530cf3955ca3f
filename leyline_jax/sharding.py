"""A device mesh and the logical-axis rules that place a model and its paged cache on it.

Kept apart from the model's config: the same checkpoint serves on one device or on many, and
only this runtime object changes. A `MeshConfig` holds a `jax.sharding.Mesh` with two axes,
`data` and `model`, and rules mapping logical axes to them:

- attention heads (`heads`, `kv_heads`), dense MLP width (`mlp`) and the vocabulary (`vocab`)
  over `model` (tensor parallelism);
- routed experts (`expert`) over `model` too by default (expert parallelism on the same chips
  as tensor parallelism); a rule can name another mesh axis;
- the paged cache's pages (`pages`) over `data`: the MLA latent has no head axis to split, so
  its pools are split by page;
- everything else (norms, the router, the latent projections) replicated.

A dimension a rule names is split only where the mesh axis divides its size; otherwise it is
replicated. Head axes are stored flattened (`[H, N * D]`), so a divisible width may be split
through a head (the partitioner computes the same result; only communication differs).

The computation is left to XLA's SPMD partitioner: every jitted step takes its operands with
these shardings and the pools keep theirs across steps (`KVPools.with_bands`), so a
step under a mesh computes what it computes on one device (up to the order of reductions) and
never recompiles in steady state. Under a mesh of several devices the kernels take their jnp
paths (`KVPools.kernel_impl`): a compiled Pallas kernel is one call the partitioner cannot
split (not yet wrapped in `shard_map`).
Host bookkeeping (page tables, lengths, token ids) is the same on every mesh; page ids are
global, and the page allocator does not keep a sequence's pages on one `data` shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "model")

DEFAULT_RULES: Mapping[str, str | None] = {
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "expert": "model",
    "pages": "data",
}


def param_axes(path: Sequence[str], ndim: int) -> tuple[str | None, ...]:
    """The logical axes of a `CausalLM` parameter from its key path (every key a string, e.g.
    ("layers", "3", "attn", "k_up")): one name or None per dimension. The one table of what
    each parameter's dimensions mean; unknown parameters are replicated."""
    path = tuple(path)
    leaf = path[-1]
    parent = path[-2] if len(path) > 1 else ""
    if path == ("embed",):
        return ("vocab", None)
    if parent == "lm_head":
        return (None, "vocab")
    if parent in ("q_proj", "q_b_proj"):
        return (None, "heads")
    if parent in ("k_proj", "v_proj"):  # GQA: the KV heads
        return (None, "kv_heads")
    if parent == "o_proj":
        return ("heads", None)
    if leaf in ("k_up", "v_up"):  # MLA's up-projections, head-major
        return ("heads", None, None)
    if parent == "experts":  # [E, H, I] / [E, I, H]
        return ("expert", None, None)
    if parent in ("gate_proj", "up_proj"):
        return (None, "mlp")
    if parent == "down_proj":
        return ("mlp", None)
    return (None,) * ndim


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A mesh with axes ("data", "model") and logical-axis rules (see the module docstring).

    Build one with `MeshConfig.create(data=2, model=4)` (the first data*model devices) or
    from a `jax.sharding.Mesh` of your own with those axis names."""

    mesh: Mesh
    rules: Mapping[str, str | None] = dataclasses.field(default_factory=lambda: dict(DEFAULT_RULES))

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh, got {self.mesh!r}")
        if tuple(self.mesh.axis_names) != MESH_AXES:
            raise ValueError(f"mesh axes must be {MESH_AXES}, got {self.mesh.axis_names}")
        for logical, axis in self.rules.items():
            if logical not in DEFAULT_RULES:
                raise ValueError(f"rule {logical!r}: not a logical axis {sorted(DEFAULT_RULES)}")
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(f"rule {logical!r} -> {axis!r}: not a mesh axis {MESH_AXES}")
        # rules given override the defaults; a logical axis they leave out keeps its default
        object.__setattr__(self, "rules", {**DEFAULT_RULES, **self.rules})

    def __hash__(self):  # rules is a dict: hash by value
        return hash((self.mesh, tuple(sorted(self.rules.items()))))

    @classmethod
    def create(cls, data: int = 1, model: int = 1, devices=None, rules=None) -> MeshConfig:
        """A data x model mesh over the first data*model of `devices` (default: all devices).
        Raises ValueError when there are not that many devices."""
        for name, v in (("data", data), ("model", model)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        devices = jax.devices() if devices is None else list(devices)
        if data * model > len(devices):
            raise ValueError(
                f"a {data}x{model} mesh needs {data * model} devices, have {len(devices)}"
            )
        grid = np.asarray(devices[: data * model], dtype=object).reshape(data, model)
        mesh = Mesh(grid, MESH_AXES)
        return cls(mesh, dict(rules or {}))

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def spec(self, logical: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
        """The partition of an array with these logical axes: each named dimension over its
        rule's mesh axis where that axis divides it, else replicated; a mesh axis is used at
        most once."""
        used: set[str] = set()
        out = []
        for name, size in zip(logical, shape, strict=True):
            axis = self.rules.get(name) if name is not None else None
            n = 1 if axis is None else self.mesh.shape[axis]
            if n == 1 or axis in used or size % n:
                out.append(None)
            else:
                used.add(axis)
                out.append(axis)
        while out and out[-1] is None:  # the canonical form XLA hands back for a step's outputs
            out.pop()
        return PartitionSpec(*out)

    def sharding(self, logical: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))

    def param_sharding(self, path: Sequence[str], shape: Sequence[int]) -> NamedSharding:
        """Where a model parameter lives (`path`: its key path, every key a string)."""
        return self.sharding(param_axes(path, len(shape)), shape)

    def pool_sharding(self, shape: Sequence[int]) -> NamedSharding:
        """Where one layer's pool band `[P, page_size, ...]` lives: split by page."""
        return self.sharding(("pages",) + (None,) * (len(shape) - 1), shape)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def key_path(path) -> tuple[str, ...]:
    """A jax tree key path as `param_sharding` takes it: every key a string (dict keys, list
    indices and attribute names alike)."""

    def one(key) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    return tuple(one(k) for k in path)


def shard_model(model, mesh: MeshConfig):
    """The model with every parameter placed by `mesh` (a new module; `model` is unchanged)."""
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)

    def place(path, leaf):
        return jax.device_put(leaf, mesh.param_sharding(key_path(path), leaf.shape))

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(place, pure))
    return nnx.merge(graphdef, state)


__all__ = ["DEFAULT_RULES", "MESH_AXES", "MeshConfig", "key_path", "param_axes", "shard_model"]
