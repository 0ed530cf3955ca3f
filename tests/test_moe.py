"""The grouped MoE dispatch against the dense one (the oracle), on each MLA family's router.

Grouped sorts the (token, expert) assignments by expert and multiplies each expert's run of
rows only; dense runs every expert on every token and weights the unchosen ones by 0. They
agree to fp32 rounding: each token's output is the same k weighted expert outputs, summed in
another order, so 1e-5 of the largest output (the issue's bound) is ~100x the rounding seen.
The cases a sort can get wrong are made to happen and asserted to have happened: experts that
receive no token, tokens with no expert in some group (group-limited routers), experts whose
rows do not fill the CPU loop's last block.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAMILIES, random_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

import leyline_jax as ll
from checkpoints.tiny import TINY_HF_CONFIGS
from leyline_jax.hf_config import ROUTER_SIGMOID_GROUPED
from leyline_jax.loader import config_from_hf
from leyline_jax.moe import (
    MoEDispatch,
    moe_experts_dense,
    moe_experts_grouped,
    prefers_grouped,
    route,
)

RTOL = 1e-5


def assert_close(got, want):
    """|got - want| <= RTOL * max|want| everywhere (fp32)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want).max()
    assert err <= RTOL * np.abs(want).max(), f"max error {err:.3g} of max {np.abs(want).max():.3g}"


def family_config(name: str, **changes):
    return dataclasses.replace(config_from_hf(TINY_HF_CONFIGS[name]), **changes)


def layer(config, seed: int):
    """Random router (and bias) and expert weights of one MoE layer of `config`, fp32."""
    rng = np.random.default_rng(seed)
    e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size

    def normal(*shape, std):
        return jnp.asarray(std * rng.standard_normal(shape), jnp.float32)

    bias = normal(e, std=0.1) if config.router == ROUTER_SIGMOID_GROUPED else None
    return (
        normal(h, e, std=1.0),
        bias,
        normal(e, h, i, std=0.1),
        normal(e, h, i, std=0.1),
        normal(e, i, h, std=0.1),
    )


routed = jax.jit(route, static_argnums=3)


@jax.jit
def dispatches(x, weights, idx, gate, up, down):
    """Dense, grouped (this platform's form) and grouped through `ragged_dot` (on CPU lowered
    densely, but the form GPU/TPU run)."""
    args = (x, weights, idx, gate, up, down)
    grouped = moe_experts_grouped(*args)
    return moe_experts_dense(*args), grouped, moe_experts_grouped(*args, ragged=True)


def random_inputs(config, t: int, seed: int):
    """t random tokens routed by the family's rule through a random layer: the arguments of
    `dispatches`."""
    router, bias, gate, up, down = layer(config, seed)
    rng = np.random.default_rng(seed + 1)
    x = jnp.asarray(rng.standard_normal((t, config.hidden_size)), jnp.float32)
    weights, idx = routed(x, router, bias, config)
    return x, weights, idx, gate, up, down


def run_and_compare(config, t: int, seed: int) -> np.ndarray:
    """Assert grouped == dense on random inputs (`random_inputs`); return the expert ids."""
    args = random_inputs(config, t, seed)
    dense, grouped, ragged = dispatches(*args)
    assert_close(grouped, dense)
    assert_close(ragged, dense)
    return np.asarray(args[2])


def test_dense_on_a_hand_worked_case():
    """x = 2, H = I = 1; expert 0 (weight 0.5): down * silu(2 gate) * 2 up with gate = up =
    down = 1 is 2 silu(2); expert 1 (weight 0.25) has gate 0: silu(0) = 0. So 0.5 * 2 silu(2)
    = silu(2) = 2 / (1 + e^-2) = 1.761594."""
    gate, down = jnp.array([[[1.0]], [[0.0]]]), jnp.array([[[1.0]], [[3.0]]])
    weights, idx = jnp.array([[0.5, 0.25]]), jnp.array([[0, 1]], jnp.int32)
    for out in dispatches(jnp.array([[2.0]]), weights, idx, gate, jnp.ones((2, 1, 1)), down):
        np.testing.assert_allclose(np.asarray(out), [[1.761594]], rtol=1e-6)


def many_tokens(config) -> int:
    """A T with about 16 rows per expert (15.75 or 16): the CPU loop's block is then 16 rows,
    and experts get one block, a part of one, or more than one."""
    return 16 * config.n_routed_experts // config.num_experts_per_tok


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("many", [False, True])
def test_grouped_equals_dense_on_each_router(name, many):
    config = family_config(name)
    e, k = config.n_routed_experts, config.num_experts_per_tok
    idx = run_and_compare(config, many_tokens(config) if many else 1, seed=int(many))
    counts = np.bincount(idx.reshape(-1), minlength=e)
    if many:  # experts of several blocks, and experts whose last block runs into the next's rows
        assert (counts > 16).any() and (counts % 16 != 0).any()
    else:  # one token: k of the 8 experts chosen, the others receive no token
        assert (counts == 0).sum() == e - k
    if config.n_group > 1:  # group-limited: each token's experts lie in topk_group groups only
        per_group = e // config.n_group
        groups = [set(row) for row in idx // per_group]
        assert all(len(g) <= config.topk_group < config.n_group for g in groups)


def test_one_token_of_16_experts():
    """14 of 16 experts receive no token, and 2 of the sigmoid router's 4 groups none."""
    config = family_config("deepseek_v3", n_routed_experts=16)
    idx = run_and_compare(config, 1, seed=3).reshape(-1)
    assert len(set(idx)) == 2 and len(set(idx // 4)) <= 2


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(FAMILIES), seed=st.integers(0, 2**20))
def test_grouped_equals_dense_on_random_routing(name, seed):
    """Random layers and tokens (the shapes of the tests above: no compile per example)."""
    config = family_config(name)
    run_and_compare(config, many_tokens(config), seed)


def test_the_comparison_fails_on_a_wrong_result():
    """A perturbed weight of a chosen expert, and one dropped assignment, are both caught."""
    config = family_config("deepseek_v2")
    x, weights, idx, gate, up, down = random_inputs(config, many_tokens(config), seed=0)
    dense, _, _ = dispatches(x, weights, idx, gate, up, down)
    used = int(idx[0, 0])
    for args in (
        (x, weights, idx, gate, up, down.at[used].multiply(1.001)),
        (x, weights.at[4, 1].set(0.0), idx, gate, up, down),
    ):
        _, grouped, ragged = dispatches(*args)
        for got in (grouped, ragged):
            with pytest.raises(AssertionError):
                assert_close(got, dense)


def test_auto_keeps_tiny_models_dense_and_v2_lite_grouped():
    """The rest of the suite runs the tiny configs' experts (8 of 64 x 32) on the dense path it
    always has; DeepSeek-V2-Lite's (64 of 2048 x 1408) take the grouped one."""
    for name in FAMILIES:
        c = family_config(name)
        assert not prefers_grouped(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)
    assert prefers_grouped(64, 2048, 1408)


def test_whole_model_forward_grouped_equals_dense(np_ckpt):
    """The same model, forced onto each path (`moe_dispatch`, a static attribute: each traces
    its own program), gives the same logits; the sort in the grouped program's trace shows the
    switch reached it."""
    tokens = random_tokens(48)
    logits, sorts = {}, {}
    for dispatch in (MoEDispatch.DENSE, MoEDispatch.GROUPED):
        model = ll.load_model(np_ckpt("deepseek_v2"))
        model.set_attributes(moe_dispatch=dispatch)
        logits[dispatch] = model(tokens)
        h = jnp.zeros((48, model.config.hidden_size), model.dtype)
        jaxprs = [jax.make_jaxpr(layer)(h, jnp.arange(48)) for layer in model.layers]
        sorts[dispatch] = any(re.search(r"\bsort\[", str(j)) for j in jaxprs)
    assert sorts == {MoEDispatch.DENSE: False, MoEDispatch.GROUPED: True}
    assert_close(logits[MoEDispatch.GROUPED], logits[MoEDispatch.DENSE])
