"""Paged prefill and decode over `PagedKVState`, and the checked public state operations.

Each public function validates on the host first (one small metadata transfer), so a bad call
raises before anything changes; then it pads to a bucketed shape and calls a private jitted step
that donates the state. Donation means the state passed in is consumed: keep using the returned
one.

Attention form. With T query tokens against S cached slots, the expanded form (K_nope and V per
head from the gathered latent) costs S·R·N·(Dn+Dv) to expand plus T·S·N·(Dn+Dr+Dv) to attend;
the absorbed form (queries multiplied into the latent space, attention reading `c_kv` and `k_pe`
directly, no per-head K/V for the cache) costs T·S·N·(2R+Dr). Decode (T = 1 per sequence)
always absorbs; a prefill block absorbs when T·(2R+Dr) < R·(Dn+Dv) (T < 120 for DeepSeek
shapes: short chunks and directive fills) and expands otherwise (long prompt chunks).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from leyline_jax import kv_state as kv
from leyline_jax.config import check_ids, check_tokens
from leyline_jax.kv_state import OutOfPagesError, PagedKVState, SequenceError
from leyline_jax.model import MLAModel, mla_attention

MIN_TOKEN_BUCKET = 16
# Longer prefills run in chunks of this many tokens (bounds the [N, T, S] score buffer).
PREFILL_CHUNK = 1024


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two >= max(n, minimum), capped at `maximum`."""
    b = 1 << (max(n, minimum) - 1).bit_length()
    return b if maximum is None else min(b, maximum)


def page_width(state: PagedKVState, length: int) -> int:
    """Page-table width (bucketed) of a step whose rows hold at most `length` tokens."""
    return bucket(-(-length // state.page_size), maximum=state.max_pages_per_seq)


# ---- the model over a paged cache (traced inside the jitted steps) ---------------------------
def _forward_paged(
    model: MLAModel, state: PagedKVState, tokens, positions, slots, pages, mask, *, absorbed: bool
):
    """Run the decoder over new tokens whose KV goes to `slots`, attending through `pages`.

    Batched over rows: tokens/positions/slots [B, T], pages [B, W], mask bool[B, T, W*page_size].
    Returns the final hidden states [B, T, H] (after the final norm) and the new state.
    """
    valid = mask.any(axis=1)  # [B, S] slots some query of the row may read
    attend = jax.vmap(
        functools.partial(mla_attention, scale=model.config.softmax_scale, absorbed=absorbed),
        in_axes=(0, 0, 0, 0, None, None, 0),  # per row; the up-projections are shared
    )
    h = model.embed_tokens(tokens)
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        x = layer.input_norm(h)
        q_nope, q_pe = attn.queries(x, positions)
        c_new, k_new = attn.latent(x, positions)
        state = kv.write_kv(state, i, slots, c_new, k_new)
        c_all, k_all = kv.gather_kv(state, i, pages, valid)
        w_kb, w_vb = attn.kv_up()
        o = attend(q_nope, q_pe, c_all.astype(h.dtype), k_all.astype(h.dtype), w_kb, w_vb, mask)
        h = layer.feed_forward(h + attn.output(o))
    return model.final_norm(h), state


def _attention_mask(state, lengths_after, positions, width):
    """bool[B, T, W*ps]: slot s readable by the query at `positions[b, t]`."""
    slot = jnp.arange(width * state.page_size)
    return (slot[None, None, :] <= positions[:, :, None]) & (
        slot[None, None, :] < lengths_after[:, None, None]
    )


def _absorb(config, t: int) -> bool:
    """Absorbed form for a block of t queries? Per slot, expanding K/V costs R·N·(Dn+Dv)
    multiply-adds once; the absorbed form costs t·N·(2R+Dr) (scores against c_kv and k_pe, and
    the output in latent space). Short blocks (decode, fills, small chunks) absorb."""
    c = config
    return t * (2 * c.kv_lora_rank + c.qk_rope_head_dim) < c.kv_lora_rank * (
        c.qk_nope_head_dim + c.v_head_dim
    )


def _fill(model, state, seq, tokens, start, count, width):
    """Run `count` real tokens (of `tokens`, i32[T]) at positions start.. of `seq`, whose slots the
    page table already holds; each attends to every slot before it. Returns the state and the
    float32 logits after the last real token."""
    ps = state.page_size
    positions = (start + jnp.arange(tokens.shape[0]))[None]  # [1, T]
    real = jnp.arange(tokens.shape[0])[None] < count
    pages = state.page_table[seq, :width][None]  # [1, W]
    col = jnp.minimum(positions // ps, width - 1)
    slots = jnp.where(
        real, jnp.take_along_axis(pages, col, 1) * ps + positions % ps, state.num_pages * ps
    )
    mask = _attention_mask(state, (start + count)[None], positions, width)
    absorbed = _absorb(model.config, tokens.shape[0])
    h, state = _forward_paged(
        model, state, tokens[None], positions, slots, pages, mask, absorbed=absorbed
    )
    last = jax.lax.dynamic_index_in_dim(h[0], count - 1, keepdims=False)
    return state, model.logits(last)


@functools.partial(jax.jit, static_argnums=0, static_argnames="width", donate_argnames="state")
def _extend_step(graphdef, params, state, seqs, tokens, counts, *, width):
    """Append `counts[b]` tokens (of tokens[b], i32[B, T]) to each of `seqs` and run them; each
    attends to its own sequence. Rows with count 0 are padding. Logits after each row's last."""
    model = nnx.merge(graphdef, params)
    state, slots = kv.append_tokens(state, seqs, tokens, counts)
    after = state.lengths[seqs]
    positions = (after - counts)[:, None] + jnp.arange(tokens.shape[1])[None]
    pages = state.page_table[seqs, :width]
    mask = _attention_mask(state, after, positions, width)
    absorbed = _absorb(model.config, tokens.shape[1])
    h, state = _forward_paged(
        model, state, tokens, positions, slots, pages, mask, absorbed=absorbed
    )
    last = h[jnp.arange(tokens.shape[0]), jnp.maximum(counts - 1, 0)]
    return state, model.logits(last)


@functools.partial(jax.jit, static_argnums=0, static_argnames="width", donate_argnames="state")
def _fill_step(graphdef, params, state, seq, tokens, start, count, *, width):
    return _fill(nnx.merge(graphdef, params), state, seq, tokens, start, count, width)


@functools.partial(jax.jit, static_argnums=0, static_argnames="width", donate_argnames="state")
def _decode_step(graphdef, params, state, seqs, tokens, counts, *, width):
    model = nnx.merge(graphdef, params)
    state, slots = kv.append_tokens(state, seqs, tokens[:, None], counts)
    after = state.lengths[seqs]
    positions = (after - counts)[:, None]
    pages = state.page_table[seqs, :width]
    mask = _attention_mask(state, after, positions, width)
    h, state = _forward_paged(
        model, state, tokens[:, None], positions, slots, pages, mask, absorbed=True
    )
    return state, model.logits(h[:, 0])


_open = jax.jit(kv.open_seq, donate_argnums=0)
_retain = jax.jit(kv.retain_pages, donate_argnums=0)
_release = jax.jit(kv.release_pages, donate_argnums=0, static_argnames="zero")
_adopt = jax.jit(kv.adopt_prefix, donate_argnums=0)
_free = jax.jit(kv.free_seq, donate_argnums=0)
_fork = jax.jit(kv.fork_seq, donate_argnums=0)


# ---- host checks ----------------------------------------------------------------------------
def _free_pages(meta) -> int:
    return int((meta["refcount"] == 0).sum())


def _last_page_shared(meta, state: PagedKVState, seq: int) -> bool:
    n = int(meta["lengths"][seq])
    if n == 0:
        return False
    page = int(meta["page_table"][seq, (n - 1) // state.page_size])
    return bool(meta["refcount"][page] > 1)


def _check_room(state: PagedKVState, seq: int, length: int, count: int) -> None:
    if length + count > state.max_seq_len:
        raise SequenceError(
            f"sequence {seq} would hold {length + count} tokens, more than max_seq_len="
            f"{state.max_seq_len}"
        )


def _rows(state: PagedKVState, meta, seqs: list, blocks: list, min_tokens: int):
    """Bucketed, padded arguments of a batched step appending blocks[i] to seqs[i]:
    (seqs i32[B], tokens i32[B, T], counts i32[B], page-table width). Padding rows
    repeat the first sequence with count 0: they append and write nothing."""
    b, t = bucket(len(seqs)), bucket(max(len(x) for x in blocks), min_tokens)
    longest = max(int(meta["lengths"][s]) + len(x) for s, x in zip(seqs, blocks, strict=True))
    w = page_width(state, longest)
    pad_seqs = np.full(b, seqs[0], np.int32)
    pad_seqs[: len(seqs)] = seqs
    pad_toks = np.zeros((b, t), np.int32)
    counts = np.zeros(b, np.int32)
    for i, x in enumerate(blocks):
        pad_toks[i, : len(x)] = x
        counts[i] = len(x)
    return jnp.asarray(pad_seqs), jnp.asarray(pad_toks), jnp.asarray(counts), w


def _check_appends(state: PagedKVState, seqs: list, counts: list):
    """Host checks for appending counts[i] tokens to open, distinct seqs[i] (ints, not
    coerced); returns the meta."""
    meta = kv.host_meta(state)
    for s in seqs:
        kv.check_seq(meta, state, s, must_be_open=True)
    if len(set(seqs)) != len(seqs):
        raise SequenceError(f"a sequence appears twice in one step: {seqs}")
    need = 0
    for s, n in zip(seqs, counts, strict=True):
        length = int(meta["lengths"][s])
        _check_room(state, s, length, n)
        need += int(
            kv.pages_needed(length, n, _last_page_shared(meta, state, s), state.page_size)[0]
        )
    if need > _free_pages(meta):
        raise OutOfPagesError(
            f"appending to {len(seqs)} sequences needs {need} pages; {_free_pages(meta)} of "
            f"{state.num_pages} are free"
        )
    return meta


# ---- public API -----------------------------------------------------------------------------
def prefill(
    model: MLAModel, state: PagedKVState, seq: int, tokens
) -> tuple[PagedKVState, jax.Array]:
    """Append `tokens` to sequence `seq` (opening it if it is not open) and run them through the
    model. Returns the new state and float32 logits [vocab] after the last appended token.

    Works for a new sequence (prefill) and a cached one (chunked prefill / extend). Raises
    `ValueError` for bad tokens, `SequenceError` for a bad sequence id or an overlong sequence,
    `OutOfPagesError` when the pool is short — all before the state changes. Donates `state`.
    """
    toks = check_tokens(tokens, model.config.vocab_size)
    meta = kv.host_meta(state)
    seq = kv.check_seq(meta, state, seq, must_be_open=False)
    is_new = not meta["active"][seq]
    length = 0 if is_new else int(meta["lengths"][seq])
    n = len(toks)
    _check_room(state, seq, length, n)
    need, _ = kv.pages_needed(length, n, _last_page_shared(meta, state, seq), state.page_size)
    if need > _free_pages(meta):
        raise OutOfPagesError(
            f"prefill of {n} tokens on sequence {seq} needs {need} pages; "
            f"{_free_pages(meta)} of {state.num_pages} are free"
        )
    if is_new:
        state = _open(state, seq)
    graphdef, params = nnx.split(model)
    for a in range(0, n, PREFILL_CHUNK):
        chunk = toks[a : a + PREFILL_CHUNK]
        padded = np.zeros(bucket(len(chunk), MIN_TOKEN_BUCKET), np.int32)
        padded[: len(chunk)] = chunk
        end = length + a + len(chunk)
        state, logits = _extend_step(
            graphdef,
            params,
            state,
            jnp.asarray([seq], jnp.int32),
            jnp.asarray(padded[None]),
            jnp.asarray([len(chunk)], jnp.int32),
            width=page_width(state, end),
        )
    return state, logits[0]


def extend(
    model: MLAModel,
    state: PagedKVState,
    seqs: Sequence[int],
    tokens: Sequence[Sequence[int]],
    *,
    graph=None,
) -> tuple[PagedKVState, jax.Array]:
    """Append a block of tokens to each of several open sequences in one batched step (the
    prefill half of continuous batching). Blocks may differ in length; each is at most
    `PREFILL_CHUNK` tokens. Returns the new state and float32 logits [len(seqs), vocab] after
    each block's last token. Raises like `decode`, before the state changes. Donates `state`.
    `graph`: `nnx.split(model)` made once by a caller that steps often (saves the split)."""
    seqs = list(seqs)
    blocks = [check_tokens(t, model.config.vocab_size) for t in tokens]
    if len(seqs) != len(blocks) or not seqs:
        raise ValueError(f"{len(seqs)} sequences but {len(blocks)} token blocks")
    if any(len(b) == 0 or len(b) > PREFILL_CHUNK for b in blocks):
        raise ValueError(f"each block needs 1..{PREFILL_CHUNK} tokens")
    meta = _check_appends(state, seqs, [len(b) for b in blocks])
    graphdef, params = nnx.split(model) if graph is None else graph
    rows, toks, counts, width = _rows(state, meta, seqs, blocks, MIN_TOKEN_BUCKET)
    state, logits = _extend_step(graphdef, params, state, rows, toks, counts, width=width)
    return state, logits[: len(seqs)]


def decode(
    model: MLAModel,
    state: PagedKVState,
    seqs: Sequence[int],
    tokens: Sequence[int],
    *,
    graph=None,
) -> tuple[PagedKVState, jax.Array]:
    """Append one token to each of several open sequences in one batched step.

    Returns the new state and float32 logits [len(seqs), vocab]. Sequences must be distinct and
    open. Raises like `prefill`, before the state changes. Donates `state`. `graph`: as `extend`.
    """
    seqs = list(seqs)
    toks = check_tokens(tokens, model.config.vocab_size)
    if len(seqs) != len(toks):
        raise ValueError(f"{len(seqs)} sequences but {len(toks)} tokens")
    meta = _check_appends(state, seqs, [1] * len(seqs))
    graphdef, params = nnx.split(model) if graph is None else graph
    rows, padded, counts, width = _rows(state, meta, seqs, [[t] for t in toks], 1)
    state, logits = _decode_step(graphdef, params, state, rows, padded[:, 0], counts, width=width)
    return state, logits[: len(seqs)]


def fork(state: PagedKVState, src: int, dst: int) -> PagedKVState:
    """Open `dst` as a copy of open sequence `src`, sharing its pages. Donates `state`."""
    meta = kv.host_meta(state)
    kv.check_seq(meta, state, src, must_be_open=True)
    kv.check_seq(meta, state, dst, must_be_open=False)
    if meta["active"][dst]:
        raise SequenceError(f"sequence {dst} is already open")
    return _fork(state, src, dst)


def free(state: PagedKVState, seq: int) -> PagedKVState:
    """Close open sequence `seq`, releasing its page references. Donates `state`."""
    meta = kv.host_meta(state)
    kv.check_seq(meta, state, seq, must_be_open=True)
    return _free(state, seq)


def _page_list(state: PagedKVState, pages) -> np.ndarray:
    p = check_ids(pages, state.num_pages, "page id", allow_empty=True)
    if len(np.unique(p)) != len(p):
        raise ValueError("page ids must be distinct")
    out = np.full(bucket(max(len(p), 1)), state.num_pages, np.int32)
    out[: len(p)] = p
    return out


def retain(state: PagedKVState, pages) -> PagedKVState:
    """Take a reference to each of `pages` (pages in use) for a holder outside any sequence,
    such as a prefix cache. Donates `state`."""
    p = _page_list(state, pages)
    rc = np.asarray(state.refcount)
    if (rc[p[p < state.num_pages]] == 0).any():
        raise ValueError("only pages in use can be retained")
    return _retain(state, jnp.asarray(p))


def release(state: PagedKVState, pages, *, zero: bool = False) -> PagedKVState:
    """Drop a reference taken with `retain`; with `zero`, pages left unreferenced are zeroed.
    A page whose references all come from sequences' page tables is refused (ValueError): its
    holders free it with `free`. Donates `state`."""
    p = _page_list(state, pages)
    meta = kv.host_meta(state)
    outside = meta["refcount"] - kv.table_references(meta, state.page_size, state.num_pages)
    held = p[p < state.num_pages]
    if (outside[held] < 1).any():
        bad = int(held[outside[held] < 1][0])
        raise ValueError(
            f"page {bad} holds no reference taken with retain (only sequences reference it)"
        )
    return _release(state, jnp.asarray(p), zero=zero)


def adopt(state: PagedKVState, seq: int, pages, tokens) -> PagedKVState:
    """Open `seq` as the `len(tokens)` tokens whose KV is held in the full pages `pages` (a
    prefix cache hit): the sequence shares those pages and appends after them. Donates
    `state`."""
    meta = kv.host_meta(state)
    seq = kv.check_seq(meta, state, seq, must_be_open=False)
    if meta["active"][seq]:
        raise SequenceError(f"sequence {seq} is already open")
    p = check_ids(pages, state.num_pages, "page id", allow_empty=True)
    tokens = check_tokens(tokens, state.vocab_size, allow_empty=True)
    if len(tokens) != len(p) * state.page_size or len(tokens) > state.max_seq_len:
        raise ValueError("adopted tokens must fill the given pages exactly")
    if (meta["refcount"][p] == 0).any():
        raise ValueError("adopted pages must be pages in use")
    row = np.full(state.max_pages_per_seq, state.num_pages, np.int32)
    row[: len(p)] = p
    tok = np.zeros(state.max_seq_len, np.int32)
    tok[: len(tokens)] = tokens
    return _adopt(state, jnp.int32(seq), jnp.asarray(row), jnp.asarray(tok), jnp.int32(len(tokens)))


def compile_counts() -> dict[str, int]:
    """How many shapes each jitted step has compiled (for tests and benchmarks)."""
    steps = {"extend": _extend_step, "decode": _decode_step, "fill": _fill_step}
    ops = {"open": _open, "retain": _retain, "release": _release, "adopt": _adopt}
    ops |= {"free": _free, "fork": _fork}
    return {name: f._cache_size() for name, f in (steps | ops).items()}


__all__ = [
    "OutOfPagesError",
    "SequenceError",
    "bucket",
    "page_width",
    "compile_counts",
    "decode",
    "extend",
    "fork",
    "free",
    "prefill",
    "release",
    "retain",
    "adopt",
]
