"""What the device suite measures, at full size (one H200) and at smoke size (CPU, CI).

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
    JSON says so)."""

    hf: dict = dataclasses.field(default_factory=lambda: V2_LITE_HF)  # every part's model
    page_size: int = 16
    # (b) the splice pass alone
    splice_downstream: tuple[int, ...] = (8192, 32768, 131072)
    # (b') ragged paged attention of one layer: decode rows of a context each, a prefill chunk
    attention_contexts: tuple[int, ...] = (4096, 32768)
    attention_batches: tuple[int, ...] = (1, 32, 128)
    attention_chunk: int = 512  # a prefill chunk's queries, over the first context's tokens
    # (c) AMORTIZE vs FORGET: a prefix, a span replaced by a stub, then D downstream tokens
    edit_downstream: tuple[int, ...] = (8192, 32768)
    edit_layers: int = 4
    edit_prefix: int = 1024
    edit_span: int = 64
    edit_stub: int = 20
    edit_forget_repeats: int = 1  # FORGET re-prefills D tokens per run: the costliest timed run
    # (d) the whole model (decode runs first: its largest batch is the target)
    prefill_lengths: tuple[int, ...] = (512, 2048, 8192)
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
# and re-prefills bucket 256, their splices one move bucket), so the smoke spends its two
# minutes running every code path rather than compiling each length anew.
SMOKE = Sizes(
    hf=SMOKE_HF,
    splice_downstream=(256, 1024),
    attention_contexts=(64,),
    attention_batches=(1, 2),
    attention_chunk=16,
    edit_downstream=(130, 170),
    edit_layers=2,
    edit_prefix=64,
    edit_span=16,
    edit_stub=5,
    prefill_lengths=(40, 52, 64),
    decode_batches=(4, 3),
    decode_context=64,
    decode_steps=3,
    decode_warmup=1,
    repeats=2,
    copy_bytes=16 << 20,
    matmul_n=256,
)

# What an H200 (SXM) is rated at, for context beside the measured rates (never for a floor).
SPEC_PEAKS = {"NVIDIA H200": {"bf16_dense_flop_s": 989e12, "hbm_bytes_s": 4.8e12}}


def sizes(smoke: bool) -> Sizes:
    return SMOKE if smoke else FULL
