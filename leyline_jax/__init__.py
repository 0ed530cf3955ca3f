"""Leyline-JAX: serving-side KV-cache editing for Multi-head Latent Attention models (and GQA).

The functional core: configuration, RoPE, the Flax decoder (MLA families; the GQA family in
`leyline_jax.gqa`) and its Hugging Face / GGUF loader, the paged KV state, paged
prefill/decode, and directives (AMORTIZE, FORGET, DECAY, MOVE).

Dimension letters used in shape comments across the package:
    B batch (sequences)    T query tokens       S key slots          P pages
    L layers               N attention heads    H hidden size        V vocabulary
    R kv_lora_rank         Dr qk_rope_head_dim  Dn qk_nope_head_dim  Dv v_head_dim
    E routed experts       I expert intermediate size                k experts per token
    G KV heads (GQA)       D head dimension (GQA)
"""

from leyline_jax.allocator import OutOfPagesError, SequenceError, fork, free
from leyline_jax.config import MLAConfig
from leyline_jax.directives import (
    Applied,
    Directive,
    DirectiveError,
    Mode,
    Source,
    apply_directive,
    apply_directives,
)
from leyline_jax.gqa import GQAConfig
from leyline_jax.hf_config import ConfigError
from leyline_jax.importance import decay_selection
from leyline_jax.kv_state import PagedKVState, init_state, tokens
from leyline_jax.loader import load_model
from leyline_jax.model import CausalLM
from leyline_jax.paged import decode, prefill
from leyline_jax.safetensors import CheckpointError, CheckpointNotFoundError
from leyline_jax.sharding import MeshConfig, shard_model

__all__ = [
    "Applied",
    "CausalLM",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "Directive",
    "GQAConfig",
    "DirectiveError",
    "Mode",
    "MLAConfig",
    "Source",
    "decay_selection",
    "MeshConfig",
    "OutOfPagesError",
    "apply_directive",
    "apply_directives",
    "PagedKVState",
    "SequenceError",
    "decode",
    "fork",
    "free",
    "init_state",
    "load_model",
    "prefill",
    "shard_model",
    "tokens",
]
