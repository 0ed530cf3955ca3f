"""`EngineConfig`: the one owner of the engine's settings and their defaults.

The engine, the HTTP server, the demo and the replay benchmark all take their settings from
here; the command lines add the same flags with the same defaults (`add_arguments`) and read
them back (`from_args`), like vLLM's `EngineArgs`.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp

from leyline_jax.directives import check_recompute
from leyline_jax.hf_config import is_int
from leyline_jax.kv_state import checked_growth

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}  # the command line's names


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an engine is sized and what it does by default. Checked when made (ValueError
    naming the field).

    The pool: `num_pages` pages of `page_size` tokens, for up to `max_seqs` sequences (running
    or idle sessions holding KV) of at most `max_seq_len` tokens (None: the pool's capacity
    capped at the model's `max_position_embeddings`). `kv_dtype` stores the moved band (MLA
    `c_kv`, GQA V), `k_pe_dtype` the rotated one (None: float32, see `ll.init_state`).
    `prefill_chunk`: the most prompt tokens one turn feeds per step;
    `max_num_batched_tokens`: the most new tokens one step carries, all turns together (as
    vLLM's setting of that name): the top of the step's token buckets, so it bounds the
    shapes a server compiles (`leyline_jax.paged.step_shapes`). `bucket_growth`: each bucket
    over the one before (None: `leyline_jax.kv_state.BUCKET_GROWTH`, powers of two): larger,
    fewer shapes to compile and more padding per step. `radix`: keep the radix
    prefix cache. `move`: MOVE by default (a turn may say otherwise). `recompute`: the budget
    a turn's AMORTIZE and MOVE splices recompute by default (`Directive.recompute`: a token
    count or a fraction of the downstream; a turn may say otherwise, and a directive naming a
    nonzero budget keeps its own; a DECAY resolved into a MOVE takes it too)."""

    num_pages: int = 512
    page_size: int = 16
    max_seqs: int = 16
    max_seq_len: int | None = None
    kv_dtype: object = jnp.bfloat16
    k_pe_dtype: object = None
    prefill_chunk: int = 256
    max_num_batched_tokens: int = 512
    bucket_growth: int | None = None
    radix: bool = True
    move: bool = False
    recompute: int | float = 0

    def __post_init__(self):
        for name in (
            "num_pages",
            "page_size",
            "max_seqs",
            "prefill_chunk",
            "max_num_batched_tokens",
        ):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.max_seq_len is not None and (not is_int(self.max_seq_len) or self.max_seq_len < 1):
            raise ValueError(f"max_seq_len={self.max_seq_len!r} must be a positive integer")
        if self.bucket_growth is not None:  # None stays: the library's default, read later
            checked_growth(self.bucket_growth)
        for name in ("prefill_chunk", "max_seqs"):  # a step holds one turn's chunk; every row
            if getattr(self, name) > self.max_num_batched_tokens:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be at most "
                    f"max_num_batched_tokens={self.max_num_batched_tokens}"
                )
        for name in ("radix", "move"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
        try:
            object.__setattr__(self, "recompute", check_recompute(self.recompute))
        except ValueError as e:
            raise ValueError(f"recompute={self.recompute!r}: {e}") from None
        for name in ("kv_dtype", "k_pe_dtype"):
            v = getattr(self, name)
            if isinstance(v, str):  # a command line's name: bf16, fp32
                if v not in DTYPES:
                    raise ValueError(f"{name}={v!r} must be one of {sorted(DTYPES)}")
                object.__setattr__(self, name, DTYPES[v])

    def state_args(self) -> dict:
        """The `leyline_jax.init_state` arguments of this pool."""
        keys = ("num_pages", "page_size", "max_seqs", "max_seq_len", "kv_dtype", "k_pe_dtype")
        return {k: getattr(self, k) for k in keys} | {
            "max_step_tokens": self.max_num_batched_tokens,
            "bucket_growth": self.bucket_growth,
        }

    # ---- the command line --------------------------------------------------------------------
    @staticmethod
    def add_arguments(ap: argparse.ArgumentParser, fields: tuple[str, ...] | None = None) -> None:
        """Add `--num-pages`, `--page-size`, ... (every setting, or `fields`) with this class's
        defaults."""
        helps = {
            "num_pages": "KV pages in the pool",
            "page_size": "tokens per KV page",
            "max_seqs": "sequences (sessions holding KV) at once",
            "max_seq_len": "longest sequence (default: the pool, capped by the model)",
            "kv_dtype": "the moved band's storage: bf16 or fp32",
            "prefill_chunk": "most prompt tokens one turn feeds per step",
            "max_num_batched_tokens": "most new tokens one step carries (bounds compiled shapes)",
            "bucket_growth": "each shape bucket over the one before (default 2)",
            "recompute": "what an AMORTIZE splice recomputes by default: a fraction of its "
            "downstream (0.15) or a token count (600)",
        }
        default = EngineConfig()
        for name, text in helps.items():
            if fields is not None and name not in fields:
                continue
            flag = "--" + name.replace("_", "-")
            if name == "kv_dtype":
                ap.add_argument(flag, default="bf16", choices=["bf16", "fp32"], help=text)
            elif name == "recompute":
                ap.add_argument(flag, type=_budget, default=default.recompute, help=text)
            else:
                ap.add_argument(flag, type=int, default=getattr(default, name), help=text)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """The settings a parsed command line gave (flags it lacks keep their defaults)."""
        names = [f.name for f in dataclasses.fields(cls)]
        given = {k: getattr(args, k) for k in names if hasattr(args, k)}
        return cls(**{**given, **overrides})


def _budget(text: str) -> int | float:
    """`--recompute`: a fraction when written with a point (0.15, 1.0), else a token count."""
    try:
        return check_recompute(float(text) if "." in text else int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
