"""DeepSeek-V3 deployments on paper, computed: one 8x H200 node (and the fewest nodes that hold
the weights) and a TPU v5p-64 slice. The engine's own model built abstractly (`nnx.eval_shape`,
nothing allocated) gives every parameter's shape and dtype; `MeshConfig`'s rules over a mesh of
host CPU devices of the same count give each one's shard per device (heads, MLP, vocabulary and
experts over `model`, the pool's pages over `data`, the rest replicated); the config's KV bands
give the bytes a token costs. For each deployment: weights per device, what is left for the KV
pools, tokens and sessions that fit, and what the edit verbs and a broken session affinity
cost. docs/deployment.md quotes these numbers.

    python -m benchmarks.sizing [--out benchmarks/results_sizing.json]

Assumptions, not measured (no such hardware was used): vendors' published rates (HARDWARE;
GB = 1e9 bytes); `OVERHEAD` of each device's memory kept for activations, programs and the
runtime; the mesh (data x model over all the devices) the one that fits the bf16 weights and
holds the most KV tokens; a re-prefill feeds `CHUNK` tokens a step (EngineConfig's
prefill_chunk), each step the longer of its FLOPs at `MFU` of peak bf16 over the `model`
devices (2 x the active matmul parameters a token, plus the absorbed attention over the
context: 2 H (2R + Dr) a cached token, layer and query, `leyline_jax.mla.expanded_tiles`'
cost model) and its HBM reads (a device's weights, the context's KV); a splice reads and
writes its tokens' KV once; a session moved by snapshot travels at `NET` bytes/s. KV storage
"served": what `serve.http` keeps (bf16 latent, the rope band in f32: no flag sets
`k_pe_dtype`). TPU v5p-64: the slice name counts TensorCores, two a chip, and JAX sees one
device a chip (megacore), so 32 devices on 8 hosts of 4 chips.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import harness
from leyline_jax.config import MLAConfig
from leyline_jax.model import CausalLM
from leyline_jax.sharding import MeshConfig, param_axes
from serve.engine.config import EngineConfig

# the published config.json's fields (deepseek-ai/DeepSeek-V3)
V3 = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280,
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_nextn_predict_layers=1, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, routed_scaling_factor=2.5,
    kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    topk_method="noaux_tc", n_group=8, topk_group=4, scoring_func="sigmoid", norm_topk_prob=True,
    first_k_dense_replace=3, moe_layer_freq=1, ep_size=1, hidden_act="silu",
    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, attention_dropout=0.0, rope_theta=10000, bos_token_id=0,
    eos_token_id=1, rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                      beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                             weight_block_size=[128, 128]),
)  # fmt: skip
# devices a host, hosts asked for, memory (B), HBM (B/s), a device's link (B/s), bf16 FLOP/s
# (dense). NVLink: 900 GB/s a GPU both ways, 450 each; v5p ICI: 4800 Gbps a chip, taken whole.
HARDWARE = {
    "H200": dict(per_host=8, hosts=1, mem=141e9, hbm=4.8e12, link=450e9, flops=989e12),
    "TPU v5p": dict(per_host=4, hosts=8, mem=95e9, hbm=2.76e12, link=600e9, flops=459e12),
}  # fmt: skip
OVERHEAD, MFU, NET, MAX_DEVICES = 0.10, 0.40, 25e9, 64
PAGE, CHUNK = EngineConfig().page_size, EngineConfig().prefill_chunk  # the engine's defaults
ROTATED = EngineConfig().k_pe_dtype or jnp.float32  # None: f32 (`init_state`); no flag sets it
KV_STORAGE = {"bf16": (jnp.bfloat16, jnp.bfloat16), "served": (jnp.bfloat16, ROTATED),
              "fp32": (jnp.float32, jnp.float32)}  # (moved, rotated)  # fmt: skip
CONTEXTS, EDITS = (8192, 32768, 131072), (4096, 32768)  # session tokens; tokens edit to end


def params(cfg, dtype) -> list[tuple[tuple[str, ...], tuple[int, ...], int]]:
    """(key path, shape, bytes an element) of every parameter of `CausalLM(cfg, dtype)`."""
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return [(tuple(map(str, p)), tuple(v.shape), jnp.dtype(v.dtype).itemsize) for p, v in flat]


def meshes(n: int):
    """Every data x model mesh of `n` host CPU devices, as `MeshConfig`."""
    for data in (d for d in range(1, n + 1) if n % d == 0):
        yield MeshConfig.create(data, n // data, devices=jax.devices("cpu")[:n])


def weights_per_device(ps, mesh: MeshConfig) -> int:
    """Bytes of parameters on one device: each param's shard as the engine places it."""
    return sum(math.prod(mesh.param_sharding(p, s).shard_shape(s)) * b for p, s, b in ps)


def best_mesh(ps, n: int, hw: dict, kv_tok: int) -> dict:
    """The mesh of `n` devices whose weights fit and whose pool holds the most tokens (the
    pool split by page over `data`, whole on each `model` device); or the least weight a
    device holds when none fits."""
    best, least, tried = None, math.inf, {}
    for mesh in meshes(n):
        w = weights_per_device(ps, mesh)
        free, least = hw["mem"] * (1 - OVERHEAD) - w, min(least, w)
        data, model = mesh.shape["data"], mesh.shape["model"]
        tried[f"{data}x{model}"] = w / 1e9
        num_pages = int(max(free, 0) // (PAGE * kv_tok)) * data
        if not num_pages:
            continue
        pool = (num_pages, PAGE, 1)
        assert mesh.pool_sharding(pool).shard_shape(pool)[0] == num_pages // data
        if best is None or num_pages > best["num_pages"]:
            best = dict(mesh=f"{data}x{model}", data=data, model=model, weights_gb=w / 1e9,
                        kv_free_gb=free / 1e9, num_pages=num_pages, free=free, w=w)  # fmt: skip
    return (best or dict(mesh=None, weights_gb=least / 1e9)) | {"weights_gb_by_mesh": tried}


def smallest_hosts(ps, hw: dict, kv_tok: int) -> int | None:
    for hosts in range(1, MAX_DEVICES // hw["per_host"] + 1):
        if best_mesh(ps, hosts * hw["per_host"], hw, kv_tok)["mesh"]:
            return hosts
    return None


def prefill_flops(cfg, active_mm: int, new: int, context: int) -> float:
    """FLOPs of prefilling the last `new` tokens of a `context`-token sequence: the matmuls
    of the active parameters, and each query's absorbed attention over the tokens before it."""
    pairs = new * context - new * (new - 1) // 2  # (query, cached token) pairs, causal
    per_pair = 2 * cfg.num_attention_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return 2 * active_mm * new + per_pair * pairs * cfg.num_hidden_layers


def costs(cfg, active_mm: int, kv_tok: int, hw: dict, m: dict) -> dict:
    """What the verbs and a broken affinity cost on mesh `m` (seconds and bytes)."""
    data, rate = m["data"], hw["flops"] * m["model"] * MFU

    def prefill_s(new, context):
        """`CHUNK` tokens a step, each step the longer of its FLOPs at `rate` and its HBM
        reads on a device (its weights, the KV of the context so far)."""
        total, start = 0.0, context - new
        while start < context:
            end = min(start + CHUNK, context)
            flops = prefill_flops(cfg, active_mm, end - start, end)
            total += max(flops / rate, (m["w"] + end * kv_tok / data) / hw["hbm"])
            start = end
        return total

    def compute_s(new, context):  # FLOPs alone, at `rate`
        return prefill_flops(cfg, active_mm, new, context) / rate

    out = {}
    for n in EDITS:
        moved = n * kv_tok  # the KV of the n tokens after the edit, every layer
        purged = math.ceil(n / PAGE) * PAGE * kv_tok  # their pages, zeroed
        cross = moved * (data - 1) / data  # bound: the allocator spreads pages over `data`
        out[f"edit_{n}"] = dict(
            splice_bytes=moved, splice_hbm_s=2 * moved / (hw["hbm"] * data),
            splice_cross_bytes_bound=cross, splice_cross_s=cross / (hw["link"] * data),
            forget_purge_bytes=purged, forget_purge_s=purged / (hw["hbm"] * data),
            forget_reprefill_s={c: prefill_s(n, c) for c in CONTEXTS if c >= n},
            forget_reprefill_compute_s={c: compute_s(n, c) for c in CONTEXTS if c >= n},
        )  # fmt: skip
    out["affinity"] = {c: dict(snapshot_bytes=c * kv_tok, snapshot_s=c * kv_tok / NET,
                               reprefill_s=prefill_s(c, c),
                               reprefill_compute_s=compute_s(c, c)) for c in CONTEXTS}  # fmt: skip
    return out


def deployment(ps, ps32, cfg, active_mm, kv: dict, hw: dict, hosts: int) -> dict:
    n, kv_tok = hosts * hw["per_host"], kv["served"]
    m = best_mesh(ps, n, hw, kv_tok)
    d = dict(hosts=hosts, devices=n, mem=hw["mem"], weights_fit=m["mesh"] is not None, **m)
    w32 = best_mesh(ps32, n, hw, kv["fp32"])
    d["fp32_weights"] = dict(fit=w32["mesh"] is not None, weights_gb=w32["weights_gb"])
    if not d["weights_fit"]:
        return d
    free, d["weights_bytes"] = d.pop("free"), d.pop("w")
    d["kv_tokens"] = {k: int(free // (PAGE * b)) * m["data"] * PAGE for k, b in kv.items()}
    tokens = d["kv_tokens"]["served"]
    d["sessions"] = {c: tokens // c for c in CONTEXTS}
    d["sessions_per_host"] = {c: tokens // c / hosts for c in CONTEXTS}
    return d | costs(cfg, active_mm, kv_tok, hw, m)


def show(name: str, d: dict) -> None:
    w32 = d["fp32_weights"]
    fp32 = f"fp32 weights: {w32['weights_gb']:.1f} GB a device, fit: {w32['fit']}"
    if not d["weights_fit"]:
        print(f"\n{name}: the bf16 weights DO NOT FIT: {d['weights_gb']:.1f} GB a device at "
              f"best, {OVERHEAD:.0%} kept back of {d['mem'] / 1e9:.0f} GB; {fp32}")  # fmt: skip
        return
    t = d["kv_tokens"]
    print(f"\n{name}: mesh {d['mesh']}, bf16 weights {d['weights_gb']:.1f} GB a device, "
          f"{d['kv_free_gb']:.1f} GB a device for KV: --num-pages {d['num_pages']}, "
          f"{t['served']:,} tokens ({t['bf16']:,} bf16, {t['fp32']:,} fp32); {fp32}")  # fmt: skip
    print("  sessions " + ", ".join(f"{c // 1024}k: {s} ({d['sessions_per_host'][c]:.1f} a host)"
                                    for c, s in d["sessions"].items()))  # fmt: skip
    for n in EDITS:
        x = d[f"edit_{n}"]
        pre = ", ".join(f"{c // 1024}k {s:.2f} s" for c, s in x["forget_reprefill_s"].items())
        print(f"  edit {n // 1024}k from the end: splice {x['splice_bytes'] / 1e9:.2f} GB, "
              f"{x['splice_hbm_s'] * 1e3:.2f} ms HBM + {x['splice_cross_s'] * 1e3:.2f} ms links; "
              f"FORGET purge {x['forget_purge_s'] * 1e3:.2f} ms, re-prefill at {pre}")  # fmt: skip
    for c, a in d["affinity"].items():
        print(f"  affinity broken, {c // 1024}k session: snapshot {a['snapshot_bytes'] / 1e9:.2f} "
              f"GB in {a['snapshot_s']:.2f} s, or re-prefill {a['reprefill_s']:.2f} s")  # fmt: skip


def main() -> None:
    args = harness.parser(__doc__, out="benchmarks/results_sizing.json").parse_args()
    jax.config.update("jax_num_cpu_devices", MAX_DEVICES)  # meshes to shard on, never filled
    cfg = MLAConfig.from_hf(V3)
    ps, ps32 = params(cfg, jnp.bfloat16), params(cfg, jnp.float32)
    count = {p: math.prod(s) for p, s, _ in ps}
    total = sum(count.values())
    routed = sum(count[p] for p, s, _ in ps if "expert" in param_axes(p, len(s)))
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    active_mm = active - count[("embed",)]  # the embedding is a lookup, not a matmul
    bands = cfg.kv_bands()
    kv = {k: (math.prod(bands.moved) * jnp.dtype(mv).itemsize
              + math.prod(bands.rotated) * jnp.dtype(rt).itemsize) * cfg.num_hidden_layers
          for k, (mv, rt) in KV_STORAGE.items()}  # fmt: skip
    res = dict(
        command="python -m benchmarks.sizing",
        model=dict(params=total, bf16_weights_gb=sum(math.prod(s) * b for _, s, b in ps) / 1e9,
                   routed_expert_params=routed, active_params=active,
                   active_matmul_params=active_mm, layers=cfg.num_hidden_layers,
                   kv_bands=dict(moved=bands.moved, rotated=bands.rotated),
                   kv_bytes_per_token=kv,
                   kv_bytes_per_token_layer={k: b // cfg.num_hidden_layers for k, b in kv.items()},
                   kv_storage={k: [jnp.dtype(x).name for x in v] for k, v in KV_STORAGE.items()}),
        assumptions=dict(overhead=OVERHEAD, mfu=MFU, net_bytes_s=NET, page_size=PAGE,
                         prefill_chunk=CHUNK, hardware=HARDWARE, contexts=CONTEXTS, edits=EDITS),
        deployments={},
    )  # fmt: skip
    print(f"DeepSeek-V3 as the engine builds it: {total / 1e9:.1f} B params, "
          f"{res['model']['bf16_weights_gb']:.1f} GB in bf16 ({routed / 1e9:.1f} B "
          f"routed experts), {active / 1e9:.1f} B active a token ({active_mm / 1e9:.1f} B in "
          f"matmuls); KV a token over {cfg.num_hidden_layers} layers: bf16 {kv['bf16']:,} B, "
          f"served (f32 rope band) {kv['served']:,} B, fp32 {kv['fp32']:,} B")  # fmt: skip
    for hw_name, hw in HARDWARE.items():
        hosts = [hw["hosts"]]
        fewest = smallest_hosts(ps, hw, kv["served"])
        if fewest is not None and fewest > hw["hosts"]:
            hosts.append(fewest)
        for h in hosts:
            n = h * hw["per_host"]
            tpu = hw_name == "TPU v5p"  # named by its TensorCores, two a chip
            label = f"TPU v5p-{2 * n} ({n} chips)" if tpu else f"{n}x {hw_name}"
            name = f"{label}, {h} host{'s' * (h > 1)}"
            d = deployment(ps, ps32, cfg, active_mm, kv, hw, h)
            d["smallest_hosts_bf16"] = fewest
            d["smallest_hosts_fp32"] = smallest_hosts(ps32, hw, kv["fp32"])
            res["deployments"][name] = d
            show(name, d)
        print(f"  {hw_name}: fewest hosts for the bf16 weights {fewest}, for fp32 "
              f"{d['smallest_hosts_fp32']}")  # fmt: skip
    harness.save_json(args.out, res)


if __name__ == "__main__":
    main()
