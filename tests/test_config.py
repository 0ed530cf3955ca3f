"""MLAConfig.from_hf: each family, both RoPE config styles, family defaults, refusals."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from conftest import ALL_CONFIGS

import leyline_jax as ll
from leyline_jax.hf_config import (
    ROUTER_SIGMOID_GROUPED,
    ROUTER_SOFTMAX_GREEDY,
    ROUTER_SOFTMAX_GROUP_LIMITED,
)


def test_families_parse():
    v2 = ll.MLAConfig.from_hf(ALL_CONFIGS["deepseek_v2"])
    assert v2.q_lora_rank is None and v2.rope_type == "yarn" and v2.rope_interleave
    assert v2.router == ROUTER_SOFTMAX_GROUP_LIMITED and v2.mlp_layer_types == (
        "dense",
        "sparse",
        "sparse",
    )
    assert (v2.rope_mscale, v2.rope_mscale_all_dim, v2.yarn_factor) == (1.0, 0.707, 4.0)
    v3 = ll.MLAConfig.from_hf(ALL_CONFIGS["deepseek_v3"])
    assert v3.q_lora_rank == 48 and v3.router == ROUTER_SIGMOID_GROUPED and v3.norm_topk_prob
    assert v3.tie_word_embeddings and v3.num_mtp_layers == 1 and v3.rope_type == "yarn"
    glm = ll.MLAConfig.from_hf(ALL_CONFIGS["glm4_moe_lite"])
    assert glm.rope_theta == 1e6 and glm.rms_norm_eps == 1e-5 and glm.n_group == 1
    halves = ll.MLAConfig.from_hf(ALL_CONFIGS["deepseek_v3_halves"])
    assert not halves.rope_interleave


def test_old_and_new_rope_styles_agree():
    old = dict(ALL_CONFIGS["deepseek_v3"])
    new_rope = old.pop("rope_parameters")
    old["rope_theta"] = new_rope["rope_theta"]
    old["rope_scaling"] = {
        "type": "yarn",
        **{k: v for k, v in new_rope.items() if k not in ("rope_type", "rope_theta")},
    }
    assert ll.MLAConfig.from_hf(old) == ll.MLAConfig.from_hf(ALL_CONFIGS["deepseek_v3"])


def test_from_path_and_dict_agree(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ALL_CONFIGS["glm4_moe_lite"]))
    a = ll.MLAConfig.from_hf(tmp_path)
    assert a == ll.MLAConfig.from_hf(tmp_path / "config.json")
    assert a == ll.MLAConfig.from_hf(ALL_CONFIGS["glm4_moe_lite"])
    assert ll.MLAConfig.from_dict(a.to_dict()) == a


def test_family_defaults_follow_transformers():
    """A config.json that omits a field gets the family's transformers default."""
    from transformers import AutoConfig

    for family in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):
        d = {
            k: v
            for k, v in ALL_CONFIGS[family].items()
            if k not in ("routed_scaling_factor", "norm_topk_prob", "rms_norm_eps")
        }
        ours = ll.MLAConfig.from_hf(d)
        ref = AutoConfig.for_model(family)
        assert ours.routed_scaling_factor == ref.routed_scaling_factor, family
        assert ours.rms_norm_eps == ref.rms_norm_eps, family
        if family != "deepseek_v2":
            assert ours.norm_topk_prob == ref.norm_topk_prob, family


def test_v2_greedy_router():
    d = dict(ALL_CONFIGS["deepseek_v2"], topk_method="greedy")
    assert ll.MLAConfig.from_hf(d).router == ROUTER_SOFTMAX_GREEDY


def test_derived_values():
    c = ll.MLAConfig.from_hf(ALL_CONFIGS["deepseek_v2"])
    assert c.qk_head_dim == 32
    m = 0.1 * 0.707 * math.log(4.0) + 1
    assert c.softmax_scale == pytest.approx(32**-0.5 * m * m)
    assert c.rope_scale == pytest.approx((0.1 * math.log(4.0) + 1) / m)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"model_type": None}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type"),
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ],
)
def test_refusals_name_the_field(change, needle):
    d = {**ALL_CONFIGS["deepseek_v2"], **change}
    with pytest.raises(ll.ConfigError, match=needle):
        ll.MLAConfig.from_hf(d)


@pytest.mark.parametrize(
    "change, needle",
    [({"scoring_func": "softmax"}, "scoring_func"), ({"topk_method": "greedy"}, "topk_method")],
)
def test_v3_refusals(change, needle):
    with pytest.raises(ll.ConfigError, match=needle):
        ll.MLAConfig.from_hf({**ALL_CONFIGS["deepseek_v3"], **change})


def test_config_errors_are_value_errors_and_files(tmp_path):
    assert issubclass(ll.ConfigError, ValueError)
    with pytest.raises(FileNotFoundError):
        ll.MLAConfig.from_hf(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ll.ConfigError, match="not valid JSON"):
        ll.MLAConfig.from_hf(tmp_path)


def test_frozen_and_replace():
    c = ll.MLAConfig.from_hf(ALL_CONFIGS["glm4_moe_lite"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1
    with pytest.raises(ll.ConfigError, match="mlp_layer_types"):
        dataclasses.replace(c, num_hidden_layers=5)


# ---- the GQA family ---------------------------------------------------------------------------
def test_gqa_config_from_hf():
    c = ll.GQAConfig.from_hf(ALL_CONFIGS["llama"])
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.groups) == (4, 2, 16, 2)
    assert c.softmax_scale == pytest.approx(16**-0.5) and c.tie_word_embeddings
    assert c.kv_bands().moved == c.kv_bands().rotated == (2, 16)  # V moves, K rotates
    assert c.rope_inv_freq().shape == (8,)
    assert ll.GQAConfig.from_dict(c.to_dict()) == c
    # the loader picks the family by model_type
    from leyline_jax.loader import config_from_hf

    assert config_from_hf(ALL_CONFIGS["llama"]) == c
    assert isinstance(config_from_hf(ALL_CONFIGS["deepseek_v3"]), ll.MLAConfig)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_gqa_refusals_name_the_field(change, needle):
    with pytest.raises(ll.ConfigError, match=needle):
        ll.GQAConfig.from_hf({**ALL_CONFIGS["llama"], **change})
