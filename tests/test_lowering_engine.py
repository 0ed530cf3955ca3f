"""The lowering gate over the engine's own programs (test_lowering.py gates the kernels alone):
each jitted program a step, an edit or a turn runs, exported here for TPU and for CUDA with
abstract params at real shapes (DeepSeek-V2-Lite, DeepSeek-V3: 128 heads, 61 layers, 256
experts; a Llama-3-8B-shaped GQA model), nothing allocated. The layer step (one program per kind
of layer: dense, MoE) at the smallest and the largest token bucket of a default engine state
holds each platform's attention kernel call where the kernel takes the shapes (TPU: the MLA
form; CUDA: both forms); the splice step holds each platform's splice kernel; the embedding,
logits, zeroing and sampling programs hold no kernel and lower for both. An edit's splice (a
block of runs) is one program over every layer of the model on an accelerator, and one program a
layer called on each in turn on this CPU (`pallas_kernels.dispatch.per_layer_programs`).

A jitted program keeps the kernel branches of its first trace (the dispatch's choice is made
when it is traced, and jax's trace cache does not see `lowering_for`), so each export here
starts from a cleared cache of the program it exports. Under an 8-device mesh (every kernel
gives way to jnp there: `KVPools.kernel_impl`) the layer step is gated in
tests/multidevice/test_mesh.py, with `sharded_step_args` from here."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from leyline_jax import kv_pools, paged, splice
from leyline_jax import kv_state as kv
from leyline_jax import model as models
from leyline_jax.loader import config_from_hf
from leyline_jax.sharding import key_path
from pallas_kernels.dispatch import lowering_for
from pallas_kernels.splice_rotate import Runs
from serve.sampling import sample
from tests.test_lowering import kernel_calls

SDS = jax.ShapeDtypeStruct
CALLS = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu"}
PAGES, PAGE, MAX_SEQS = 4096, 16, 64
V2_LITE = json.loads(
    (Path(__file__).parents[1] / "checkpoints" / "v2_lite_config.json").read_text()
)
V3 = dict(
    model_type="deepseek_v3",
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    vocab_size=129280,
    rope_theta=10000,
    routed_scaling_factor=2.5,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
LLAMA_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
)
MODELS = {"v2-lite": V2_LITE, "v3": V3, "llama-8b": LLAMA_8B}
# which platforms' attention kernels take the model's step (TPU's is MLA-only)
ATTENTION = {"v2-lite": ("tpu", "cuda"), "v3": ("tpu", "cuda"), "llama-8b": ("cuda",)}


def i32(*shape):
    return SDS(shape, jnp.int32)


def f32(*shape):
    return SDS(shape, jnp.float32)


def abstract(name, mesh=None):
    """(config, Split of an abstract bf16 model, one layer's pools); with a
    `leyline_jax.MeshConfig`, every array placed as the mesh's rules place it."""
    config = config_from_hf(MODELS[name])
    model = nnx.eval_shape(lambda: models.CausalLM(config, jnp.bfloat16))
    bands = config.kv_bands()
    shapes = {"moved": (PAGES, PAGE, *bands.moved), "rotated": (PAGES, PAGE, *bands.rotated)}
    at = dict.fromkeys(shapes)
    if mesh is not None:
        graphdef, state = nnx.split(model)

        def place(path, x):
            return SDS(x.shape, x.dtype, sharding=mesh.param_sharding(key_path(path), x.shape))

        pure = jax.tree_util.tree_map_with_path(place, nnx.to_pure_dict(state))
        nnx.replace_by_pure_dict(state, pure)
        model = nnx.merge(graphdef, state)
        at = {k: mesh.pool_sharding(v) for k, v in shapes.items()}
    pools = kv_pools.KVPools(
        moved=(SDS(shapes["moved"], kv_pools.storage_dtype(jnp.bfloat16), sharding=at["moved"]),),
        rotated=(SDS(shapes["rotated"], jnp.float32, sharding=at["rotated"]),),
        page_size=PAGE,
        moved_dtype=jnp.dtype(jnp.bfloat16),
        rotated_dtype=jnp.dtype(jnp.float32),
        sharding=at["moved"],
    )
    return config, models.Split.of(model), pools


def sharded_step_args(name, mesh, t=8):
    """The last kind of layer's step arguments at bucket t, placed by `mesh`."""
    config, split, one = abstract(name, mesh)
    meta = (i32(t), i32(t, PAGES), i32(t + 1), i32(1))
    h = SDS((t, config.hidden_size), jnp.bfloat16)
    return (*split.layers[-1], one, h, i32(t), i32(t), i32(t), i32(t), meta)


def exported(program, args, platform) -> str:
    program.clear_cache()  # a fresh trace: the kernel branches for `platform`
    with lowering_for(platform):
        return jax.export.export(program, platforms=[platform])(*args).mlir_module()


def buckets():
    ladder = kv.ladder(kv.MAX_STEP_TOKENS)
    return [ladder[0], ladder[-1]]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_kind_of_layer_step_lowers_with_the_platforms_attention(name):
    config, split, one = abstract(name)
    kinds = {}
    for graph, leaves in split.layers:
        kinds.setdefault(graph, leaves)
    for t in buckets():
        b = min(t, MAX_SEQS)
        h = SDS((t, config.hidden_size), jnp.bfloat16)
        meta = (i32(b), i32(b, PAGES), i32(b + 1), i32(1))
        for graph, leaves in kinds.items():
            args = (graph, leaves, one, h, i32(b), i32(b), i32(t), i32(t), meta)
            for platform, call in CALLS.items():
                text = exported(paged.layer_step, args, platform)
                assert (call in text) is (platform in ATTENTION[name]), (t, platform)


def every_layer(config, one: kv_pools.KVPools) -> kv_pools.KVPools:
    """Abstract pools of every layer of `config`, each as `one`'s."""
    layers = config.num_hidden_layers
    return one.with_bands(one.moved * layers, one.rotated * layers)


def splice_step_args(name):
    """(config, the splice step's arguments over every layer's pools: pools, runs of a block,
    inv_freq, the jnp path's [cos | sin] table)."""
    config, _, one = abstract(name)
    inv = SDS((config.kv_bands().rotated[-1] // 2,), jnp.float32)
    table = SDS((PAGES * PAGE, 2 * inv.shape[0]), jnp.float32)
    return config, (every_layer(config, one), Runs(*[i32(256)] * 5), inv, table)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_splice_is_one_program_over_every_layer(name):
    """An edit's splice step over every layer (V2-Lite 27, V3 61, Llama-8B 32) lowers as one
    module whose arguments are every layer's two pools, running the platform's kernel: on CUDA
    one Mosaic GPU call over every pool, on TPU one kernel call a layer."""
    config, args = splice_step_args(name)
    layers, pools = config.num_hidden_layers, args[0]
    for platform, call in CALLS.items():
        splice.splice_step.clear_cache()  # a fresh trace: the kernel branches for `platform`
        with lowering_for(platform):
            exp = jax.export.export(splice.splice_step, platforms=[platform])(*args)
        shapes = [a.shape for a in exp.in_avals[: 2 * layers]]
        assert shapes == [x.shape for x in (*pools.moved, *pools.rotated)], platform
        calls = kernel_calls(exp.mlir_module(), call)
        assert calls == ([5 + 2 * layers] if platform == "cuda" else [8] * layers), platform


def test_an_edit_runs_one_splice_program_on_an_accelerator():
    """`splice_pools` (what an edit runs for a block of runs) calls the splice step once over
    every layer's pools when traced for TPU or CUDA, and once a layer here on the CPU (so the
    count can fail)."""
    config, (pools, runs, inv, table) = splice_step_args("v2-lite")

    def programs() -> list[int]:  # the splice steps called: the pools each takes
        jaxpr = jax.make_jaxpr(lambda p: splice.splice_pools(p, runs, inv, table))(pools)
        steps = [e for e in jaxpr.eqns if e.params.get("name") == "splice_step"]
        return [len(e.invars) - 7 for e in steps]  # less the runs' 5 arrays, inv_freq, table

    for platform in CALLS:
        splice.splice_step.clear_cache()
        with lowering_for(platform):
            assert programs() == [2 * config.num_hidden_layers], platform
    splice.splice_step.clear_cache()
    assert programs() == [2] * config.num_hidden_layers


@pytest.mark.parametrize("name", ["v3", "llama-8b"])
def test_the_programs_without_kernels_lower_for_both(name):
    """Embedding and logits at the largest bucket, zeroing a layer's pages, sampling."""
    config, split, one = abstract(name)
    t = buckets()[-1]
    b = min(t, MAX_SEQS)
    programs = [
        (models.embed_step, (*split.ends, i32(t))),
        (paged.last_logits, (*split.ends, SDS((t, config.hidden_size), jnp.bfloat16), i32(b))),
        (splice.zero_step, (one, i32(64), i32(64))),
        (sample, (SDS((b, config.vocab_size), jnp.float32), f32(b), f32(b), i32(b), i32(b))),
    ]
    for program, args in programs:
        for platform, call in CALLS.items():
            assert call not in exported(program, args, platform)


def test_the_gate_sees_a_step_that_lost_its_kernel(monkeypatch):
    """A layer step whose pools send every kernel to jnp (as under a split mesh) holds no
    kernel call: the assertion above would fail on it."""
    config, split, one = abstract("v2-lite")
    graph, leaves = split.layers[-1]
    meta = (i32(1), i32(1, PAGES), i32(2), i32(1))
    h = SDS((1, config.hidden_size), jnp.bfloat16)
    args = (graph, leaves, one, h, i32(1), i32(1), i32(1), i32(1), meta)
    monkeypatch.setattr(kv_pools.KVPools, "kernel_impl", lambda self, impl: "jnp")
    for platform, call in CALLS.items():
        assert call not in exported(paged.layer_step, args, platform)
