"""Save and restore converted `CausalLM` params with orbax-checkpoint.

Layout of a saved directory: `mla_config.json` (the model's config, of any family; the params
dtype and the params layout version) and `params/` (an orbax StandardCheckpointer tree of the
model's params).

Params layout 2: the latent up-projection is held head-major as `k_up` / `v_up` (layout 1, the
saves made before, held the checkpoint's `kv_b_proj`). A save of another layout is refused with a
`CheckpointError` saying so: convert the Hugging Face checkpoint again and save it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from leyline_jax import CausalLM
from leyline_jax.loader import config_from_dict, model_from_params
from leyline_jax.safetensors import CheckpointError, CheckpointNotFoundError

CONFIG_FILE = "mla_config.json"
PARAMS_LAYOUT = 2


def save_params(path: str | os.PathLike, model: CausalLM) -> Path:
    """Write `model`'s config and params under `path` (which must not exist yet)."""
    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"{path} already exists; orbax will not overwrite a checkpoint")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", params)
        ckptr.wait_until_finished()
    meta = {
        "config": model.config.to_dict(),
        "dtype": jnp.dtype(model.dtype).name,
        "params_layout": PARAMS_LAYOUT,
    }
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return path


def restore_params(path: str | os.PathLike) -> CausalLM:
    """Rebuild the `CausalLM` saved by `save_params` at `path`."""
    path = Path(path).absolute()
    meta_file = path / CONFIG_FILE
    if not meta_file.is_file() or not (path / "params").is_dir():
        raise CheckpointNotFoundError(f"{path} holds no saved params ({CONFIG_FILE} + params/)")
    meta = json.loads(meta_file.read_text())
    layout = meta.get("params_layout", 1)
    if layout != PARAMS_LAYOUT:
        raise CheckpointError(
            f"{path} holds params layout {layout!r}; this version reads layout {PARAMS_LAYOUT} "
            "(k_up / v_up instead of kv_b_proj): convert the Hugging Face checkpoint again "
            "(ll.load_model) and save it"
        )
    config = config_from_dict(meta["config"])
    dtype = jnp.dtype(meta["dtype"])
    abstract = nnx.eval_shape(lambda: CausalLM(config, dtype))
    target = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(path / "params", target)
    return model_from_params(config, params, dtype)
