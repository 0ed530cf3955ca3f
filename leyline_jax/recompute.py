"""Recompute after a splice: a budget of downstream tokens run through the model again.

AMORTIZE keeps the downstream KV as it was computed, with the evicted span in its context. A
directive's `recompute` (a fraction of its downstream, 0-1, or a token count) spends a budget
between that and FORGET: after the splice and the replacement's prefill, the KV of the chosen
downstream tokens is computed again, every layer, each attending to the edited sequence's KV
before it (the chosen tokens' new KV, the others' spliced KV). Recompute 0 is AMORTIZE; the
whole downstream is FORGET's KV.

Which tokens (`choose`):

1. the border: the first `BORDER` tokens past the replacement (EPIC, arXiv 2410.15332:
   recomputing the first <= 32 tokens at each chunk's border), fewer if the budget is smaller;
2. the rest by the rule: "border" (the budget taken from the border on, in order: the cheaper
   rule, needing no probe; `apply_directives`' default) or "deviation" (CacheBlend, EuroSys
   '25: the tokens whose KV at an early layer deviates most from a fresh computation). On
   SmolLM2 the two agree with FORGET equally often at 25% and 50% of the downstream (72% and
   72%, 81% and 83%; BENCHMARKS.md, "Edits that keep what matters"), so the cheaper one is
   the default.

The deviation is measured at layer 1 (layer 0's KV depends on the token and its position only,
so a splice leaves it as a fresh prefill would): the candidates run through layer 0 attending
to the sequence's KV (the ragged step's layer 0, nothing written), and the distance between
layer 1's KV of that hidden state and the cached one (both bands, squared, summed over heads)
is each token's score. Its cost: one layer over the candidates, against the model's every
layer for FORGET.

The unit the rule picks is a block of `BLOCK` tokens (scored by its tokens' sum), not a token:
the ragged step runs a contiguous run of a row's positions, and a step carries few rows
(`paged.refill`), so scattered single tokens would cost a step each few tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from leyline_jax import paged
from leyline_jax.kv_pools import gather_slots
from leyline_jax.kv_state import PagedKVState
from leyline_jax.model import CausalLM, Split, merge

BORDER = 32  # tokens past the replacement always recomputed first (EPIC's border)
BLOCK = 16  # the unit a rule picks past the border
RULES = ("deviation", "border")


def budget(recompute: int | float, downstream: int) -> int:
    """Tokens a directive's `recompute` asks for, of its `downstream` tokens: an int is a
    count (at most the downstream), a float a fraction of it (rounded half up)."""
    if isinstance(recompute, float):
        return min(downstream, math.floor(recompute * downstream + 0.5))
    return min(downstream, recompute)


def choose(first: int, length: int, k: int, scores: np.ndarray | None) -> list[int]:
    """`k` positions of [first, length), sorted: the border, then blocks of `BLOCK` (from
    `first + border` on) by `scores` (f64 over [first, length); the best first, the earlier
    on ties; the last block taken in part), or in order where `scores` is None."""
    k = min(k, length - first)
    border = min(BORDER, k)
    chosen = list(range(first, first + border))
    rest = k - border
    if rest <= 0:
        return chosen
    lo = first + border
    blocks = [(a, min(a + BLOCK, length)) for a in range(lo, length, BLOCK)]
    if scores is not None:
        sums = [float(np.sum(scores[a - first : b - first])) for a, b in blocks]
        order = sorted(range(len(blocks)), key=lambda i: (-sums[i], i))
        blocks = [blocks[i] for i in order]
    for a, b in blocks:
        take = min(b - a, rest)
        chosen += range(a, a + take)
        rest -= take
        if rest == 0:
            break
    return sorted(chosen)


@functools.partial(jax.jit, static_argnums=0)
def _kv_distance(graph, params, pools, h, positions, slots):
    """f32[T]: the squared distance between layer 1's KV of `h` (`attn.cached`) and the KV
    cached at `slots`, both bands, summed over heads."""
    layer = merge(graph, params)
    fresh = layer.attn.cached(layer.input_norm(h), positions)
    cached = gather_slots(pools, 0, slots)
    total = jnp.zeros(h.shape[0], jnp.float32)
    for a, b in zip(fresh, cached, strict=True):
        d = (a.astype(jnp.float32) - b.astype(jnp.float32)).reshape(h.shape[0], -1)
        total = total + jnp.sum(d * d, axis=-1)
    return total


def deviation(model: CausalLM, state: PagedKVState, seq: int, first: int, graph=None):
    """(state, f64[length - first]): CacheBlend's deviation of each of `seq`'s tokens from
    `first` on (see the module docstring), from the KV the sequence holds now. Layer 0 runs
    as the ragged step's, writing nothing (`paged.first_layer`), a step's worth at a time."""
    n = int(state.lengths[seq])
    graph = Split.of(model) if graph is None else graph
    if len(graph.layers) < 2:
        return state, np.zeros(n - first)  # one layer: no layer's input depends on the context
    out = []
    for a in range(first, n, state.max_step_tokens):
        b = min(a + state.max_step_tokens, n)
        state, h, positions, slots = paged.first_layer(model, state, seq, a, b, graph)
        d = _kv_distance(*graph.layers[1], state.pools.layer(1), h, positions, slots)
        with jax.transfer_guard_device_to_host("allow"):  # the read this function is for
            out.append(np.asarray(d, np.float64)[: b - a])
    return state, np.concatenate(out) if out else np.zeros(0)


def runs(positions) -> list[tuple[int, int]]:
    """Sorted distinct positions as contiguous [a, b) runs."""
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1][1] += 1
        else:
            out.append([p, p + 1])
    return [(a, b) for a, b in out]
