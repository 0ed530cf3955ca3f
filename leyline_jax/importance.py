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

The other rule, "reconstruct" (KVzip's, arXiv 2505.23416: score a context without knowing the
question, by how much the model reads each token when asked to repeat it): on a spare sequence
forked from this one (sharing its pages), the caller's `repeat` prompt (e.g. a user turn
asking to repeat the text above, and the assistant's opening) and then the span's own tokens
are prefilled, as if the model were repeating the span; each span token's score is the most
attention any of the repeated tokens' queries gives it (heads summed), summed over layers;
rules 3 and 4 as above. The spare sequence is freed after: the sequence's KV is untouched.
Cost: a prefill of the prompt and the span on the fork, then the same probe of the span's
tokens (`reconstruction_scores`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from leyline_jax import allocator, paged
from leyline_jax.allocator import OutOfPagesError
from leyline_jax.kv_state import PagedKVState, bucket
from leyline_jax.model import CausalLM, Split, merge

WINDOW = 32  # recent queries scored (SnapKV's observation window)
POOL = 5  # width of the average pool over the span's scores (SnapKV's kernel size)
MIN_CTX_BUCKET = 16
RULES = ("window", "reconstruct")


@functools.partial(jax.jit, static_argnums=(0, 8))
def _layer_mass(graph, params, pools, h, positions, live, ctx_slots, ctx_len, reduce="sum"):
    """One layer of the probe (`pools`: that layer's pages alone): h after the layer, and
    f32[S] the attention the window's live queries (at `positions`) give each of the
    sequence's slots `ctx_slots` (slot s at position s; those at `ctx_len` and past are
    padding), heads summed, then summed over the queries (`reduce` "sum") or their most
    ("max")."""
    layer = merge(graph, params)
    s = jnp.arange(ctx_slots.shape[0])
    # a padding query may read slot 0 only (no empty softmax row); its mass is dropped below
    mask = (s[None, :] <= jnp.where(live, positions, 0)[:, None]) & (s[None, :] < ctx_len)
    out, m = layer.attn.probe(layer.input_norm(h), positions, pools, 0, ctx_slots, mask)
    m = jnp.where(live[:, None], m, 0.0)
    return layer.feed_forward(h + out), m.max(0) if reduce == "max" else m.sum(0)


def scores(
    model: CausalLM,
    state: PagedKVState,
    seq: int,
    *,
    window: int = WINDOW,
    graph=None,
    reduce: str = "sum",
):
    """f64[n]: every cached token's attention mass from the last `window` queries (rule 2;
    `reduce`: as `_layer_mass`)."""
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
        args = (h, positions, live, slots, np.int32(n), reduce)
        h, m = _layer_mass(*layer, state.pools.layer(i), *args)
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


def reconstruction_scores(
    model: CausalLM, state: PagedKVState, seq: int, start: int, end: int, repeat, graph=None
):
    """(state, f64[end - start]): the "reconstruct" rule's score of each token of the span
    (see the module docstring), `repeat` the prompt's token ids. Needs a sequence slot not in
    use (ValueError) and pages for the prompt and the span (OutOfPagesError), checked before
    anything changes; the state comes back with the spare sequence freed."""
    idle = [q for q in range(state.max_seqs) if not state.active[q]]
    if not idle:
        raise ValueError("the reconstruct rule needs a sequence slot not in use: none is free")
    asked = [int(t) for t in repeat] + [int(t) for t in state.token_ids[seq][start:end]]
    need = allocator.pages_for(int(state.lengths[seq]) + len(asked), state.page_size)
    need -= int(state.lengths[seq]) // state.page_size  # whole pages stay shared
    if need > len(allocator.free_pages(state)):
        raise OutOfPagesError(f"the reconstruct rule needs {need} free pages")
    spare = idle[0]
    state = allocator.fork(state, seq, spare)
    state, _ = paged.prefill(model, state, spare, asked)
    s = scores(model, state, spare, window=end - start, graph=graph, reduce="max")
    return allocator.free(state, spare), s[start:end]


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
