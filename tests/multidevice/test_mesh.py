"""Under a device mesh everything computes what it computes on one device.

Runs in its own pytest process with 8 simulated CPU devices (`tests/test_multidevice.py`
starts it: the device count is fixed when jax initialises). On meshes 1x8, 2x4 and 8x1 (data x
model): the full forward of every family, paged prefill and decode, AMORTIZE and FORGET, and
the serving engine (greedy turns with directives) against the one-device results, in fp32 (bf16
pools would let a 1e-7 difference in reduction order flip one element's rounding: a 4e-3 step);
and a mesh's steady state compiles nothing new.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import leyline_jax as ll
from checkpoints.tiny import TINY_GQA_CONFIGS, TINY_HF_CONFIGS, write_random_checkpoint
from leyline_jax import kv_pools, paged, splice
from serve.engine import Engine, SamplingParams
from serve.sampling import sample

MESHES = [(1, 8), (2, 4), (8, 1)]
REL = 1e-5
PS = 4


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One-device models of every family (two layers: a dense one and a MoE one)."""
    root = tmp_path_factory.mktemp("mesh_ckpts")

    @functools.cache
    def get(name):
        cfg = {**{**TINY_HF_CONFIGS, **TINY_GQA_CONFIGS}[name], "num_hidden_layers": 1}
        if "n_routed_experts" in cfg:  # the one layer is a MoE layer: experts get split
            cfg.pop("mlp_layer_types", None)
            cfg["first_k_dense_replace"] = 0
        return ll.load_model(write_random_checkpoint(root / name, cfg, seed=3))

    return get


def test_eight_devices():
    assert jax.device_count() == 8


@pytest.fixture(params=MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def mesh(request):
    return ll.MeshConfig.create(*request.param)


def test_params_are_split_as_the_rules_say(models, mesh):
    """Experts and heads over `model` where it divides them (8 experts; 4 heads: whole on an
    8-way axis), norms replicated."""
    m = ll.shard_model(models("deepseek_v2"), mesh)
    n = mesh.shape["model"]
    experts = m.layers[0].mlp.experts.gate[...]
    k_up = m.layers[0].attn.k_up[...]

    def rows(a):
        return {x.data.shape[0] for x in a.addressable_shards}

    assert rows(experts) == {experts.shape[0] // n}
    assert rows(k_up) == {k_up.shape[0] // n if k_up.shape[0] % n == 0 else k_up.shape[0]}
    assert m.layers[0].input_norm.weight[...].sharding.is_fully_replicated


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "glm4_moe_lite", "llama"])
def test_forward_equals_one_device(models, name):
    """Every family's forward on a 2x4 mesh; deepseek_v2's on the other two as well."""
    one = models(name)
    for shape in MESHES if name == "deepseek_v2" else [(2, 4)]:
        _forward_matches(one, ll.MeshConfig.create(*shape))


def _forward_matches(one, mesh):
    tokens = np.random.default_rng(0).integers(0, one.config.vocab_size, 37).astype(np.int32)
    ref = np.asarray(one(tokens))
    got = ll.shard_model(one, mesh)(tokens)
    assert rel_err(got, ref) <= REL


def _paged_run(model, state):
    """Prefill two sequences, AMORTIZE one and FORGET the other, decode both: every logit."""
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 256, 29).tolist(), rng.integers(0, 256, 18).tolist()
    out = []
    state, x = ll.prefill(model, state, 0, a)
    out.append(x)
    state, x = ll.prefill(model, state, 1, b)
    out.append(x)
    state = ll.apply_directive(model, state, 0, ll.Directive(4, 13, [5, 6, 7]))
    state = ll.apply_directive(model, state, 1, ll.Directive(2, 6, [9], ll.Mode.FORGET))
    for t in range(3):
        state, x = ll.decode(model, state, [0, 1], [t + 1, t + 2])
        out.append(x)
    return state, out


# one pool shape for the paged runs and the engine: their compiled steps are shared
POOL = dict(num_pages=64, page_size=PS, max_seqs=4, kv_dtype=jnp.float32)


@functools.cache
def _paged_ref(one):
    return _paged_run(one, ll.init_state(one.config, **POOL))


@pytest.mark.parametrize(
    "name, shape", [("deepseek_v2", m) for m in MESHES] + [("llama", (2, 4))], ids=str
)
def test_paged_and_directives_equal_one_device(models, name, shape):
    one, mesh = models(name), ll.MeshConfig.create(*shape)
    ref_state, ref = _paged_ref(one)
    state, got = _paged_run(ll.shard_model(one, mesh), ll.init_state(one.config, mesh=mesh, **POOL))
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) <= REL
    assert ll.tokens(state, 0) == ll.tokens(ref_state, 0)
    assert ll.tokens(state, 1) == ll.tokens(ref_state, 1)
    # the pools stay split by page after every step (64 pages divide over any data axis)
    want = ("data",) if mesh.shape["data"] > 1 else ()
    assert state.pools.moved[0].sharding.spec == jax.sharding.PartitionSpec(*want)


def _counts():
    return paged.compile_counts() | splice.compile_counts() | {"sample": sample._cache_size()}


def _turns(engine):
    """Three sessions, two turns each: a prompt, then an edit (AMORTIZE or FORGET) + more."""
    rng = np.random.default_rng(2)
    system = rng.integers(0, 256, 11).tolist()
    sids = [engine.open_session() for _ in range(3)]
    outs = []
    for turn in range(2):
        reqs = []
        for i, sid in enumerate(sids):
            ds = []
            if turn == 1:
                mode = ll.Mode.FORGET if i == 2 else ll.Mode.AMORTIZE
                ds = [ll.Directive(12, 15, [3] * i, mode)]
            toks = (system if turn == 0 else []) + rng.integers(0, 256, 3 + i).tolist()
            reqs.append(engine.submit(sid, toks, directives=ds, sampling=SamplingParams(5)))
        engine.run_until_idle()
        outs.append([r.result() for r in reqs])
    return outs


@pytest.fixture(scope="module")
def engine_ref(models):
    return _turns(Engine(models("deepseek_v2"), **POOL))


def test_engine_equals_one_device_and_never_recompiles(models, mesh, engine_ref):
    """Greedy turns with edits give the one-device tokens; on 2x4, the same turns again on a
    new engine compile nothing (a mesh's steady state)."""
    one = models("deepseek_v2")
    assert _turns(Engine(one, mesh=mesh, **POOL)) == engine_ref
    if mesh.shape == {"data": 2, "model": 4}:
        before = _counts()
        assert _turns(Engine(one, mesh=mesh, **POOL)) == engine_ref
        assert _counts() == before


def test_bad_mesh_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        ll.MeshConfig.create(data=4, model=4)
    with pytest.raises(ValueError, match="model=0"):
        ll.MeshConfig.create(model=0)
    with pytest.raises(ValueError, match="not a mesh axis"):
        ll.MeshConfig.create(model=2, rules={"expert": "experts"})
    with pytest.raises(ValueError, match="not a logical axis"):
        ll.MeshConfig.create(model=2, rules={"experts": "model"})
    # rules given to the constructor keep the defaults they do not name
    raw = ll.MeshConfig(jax.make_mesh((2, 4), ("data", "model")), {"expert": "data"})
    assert raw.rules["heads"] == "model" and raw.rules["expert"] == "data"
    grid = jax.make_mesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match="mesh must be a leyline_jax.sharding.MeshConfig"):
        ll.init_state(
            ll.MLAConfig.from_hf(TINY_HF_CONFIGS["deepseek_v2"]),
            num_pages=8,
            page_size=4,
            max_seqs=1,
            mesh=grid,
        )


def test_kernels_take_their_jnp_path_under_a_mesh(models):
    """A compiled Pallas kernel is one call XLA's partitioner cannot split: under a mesh of
    several devices (pools split by page, or whole on each device with the heads split) the
    steps ask for the jnp path; on one device, the backend's choice."""
    one = models("deepseek_v2")
    split = ll.init_state(one.config, mesh=ll.MeshConfig.create(2, 4), **POOL).pools
    whole = ll.init_state(one.config, mesh=ll.MeshConfig.create(1, 8), **POOL).pools
    plain = ll.init_state(one.config, **POOL).pools
    assert split.kernel_impl(None) == "jnp"
    assert whole.kernel_impl(None) == "jnp" and plain.kernel_impl(None) is None
    assert split.kernel_impl("interpret") == "interpret"  # an explicit choice is kept


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)], ids=["2x4", "1x8"])
def test_the_layer_step_lowers_under_a_mesh_at_real_shapes(shape, monkeypatch):
    """The lowering gate under an 8-device mesh (tests/test_lowering_engine.py on one device):
    V2-Lite's MoE layer step, params placed by the mesh's rules and pools by page, exported for
    TPU and CUDA with abstract arrays: it lowers for both, on the jnp path. Shown to fail: with
    the kernel kept (what the step asked for before the gate), the TPU kernel over the split
    heads does not lower."""
    from tests.test_lowering_engine import CALLS, exported, sharded_step_args

    args = sharded_step_args("v2-lite", ll.MeshConfig.create(*shape))
    for platform, call in CALLS.items():
        assert call not in exported(paged.layer_step, args, platform)
    if shape == (1, 8):
        monkeypatch.setattr(kv_pools.KVPools, "kernel_impl", lambda self, impl: impl)
        with pytest.raises(Exception, match="cannot be automatically partitioned"):
            exported(paged.layer_step, args, "tpu")
