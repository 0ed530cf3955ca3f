"""What the device suite measures: full size (one H100 or H200), `--quick` (the rows the targets
are read at, fewer repeats), and smoke size (CPU, CI), alone or with `--quick`.

Kept free of jax and torch so that every part, the Hugging Face one included, reads the same
config and lengths from one place.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# DeepSeek-V2-Lite's config.json (15.7B parameters, 2.4B active): the shapes the suite measures,
# read from the file `checkpoints.random_hf` reads (no import: that package imports jax)
V2_LITE_HF = json.loads(
    (Path(__file__).resolve().parents[2] / "checkpoints" / "v2_lite_config.json").read_text()
)

# The same architecture at toy size: every code path of the full config (a dense first layer,
# routed + shared experts, YaRN, no q_lora), small enough for a 2-core CPU.
SMOKE_HF = dict(
    V2_LITE_HF,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=8192,
    rope_scaling=dict(
        V2_LITE_HF["rope_scaling"], factor=4.0, original_max_position_embeddings=2048
    ),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Lengths and repeats of every part, full size by default. `edit_layers` < the config's
    layers: (c) prefills 32k-token sequences several times, which at 27 layers would not fit its
    time budget; both arms scale about linearly in layers, so their ratio survives the cut (the
    JSON says so). The targets (`summary.targets`) are read at sizes named here: decode
    attention at the largest context, C = 1 and every C >= `attention_wide`; the splice's
    bandwidth at the largest D and its time at the smallest; prefill at `prefill_targets`;
    decode against Hugging Face at `decode_batches[0]`."""

    hf: dict = dataclasses.field(default_factory=lambda: V2_LITE_HF)  # every part's model
    page_size: int = 16
    quick: bool = False  # the --quick selection (`quick`)
    beside_jnp: bool = True  # time the jnp path beside an accelerator's kernel (splice, attention)
    # (b) the splice pass alone
    splice_downstream: tuple[int, ...] = (8192, 32768, 131072)
    splice_samples: int = 5  # timed samples of the default path, each of `splice_iters` calls
    splice_iters: int = 10
    # (b') ragged paged attention of one layer: decode rows of a context each, a prefill chunk
    attention_contexts: tuple[int, ...] = (4096, 32768)
    attention_batches: tuple[int, ...] = (1, 32, 128)
    attention_wide: int = 32  # the least C of the wide-decode target (C >= 32)
    attention_chunk: int = 512  # a prefill chunk's queries, over the first context (0: none)
    attention_repeats: int = 5  # timed samples of the default path (the jnp path: 3)
    # (c) AMORTIZE vs FORGET: a prefix, a span replaced by a stub, then D downstream tokens
    edit_downstream: tuple[int, ...] = (8192, 32768)
    edit_layers: int = 4
    edit_prefix: int = 1024
    edit_span: int = 64
    edit_stub: int = 20
    edit_forget_repeats: int = 1  # FORGET re-prefills D tokens per run: the costliest timed run
    # (d) the whole model (decode runs first: its largest batch is the target)
    prefill_lengths: tuple[int, ...] = (512, 2048, 8192)
    prefill_targets: tuple[int, ...] = (2048, 8192)  # prefill >= Hugging Face's tok/s here
    decode_batches: tuple[int, ...] = (32, 8, 1)  # the target's first: kept if time runs out
    decode_context: int = 512  # tokens each decoding sequence holds before the timed steps
    decode_steps: int = 10  # timed steps per batch (after `decode_warmup`)
    decode_warmup: int = 2
    repeats: int = 3  # timed runs of everything else (after one warm-up run)
    copy_bytes: int = 4 << 30  # buffer of the bandwidth measurement
    matmul_n: int = 8192  # n of the n x n x n bf16 matmul that measures the flop rate


FULL = Sizes()

# Toy lengths picked to share compiled shapes (the step's token and row buckets: every prefill
# here and the decode contexts run bucket 64, both decode batches bucket 4; both edits' prefills
# and re-prefills bucket 256, their splices one move bucket), so the smoke spends its time
# running every code path rather than compiling each length anew.
SMOKE = Sizes(
    hf=SMOKE_HF,
    splice_downstream=(256, 1024),
    splice_iters=3,
    attention_contexts=(64,),
    attention_batches=(1, 2),
    attention_wide=2,
    attention_chunk=16,
    edit_downstream=(130, 170),
    edit_layers=2,
    edit_prefix=64,
    edit_span=16,
    edit_stub=5,
    prefill_lengths=(40, 52, 64),
    prefill_targets=(52, 64),
    decode_batches=(4, 3),
    decode_context=64,
    decode_steps=3,
    decode_warmup=1,
    repeats=2,
    copy_bytes=16 << 20,
    matmul_n=256,
)


def quick(sz: Sizes) -> Sizes:
    """`sz` cut to the rows the targets are read at, with fewer repeats (run.sh --quick): the
    same tables, fewer rows. Dropped: attention's smaller contexts (4k) and its prefill chunk,
    the splice's middle sizes (32k), decode batches but the first (C = 8 and 1), prefill lengths
    but `prefill_targets` (512), AMORTIZE vs FORGET past the first D (32k), and the jnp path
    beside the kernels; samples: splice 3 (of 5), attention 3 (of 5), decode 5 steps after 1
    (of 10 after 2), prefill and AMORTIZE 2 runs (of 3)."""
    return dataclasses.replace(
        sz,
        quick=True,
        beside_jnp=False,
        splice_downstream=(min(sz.splice_downstream), max(sz.splice_downstream)),
        splice_samples=min(sz.splice_samples, 3),
        attention_contexts=(max(sz.attention_contexts),),
        attention_chunk=0,
        attention_repeats=min(sz.attention_repeats, 3),
        edit_downstream=sz.edit_downstream[:1],
        prefill_lengths=tuple(t for t in sz.prefill_lengths if t in sz.prefill_targets),
        decode_batches=sz.decode_batches[:1],
        decode_steps=min(sz.decode_steps, 5),
        decode_warmup=1,
        repeats=min(sz.repeats, 2),
    )


# What an H200 / H100 (SXM) is rated at, for context beside the measured rates (never a floor).
SPEC_PEAKS = {
    "NVIDIA H200": {"bf16_dense_flop_s": 989e12, "hbm_bytes_s": 4.8e12},
    "NVIDIA H100 80GB HBM3": {"bf16_dense_flop_s": 989e12, "hbm_bytes_s": 3.35e12},
}


def sizes(smoke: bool, quick_run: bool = False) -> Sizes:
    """The sizes of a run: smoke or full, cut by `quick` with --quick."""
    sz = SMOKE if smoke else FULL
    return quick(sz) if quick_run else sz
