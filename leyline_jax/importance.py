"""DECAY's importance rule: which tokens of a span a sequence's recent queries attend to.

The rule (SnapKV-style selection, one choice for all layers since the kept tokens are text):

1. the window is the sequence's last `WINDOW` tokens (all of them when it is shorter): the
   most recent queries, the ones whose attention says what the next tokens will read;
2. their queries are recomputed from the cache (the window's tokens run through every layer
   once, attending to the sequence's cached slots; nothing is written), and each cached slot's
   score is the softmax attention it receives, summed over the window's queries, every head
   and every layer (MLA: in the absorbed form the paged step uses; GQA: over K);
3. the span's scores are smoothed by an average pool of width `POOL` (SnapKV's pooling: a
   value spread over several tokens is kept together rather than as its single best token);
4. the `budget` highest smoothed scores are kept (ties: the earlier token), in their order.

Cost: one forward of the window's tokens, each attending to the whole sequence — a prefill of
`WINDOW` tokens, whatever the span's length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from leyline_jax.kv_state import PagedKVState, bucket
from leyline_jax.model import CausalLM, Split, merge

WINDOW = 32  # recent queries scored (SnapKV's observation window)
POOL = 5  # width of the average pool over the span's scores (SnapKV's kernel size)
MIN_CTX_BUCKET = 16


@functools.partial(jax.jit, static_argnums=0)
def _layer_mass(graph, params, pools, h, positions, live, ctx_slots, ctx_len):
    """One layer of the probe (`pools`: that layer's pages alone): h after the layer, and
    f32[S] the attention the window's live queries (at `positions`) give each of the
    sequence's slots `ctx_slots` (slot s at position s; those at `ctx_len` and past are
    padding), summed over queries and heads."""
    layer = merge(graph, params)
    s = jnp.arange(ctx_slots.shape[0])
    # a padding query may read slot 0 only (no empty softmax row); its mass is dropped below
    mask = (s[None, :] <= jnp.where(live, positions, 0)[:, None]) & (s[None, :] < ctx_len)
    out, m = layer.attn.probe(layer.input_norm(h), positions, pools, 0, ctx_slots, mask)
    return layer.feed_forward(h + out), jnp.where(live[:, None], m, 0.0).sum(0)


def scores(model: CausalLM, state: PagedKVState, seq: int, *, window: int = WINDOW, graph=None):
    """f64[n]: every cached token's attention mass from the last `window` queries (rule 2)."""
    n = int(state.lengths[seq])
    w = min(window, n)
    wb, sb = bucket(w), bucket(n, MIN_CTX_BUCKET)
    ps = state.page_size
    pos = np.arange(n)
    slots = np.zeros(sb, np.int32)
    slots[:n] = state.page_table[seq, pos // ps] * ps + pos % ps
    toks = np.zeros(wb, np.int32)
    toks[:w] = state.token_ids[seq][n - w :]
    positions = np.zeros(wb, np.int32)
    positions[:w] = np.arange(n - w, n)
    live = np.arange(wb) < w
    graph = Split.of(model) if graph is None else graph
    h, total = graph.embed(toks), jnp.zeros(sb, jnp.float32)
    for i, layer in enumerate(graph.layers):  # one program per kind of layer
        h, m = _layer_mass(*layer, state.pools.layer(i), h, positions, live, slots, np.int32(n))
        total = total + m  # float32, layer by layer
    with jax.transfer_guard_device_to_host("allow"):  # the read this function is for
        return np.asarray(total, np.float64)[:n]


def select(span_scores: np.ndarray, budget: int, *, pool: int = POOL) -> np.ndarray:
    """Offsets (sorted) of the `budget` best tokens of a span by pooled score (rules 3, 4)."""
    k = min(max(int(budget), 0), len(span_scores))
    if k == 0:
        return np.zeros(0, np.int64)
    pad = pool // 2
    padded = np.pad(np.asarray(span_scores, np.float64), pad, mode="edge")
    # window sums rank as the means do, without a rounded 1/pool per term (exact ties stay ties)
    pooled = np.convolve(padded, np.ones(pool), mode="valid")[: len(span_scores)]
    order = np.lexsort((np.arange(len(pooled)), -pooled))  # best first, earlier on ties
    return np.sort(order[:k])


def decay_selection(
    model: CausalLM,
    state: PagedKVState,
    seq: int,
    start: int,
    end: int,
    budget: int,
    *,
    window: int = WINDOW,
    pool: int = POOL,
) -> list[int]:
    """Positions (sorted) of the tokens of [start, end) that DECAY keeps with `budget`."""
    s = scores(model, state, seq, window=window)
    return [start + int(i) for i in select(s[start:end], budget, pool=pool)]
