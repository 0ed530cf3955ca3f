"""What a snapshot of KV pages means (`layout`): the model's family, config and a checksum of its
params, the page size and the bands' shapes and dtypes. Two engines may exchange snapshots iff
their layouts are equal; `differences` says, field by field, why not."""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def layout(model, pools) -> dict[str, Any]:
    """What saved KV pages of `pools` mean for `model` (JSON-able): two engines may exchange
    snapshots iff these are equal. `params` is a checksum of the model's params' bits."""
    cfg = model.config
    bands = cfg.kv_bands()
    return {
        "family": cfg.model_type,
        "config": json.loads(json.dumps(cfg.to_dict())),
        "params": params_checksum(model),
        "num_layers": pools.num_layers,
        "page_size": pools.page_size,
        "moved_shape": list(bands.moved),
        "rotated_shape": list(bands.rotated),
        "moved_dtype": jnp.dtype(pools.moved_dtype).name,
        "rotated_dtype": jnp.dtype(pools.rotated_dtype).name,
    }


def differences(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """What differs between a snapshot's layout and an engine's, one line each (a config's
    fields one by one)."""
    out = []
    for key in sorted(set(saved) | set(mine)):
        a, b = saved.get(key), mine.get(key)
        if a == b:
            continue
        if key == "config" and isinstance(a, dict) and isinstance(b, dict):
            fields = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
            out += [f"config.{f}: snapshot {a.get(f)!r}, engine {b.get(f)!r}" for f in fields]
        elif key == "params":
            out.append(f"params: the model's weights differ (checksum {a} vs {b})")
        else:
            out.append(f"{key}: snapshot {a!r}, engine {b!r}")
    return out


@jax.jit
def _bit_sums(leaves):  # list of arrays -> u32[len(leaves)]
    def one(x):
        b = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1).astype(jnp.uint32)
        w = jnp.arange(b.shape[0], dtype=jnp.uint32) % 65521 + 1  # position-weighted
        return jnp.sum(b * w, dtype=jnp.uint32)  # wraps: integer sums are exact anywhere

    return jnp.stack([one(x) for x in leaves])


_checksums: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its checksum


def params_checksum(model) -> str:
    """A checksum of every param's name, shape, dtype and bits (position-weighted byte sums on
    the device, then sha256 on the host): tells another checkpoint or dtype from this one. Not
    cryptographic; computed in integers, so it does not depend on the backend. Computed once a
    model (a served model's params do not change): over a mesh of several processes the sums
    are a collective, which each process makes when it first asks (`serve.multihost`)."""
    if model not in _checksums:
        _checksums[model] = _checksum(model)
    return _checksums[model]


def _checksum(model) -> str:
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    sums = _bit_sums([jnp.asarray(x) for _, x in flat])
    with jax.transfer_guard_device_to_host("allow"):
        sums = np.asarray(sums)
    h = hashlib.sha256()
    for (path, x), v in zip(flat, sums, strict=True):
        h.update(f"{jax.tree_util.keystr(path)}|{x.shape}|{jnp.dtype(x.dtype).name}|{v};".encode())
    return h.hexdigest()[:16]
