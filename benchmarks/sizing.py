"""DeepSeek-V3 deployments on paper, computed: the engine's own model built abstractly
(`nnx.eval_shape`, nothing allocated) gives every parameter's shape, `leyline_jax.sharding`'s
rules give each one's split over the mesh, the config's KV bands give the bytes a token costs.
For each deployment: weights per device (bf16), what is left for the KV pools, tokens and
sessions that fit, and what the edit verbs and a drain cost under the mesh. docs/deployment.md
quotes these numbers.

    python -m benchmarks.sizing [--out benchmarks/results_sizing.json]

Assumptions (stated, not measured here): hardware figures are the vendors' published ones
(below); `OVERHEAD` of each device's memory is kept for activations, programs and the runtime;
FORGET's re-prefill runs at `MFU` of peak bf16; a drained session moves over `NET` bytes/s.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from benchmarks import harness
from leyline_jax.config import MLAConfig
from leyline_jax.model import CausalLM
from leyline_jax.sharding import param_axes

V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
    scoring_func="sigmoid", norm_topk_prob=True, first_k_dense_replace=3, moe_layer_freq=1,
    hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                      beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
)  # fmt: skip
# (devices, memory B, HBM B/s, interconnect B/s per device, bf16 FLOP/s per device)
DEPLOYMENTS = {
    "8x H200 (one node)": (8, 141e9, 4.8e12, 450e9, 989e12),
    "16x H200 (two nodes)": (16, 141e9, 4.8e12, 450e9, 989e12),
    "TPU v5p-64 (32 chips)": (32, 95e9, 2.76e12, 600e9, 459e12),
}  # fmt: skip
OVERHEAD, MFU, NET, PAGE = 0.10, 0.40, 25e9, 16
CONTEXTS = (8192, 32768, 131072)
EDITS = (4096, 32768)  # tokens from the edit to the end


def params(cfg) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    model = nnx.eval_shape(lambda: CausalLM(cfg, jnp.bfloat16))
    out = []
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        out.append((tuple(str(p) for p in path), tuple(leaf.shape)))
    return out


def per_device(shape, axes, model: int) -> int:
    n = math.prod(shape)
    for size, ax in zip(shape, axes, strict=True):
        if ax is not None and ax != "pages" and size % model == 0:
            return n // model  # one dimension split over `model` (sharding.py's rule)
    return n


def deployment(ps, active, kv, n, mem, hbm, link, flops) -> dict | None:
    """The mesh of `n` devices (data x model) whose bf16 weights fit and whose KV pools (split
    by page over `data`, whole on each `model` device) hold the most tokens; if none fits, the
    least weight a device holds (at `model` = n)."""
    best, least = None, math.inf
    for model in (m for m in range(1, n + 1) if n % m == 0):
        data = n // model
        w = 2 * sum(per_device(s, param_axes(p, len(s)), model) for p, s in ps)
        free, least = mem * (1 - OVERHEAD) - w, min(least, w)
        tokens = int(free * data / kv) // PAGE * PAGE if free > 0 else 0
        if tokens and (best is None or tokens > best[0]):
            best = (tokens, data, model, w, free)
    if best is None:
        return {"devices": n, "weights_fit": False, "weights_per_device_gb": least / 1e9}
    tokens, data, model, w, free = best
    d = {"devices": n, "weights_fit": True, "mesh": f"{data}x{model}",
         "weights_per_device_gb": w / 1e9,
         "kv_gb_free_per_device": free / 1e9, "kv_tokens": tokens,
         "sessions_at": {c: tokens // c for c in CONTEXTS}}  # fmt: skip
    for m in EDITS:
        moved = m * kv
        d[f"edit_{m}"] = {
            "splice_bytes": moved,
            # each data shard moves its pages (model devices repeat it on their copies); pages
            # spread over the shards: up to (data-1)/data of the bytes cross devices
            "splice_hbm_s": 2 * moved / (hbm * data),
            "splice_cross_s": moved * (data - 1) / data / (link * data),
            "forget_purge_s": moved / (hbm * data),  # zero the pages: local writes
            "forget_reprefill_s": 2 * active * m / (flops * n * MFU),
            "drain_move_s": moved / NET,  # a session of this length moved by snapshot
        }
    return d


def main() -> None:
    args = harness.parser(__doc__, out="benchmarks/results_sizing.json").parse_args()
    cfg = MLAConfig.from_hf(V3)
    ps = params(cfg)
    total = sum(math.prod(s) for _, s in ps)
    routed = sum(math.prod(s) for p, s in ps if "expert" in param_axes(p, len(s)))
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    active = total - routed + routed * k // e
    bands = cfg.kv_bands()
    per_token = {dt: (math.prod(bands.moved) + math.prod(bands.rotated)) * b
                 * cfg.num_hidden_layers for dt, b in (("bf16", 2), ("fp32", 4))}  # fmt: skip
    res = {"params": total, "params_active_per_token": active, "kv_bytes_per_token": per_token,
           "assumptions": {"overhead": OVERHEAD, "mfu": MFU, "net_bytes_s": NET,
                           "page_size": PAGE}, "deployments": {}}  # fmt: skip
    print(f"DeepSeek-V3: {total / 1e9:.1f} B params, {active / 1e9:.1f} B active a token; "
          f"KV {per_token['bf16']} B a token (bf16, {cfg.num_hidden_layers} layers)")  # fmt: skip
    for name, (n, mem, hbm, link, flops) in DEPLOYMENTS.items():
        d = deployment(ps, active, per_token["bf16"], n, mem, hbm, link, flops)
        res["deployments"][name] = d
        if not d["weights_fit"]:
            print(f"\n{name}: bf16 weights fit on no mesh of its {n} devices (at best "
                  f"{d['weights_per_device_gb']:.1f} GB a device)")  # fmt: skip
            continue
        print(f"\n{name}, mesh {d['mesh']}: weights {d['weights_per_device_gb']:.1f} GB a device, "
              f"KV {d['kv_gb_free_per_device']:.1f} GB a device free: {d['kv_tokens']:,} tokens; "
              "sessions at " + ", ".join(f"{c // 1024}k: {d['kv_tokens'] // c}"
                                         for c in CONTEXTS))  # fmt: skip
        for m in EDITS:
            x = d[f"edit_{m}"]
            print(f"  edit {m // 1024}k from the end: splice {x['splice_hbm_s'] * 1e3:.2f} ms HBM "
                  f"+ {x['splice_cross_s'] * 1e3:.2f} ms links; FORGET purge "
                  f"{x['forget_purge_s'] * 1e3:.3f} ms + re-prefill "
                  f"{x['forget_reprefill_s'] * 1e3:.0f} ms; moving such a session "
                  f"{x['drain_move_s'] * 1e3:.0f} ms")  # fmt: skip
    harness.save_json(args.out, {"command": "python -m benchmarks.sizing", **res})


if __name__ == "__main__":
    main()
