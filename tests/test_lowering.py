"""The lowering gate: the kernels' programs lowered here, without either accelerator
(`jax.export`), for TPU and for CUDA at real model shapes, each platform's artifact checked for
its kernel's call, which the Pallas lowering only emits once the kernel fits the chip (shared
memory and VMEM are checked there: the old GPU splice kernel failed exactly so, at 4.5 GB of
shared memory).

Shapes: one layer's pools and one step's attention at DeepSeek-V2-Lite's widths (MLA: latent 512
bf16, RoPE band 64 fp32, 16 heads), DeepSeek-V3's (128 heads) and a Llama-3-8B-shaped GQA model
(8 KV heads of 128, 32 query heads; K and V stored as bf16 bits); and the splice of every layer
of each (27, 61 and 32 layers) as the one program an edit's block of runs is on an accelerator:
its module takes every layer's pools, and runs one Mosaic GPU call over all of them on CUDA, one
TPU kernel call a layer on TPU (`kernel_calls` follows the module's calls: jax emits a function
called for every layer once). The choice is made per platform when the
program is lowered (`pallas_kernels.dispatch.on_platform`): TPU gets the TPU kernels (attention:
the MLA form), CUDA the Mosaic GPU kernels (splice; attention in both forms), CPU jnp.
Branches are traced only for the platforms a program may be lowered for (jax's backend, or
`lowering_for`'s, as here).

One artifact for several platforms at once (`platforms=["cpu", "tpu"]`) does not lower with
jax 0.10: it lowers each kept `platform_dependent` branch for every platform of the module, and
a Pallas TPU call has no CPU lowering ("Only interpret mode is supported on CPU backend")."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import ragged_paged_gpu_plan, splice_rotate_gpu
from pallas_kernels.dispatch import lowering_for
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.splice_rotate import Runs, splice_rotate

SDS = jax.ShapeDtypeStruct
I32 = jnp.int32
CALLS = {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu"}
PAGES, PAGE = 4096, 16
LAYERS = {"v2-lite": 27, "v3": 61, "llama-8b": 32}
# name: (c width, c dtype, k width, k dtype, rotated D/2, query heads, q width)
MODELS = {
    "v2-lite": (512, jnp.uint16, 64, jnp.float32, 32, 16, 512),
    "v3": (512, jnp.uint16, 64, jnp.float32, 32, 128, 512),
    "llama-8b": (1024, jnp.uint16, 1024, jnp.uint16, 64, 32, 128),
}


def exported_text(fn, args, platforms) -> str:
    """`fn` exported for `platforms`, traced under `lowering_for` them (an export from this
    machine for another platform)."""
    with lowering_for(*platforms):
        return jax.export.export(jax.jit(fn), platforms=platforms)(*args).mlir_module()


def exported_module(fn, args, platform) -> jax.export.Exported:
    """`fn` exported for `platform`, traced under `lowering_for` it."""
    with lowering_for(platform):
        return jax.export.export(jax.jit(fn), platforms=[platform])(*args)


_FUNC = re.compile(r"^  func\.func \w+ @(\w+)\(", re.M)


def kernel_calls(text: str, call: str) -> list[int]:
    """The custom calls named `call...` that the module's main function runs, followed through
    the functions it calls (one entry a run, however the module shares functions): the number
    of operands of each."""
    heads = [(m.group(1), m.start()) for m in _FUNC.finditer(text)]
    bodies = {
        name: text[at:end]
        for (name, at), (_, end) in zip(heads, [*heads[1:], (None, len(text))], strict=True)
    }

    def runs(name: str) -> list[int]:
        body = bodies[name]
        own = [ops.count("%") for ops in re.findall(rf"custom_call @{call}\w*\(([^)]*)\)", body)]
        callees = re.findall(r"(?<!custom_)call @(\w+)\(", body)
        return own + [n for f in callees if f in bodies for n in runs(f)]

    return runs("main")


def splice_args(model, runs=256, layers=1):
    c, c_dt, k, k_dt, h, *_ = MODELS[model]
    cs, ks = (SDS((PAGES * PAGE, c), c_dt),) * layers, (SDS((PAGES * PAGE, k), k_dt),) * layers
    return cs, ks, Runs(*[SDS((runs,), I32)] * 5), SDS((h,), jnp.float32)


def attention_args(model, tokens=128, rows=8, width=512):
    c, c_dt, k, k_dt, h, heads, q = MODELS[model]
    meta = SDS((rows,), I32), SDS((rows, width), I32), SDS((rows + 1,), I32), SDS((1,), I32)
    if model == "llama-8b":  # grouped: V and K pages [P, page, G, D], queries [T, N, D]
        v, kp = SDS((PAGES, PAGE, 8, 128), c_dt), SDS((PAGES, PAGE, 8, 128), k_dt)
        return None, SDS((tokens, heads, q), jnp.float32), v, kp, *meta
    q_lat, q_pe = SDS((tokens, heads, q), jnp.float32), SDS((tokens, heads, 2 * h), jnp.float32)
    return q_lat, q_pe, SDS((PAGES, PAGE, c), c_dt), SDS((PAGES, PAGE, k), k_dt), *meta


def splice(model, impl=None):
    k_dtype = jnp.bfloat16 if MODELS[model][3] == jnp.uint16 else None
    return lambda cs, ks, r, inv: splice_rotate(cs, ks, r, inv, k_dtype=k_dtype, impl=impl)


def attention(model, impl=None):
    c_dt, k_dt = MODELS[model][1], MODELS[model][3]
    kw = dict(kv_dtype=jnp.bfloat16 if c_dt == jnp.uint16 else None)
    kw |= dict(k_pe_dtype=jnp.bfloat16 if k_dt == jnp.uint16 else None)
    return lambda *a: ragged_paged_attention(*a, scale=0.1, impl=impl, **kw)


@pytest.mark.parametrize("model", list(MODELS))
def test_the_splice_lowers_with_each_platforms_kernel(model):
    for platform, call in CALLS.items():
        assert call in exported_text(splice(model), splice_args(model), [platform]), platform
    cpu = exported_text(splice(model), splice_args(model), ["cpu"])
    assert not any(call in cpu for call in CALLS.values())  # the jnp path


@pytest.mark.parametrize("model", list(MODELS))
def test_every_layer_lowers_as_one_program(model):
    """The splice of every layer of the model in one program: its module's arguments are every
    layer's pools (then the runs and inv_freq); on CUDA it runs one Mosaic GPU call whose
    operands are every pool (and the runs' src, dst, length, cos, sin), on TPU one kernel call
    a layer; the Pallas lowering has checked shared memory / VMEM."""
    layers = LAYERS[model]
    args = splice_args(model, layers=layers)
    for platform, call in CALLS.items():
        exp = exported_module(splice(model), args, platform)
        pools = [a.shape for a in exp.in_avals[: 2 * layers]]
        assert pools == [x.shape for x in (*args[0], *args[1])], platform
        assert len(exp.in_avals) == 2 * layers + 6, platform
        calls = kernel_calls(exp.mlir_module(), call)
        assert calls == ([5 + 2 * layers] if platform == "cuda" else [8] * layers), platform


def test_kernel_calls_counts_what_runs():
    """`kernel_calls` can fail: one layer's module runs one TPU kernel call (of 8 operands: three
    scalar-prefetched run arrays, pos_from and pos_to rows, inv_freq, c, k), 27 layers' run 27,
    forced onto jnp none; a name that is no call, none."""
    one = exported_module(splice("v2-lite"), splice_args("v2-lite"), "tpu").mlir_module()
    assert kernel_calls(one, CALLS["tpu"]) == [8]
    many = exported_module(splice("v2-lite"), splice_args("v2-lite", layers=27), "tpu")
    assert len(kernel_calls(many.mlir_module(), CALLS["tpu"])) == 27
    jnp_path = exported_module(splice("v2-lite", "jnp"), splice_args("v2-lite"), "tpu")
    assert kernel_calls(jnp_path.mlir_module(), CALLS["tpu"]) == []
    assert kernel_calls(one, "no_such_call") == []


@pytest.mark.parametrize("model", ["v2-lite", "v3"])
def test_attention_lowers_with_each_platforms_kernel(model):
    for platform, call in CALLS.items():
        assert call in exported_text(attention(model), attention_args(model), [platform]), platform


def test_grouped_attention_lowers_for_each_platform():
    """The grouped form (GQA): on CUDA the Mosaic GPU kernel; on TPU jnp (the TPU kernel is
    MLA-only), on CPU jnp."""
    for platform in ("tpu", "cuda", "cpu"):
        text = exported_text(attention("llama-8b"), attention_args("llama-8b"), [platform])
        assert (CALLS["cuda"] in text) is (platform == "cuda"), platform
        assert CALLS["tpu"] not in text


def test_the_check_can_fail():
    """Forced onto the jnp path, neither artifact holds a kernel call: the check sees it."""
    for platform, call in CALLS.items():
        assert call not in exported_text(
            splice("v2-lite", "jnp"), splice_args("v2-lite"), [platform]
        )
    args = attention_args("v2-lite")
    for platform, call in CALLS.items():
        assert call not in exported_text(attention("v2-lite", "jnp"), args, [platform])


def test_a_kernel_past_shared_memory_fails_the_gate(monkeypatch):
    """The gate's other half: a GPU splice whose buffers cannot fit a Hopper's 227 KB of shared
    memory (runs of 256 rows: two buffers of Llama-8B's 2 KB V and 2 KB K rows, 2 MB) is refused
    when lowered, as the old GPU kernel was (`unsupported` keeps such pools on jnp first: here
    it is told not to); the real buffers (16 rows: 128 KB) lower."""
    args = splice_args("llama-8b")
    big = lambda cs, ks, r, inv: splice_rotate_gpu.splice_rotate_gpu(  # noqa: E731
        cs, ks, r, inv, k_dtype=jnp.bfloat16, max_run=256
    )
    monkeypatch.setattr(splice_rotate_gpu, "unsupported", lambda *a, **k: None)
    with pytest.raises(Exception, match="shared memory"):
        exported_text(big, args, ["cuda"])
    monkeypatch.undo()
    assert CALLS["cuda"] in exported_text(splice("llama-8b"), args, ["cuda"])


def test_attention_past_shared_memory_fails_the_gate(monkeypatch):
    """The GPU attention kernel at V2-Lite's widths with its shared-memory budget lifted picks
    256 query columns (Q's terms alone 768 KB): refused when lowered."""
    monkeypatch.setattr(ragged_paged_gpu_plan, "SMEM_BYTES", 1 << 30)
    monkeypatch.setattr(ragged_paged_gpu_plan, "ACC_VALUES", 1 << 30)
    with pytest.raises(Exception, match="shared memory"):
        exported_text(attention("v2-lite"), attention_args("v2-lite"), ["cuda"])


def test_a_cpu_trace_holds_no_kernel_branch():
    """On this CPU a program traced for itself holds no platform branch (a kernel's branch
    costs ~0.1-0.3 s to trace, for nothing here); traced for TPU and CUDA it holds one."""
    args = splice_args("v2-lite")
    assert "platform_index" not in str(jax.make_jaxpr(splice("v2-lite"))(*args))
    with lowering_for("cpu", "tpu", "cuda"):
        assert "platform_index" in str(jax.make_jaxpr(splice("v2-lite"))(*args))
