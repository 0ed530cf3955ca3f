"""Paged prefill/decode against the full-sequence forward and Hugging Face's own cached decode.

fp32 storage and params; tolerance as the parity tests (1e-4 of max|logit|, identical argmax).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import DECODERS, random_tokens
from test_parity import assert_logits_match, rel_err

import leyline_jax as ll
from leyline_jax import allocator, kv_pools, paged
from leyline_jax import kv_state as kv
from leyline_jax.model import Split

PROMPTS = (200, 150, 77)  # three interleaved sequences; none is a multiple of 16 or 7
STEPS = 24


def hf_incremental(hf, prompt, continuation) -> np.ndarray:
    """Logits after the prompt, then after each continuation token fed one at a time with
    transformers' own cache. [1 + len(continuation), vocab]."""
    out = []
    with torch.no_grad():
        res = hf(torch.tensor(prompt, dtype=torch.long)[None], use_cache=True)
        out.append(res.logits[0, -1].numpy())
        cache = res.cache
        for tok in continuation:
            res = hf(torch.tensor([[tok]], dtype=torch.long), cache=cache, use_cache=True)
            cache = res.cache
            out.append(res.logits[0, -1].numpy())
    return np.stack(out)


def run_paged(model, page_size, prompts, conts, num_pages=None):
    """Prefill each prompt into its own sequence, then decode all of them together."""
    total = sum(len(p) + len(c) for p, c in zip(prompts, conts, strict=True))
    num_pages = num_pages or (total // page_size + 2 * len(prompts) + 1)
    state = ll.init_state(
        model.config,
        num_pages=num_pages,
        page_size=page_size,
        max_seqs=len(prompts) + 1,
        kv_dtype=jnp.float32,
    )
    got = [[] for _ in prompts]
    for s, p in enumerate(prompts):
        state, logits = ll.prefill(model, state, s, p)
        got[s].append(np.asarray(logits))
    for i in range(len(conts[0])):
        state, logits = ll.decode(model, state, list(range(len(prompts))), [c[i] for c in conts])
        for s in range(len(prompts)):
            got[s].append(np.asarray(logits[s]))
    return state, [np.stack(g) for g in got]


# every decoder at page size 16; the extremes of page size (1 slot, and 7: not a power of two,
# so pages end mid-chunk) on one model of each attention family (the MLA families differ in
# rope layout and routing, which paging does not touch)
PAGED_CASES = [(name, 16) for name in DECODERS] + [
    (name, ps) for name in ("deepseek_v2", "llama") for ps in (1, 7)
]


@pytest.mark.parametrize("name, page_size", PAGED_CASES)
def test_paged_matches_full_forward_and_hf_cache(name, page_size, hf_ckpt, hf_model):
    path = hf_ckpt(name)
    model, hf = ll.load_model(path), hf_model(path)
    prompts = [random_tokens(n, seed=10 + i) for i, n in enumerate(PROMPTS)]
    conts = [random_tokens(STEPS, seed=20 + i) for i in range(len(PROMPTS))]
    state, got = run_paged(model, page_size, prompts, conts)
    for s, (p, c) in enumerate(zip(prompts, conts, strict=True)):
        full = np.asarray(model(np.concatenate([p, c])))[len(p) - 1 :]
        assert_logits_match(got[s], full)
        assert_logits_match(got[s], hf_incremental(hf, p, c))
        assert ll.tokens(state, s) == [*p.tolist(), *c.tolist()]


def test_chunked_prefill_equals_one_shot(np_ckpt):
    model = ll.load_model(np_ckpt("deepseek_v2"))
    prompt = random_tokens(301, seed=1)
    state = ll.init_state(
        model.config, num_pages=64, page_size=16, max_seqs=2, kv_dtype=jnp.float32
    )
    state, one = ll.prefill(model, state, 0, prompt)
    for a, b in [(0, 5), (5, 170), (170, 301)]:  # three uneven chunks
        state, chunked = ll.prefill(model, state, 1, prompt[a:b])
    assert rel_err(chunked, one) <= 1e-5  # same math; only the query block sizes differ
    assert int(np.asarray(chunked).argmax()) == int(np.asarray(one).argmax())
    # the cached latent itself agrees: the same slots of both sequences hold the same KV
    pt = np.asarray(state.page_table)
    for layer in range(model.config.num_hidden_layers):
        a = np.asarray(state.moved[layer])[pt[0, :19]].reshape(-1, 32)[:301]
        b = np.asarray(state.moved[layer])[pt[1, :19]].reshape(-1, 32)[:301]
        assert rel_err(a, b) <= 1e-5


def test_fork_shares_pages_and_diverges_safely(np_ckpt):
    model = ll.load_model(np_ckpt("glm4_moe_lite"))
    prompt = random_tokens(40, seed=2)  # 40 = 2 full pages of 16 + a partial third
    state = ll.init_state(
        model.config, num_pages=16, page_size=16, max_seqs=3, kv_dtype=jnp.float32
    )
    state, base = ll.prefill(model, state, 0, prompt)
    state = ll.fork(state, 0, 1)
    pt, rc = np.asarray(state.page_table), np.asarray(state.refcount)
    np.testing.assert_array_equal(pt[0, :3], pt[1, :3])
    assert (rc[pt[0, :3]] == 2).all() and rc.sum() == 6
    shared = np.asarray(state.moved)[:, pt[0, :3]].copy()

    # reference: what sequence 0 sees after these tokens, computed on an unshared pool of the
    # same shape (the same compiled step: a bit-exact comparison)
    ref_state = ll.init_state(
        model.config, num_pages=16, page_size=16, max_seqs=3, kv_dtype=jnp.float32
    )
    ref_state, _ = ll.prefill(model, ref_state, 0, prompt)
    ref_state, ref_a = ll.prefill(model, ref_state, 0, [7, 8, 9])

    state, b1 = ll.prefill(model, state, 1, [100, 101])  # the fork writes first: copy on write
    pt, rc = np.asarray(state.page_table), np.asarray(state.refcount)
    assert pt[1, 2] != pt[0, 2] and (rc[pt[0, :2]] == 2).all() and rc[pt[0, 2]] == 1
    state, a = ll.prefill(model, state, 0, [7, 8, 9])
    np.testing.assert_array_equal(np.asarray(a), np.asarray(ref_a))
    # the pages that were shared at fork time were never written
    np.testing.assert_array_equal(np.asarray(state.moved)[:, pt[0, :2]], shared[:, :2])
    state, d = ll.decode(model, state, [0, 1], [5, 6])
    full0 = np.asarray(model(np.concatenate([prompt, [7, 8, 9, 5]])))[-1]
    full1 = np.asarray(model(np.concatenate([prompt, [100, 101, 6]])))[-1]
    assert_logits_match(np.asarray(d), np.stack([full0, full1]))
    state = ll.free(state, 0)
    rc = np.asarray(state.refcount)
    assert (rc[pt[1, :2]] == 1).all() and rc.sum() == 3  # seq 1: 2 shared-then-own + its copy


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
def test_unused_pages_are_never_read(np_ckpt, kv_dtype):
    """Pages no sequence holds are poisoned with NaN: logits stay finite and unchanged (a bf16
    pool is stored as bits: the poison is NaN's bit pattern)."""
    model = ll.load_model(np_ckpt("deepseek_v3"))
    prompt = random_tokens(50, seed=3)

    def run(poison: bool):
        state = ll.init_state(
            model.config, num_pages=12, page_size=8, max_seqs=2, kv_dtype=kv_dtype
        )
        if poison:
            nan = {
                name: tuple(
                    kv_pools.to_storage(jnp.full(a.shape, jnp.nan), dt)
                    for a in getattr(state.pools, name)
                )
                for name, dt in (("moved", state.moved_dtype), ("rotated", state.rotated_dtype))
            }
            state = state.replace(pools=dataclasses.replace(state.pools, **nan))
        state, a = ll.prefill(model, state, 0, prompt)
        state, b = ll.decode(model, state, [0], [3])
        return np.asarray(a), np.asarray(b)

    clean, poisoned = run(False), run(True)
    for c, p in zip(clean, poisoned, strict=True):
        assert np.isfinite(p).all()
        np.testing.assert_array_equal(c, p)


# ---- bad input: clear errors, state untouched -----------------------------------------------
def _snapshot(state):
    return jax.tree.map(lambda x: np.asarray(x).copy(), state)


def _assert_same(state, snap):
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(snap), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_errors_leave_state_untouched(np_ckpt):
    model = ll.load_model(np_ckpt("deepseek_v2"))
    state = ll.init_state(
        model.config, num_pages=4, page_size=8, max_seqs=2, kv_dtype=jnp.float32, max_seq_len=40
    )
    state, _ = ll.prefill(model, state, 0, random_tokens(20))
    snap = _snapshot(state)
    cases = [
        (ll.OutOfPagesError, lambda: ll.prefill(model, state, 1, random_tokens(20))),
        (ll.SequenceError, lambda: ll.prefill(model, state, 0, random_tokens(21))),  # > 40
        (ll.SequenceError, lambda: ll.prefill(model, state, 2, [1])),
        (ll.SequenceError, lambda: ll.decode(model, state, [1], [1])),
        (ll.SequenceError, lambda: ll.decode(model, state, [0, 0], [1, 2])),
        (ValueError, lambda: ll.decode(model, state, [0], [256])),
        (ValueError, lambda: ll.decode(model, state, [0], [1, 2])),
        (ValueError, lambda: ll.prefill(model, state, 0, [-3])),
        (ll.SequenceError, lambda: ll.free(state, 1)),
        (ll.SequenceError, lambda: ll.fork(state, 0, 0)),
        (ll.SequenceError, lambda: ll.fork(state, 1, 0)),
        (ll.SequenceError, lambda: ll.tokens(state, 1)),
    ]
    for err, call in cases:
        with pytest.raises(err):
            call()
        _assert_same(state, snap)
    state, _ = ll.prefill(model, state, 0, [1, 2])  # and the state is still usable


def test_out_of_pages_message(np_ckpt):
    model = ll.load_model(np_ckpt("deepseek_v2"))
    state = ll.init_state(model.config, num_pages=2, page_size=4, max_seqs=2, max_seq_len=64)
    with pytest.raises(ll.OutOfPagesError, match="needs 3 pages; 2 of 2 are free"):
        ll.prefill(model, state, 0, random_tokens(9))


# ---- compilation --------------------------------------------------------------------------
def test_compiles_once_per_bucket(np_ckpt):
    """50 mixed prefill/decode calls of varying sizes compile no more than the buckets used."""
    model = ll.load_model(np_ckpt("glm4_moe_lite"))
    state = ll.init_state(
        model.config, num_pages=256, page_size=16, max_seqs=8, kv_dtype=jnp.float32
    )
    rng = np.random.default_rng(0)
    before = paged.compile_counts()
    prefill_keys, decode_keys = set(), set()
    open_seqs: dict[int, int] = {}
    for _ in range(50):
        if rng.random() < 0.4 or len(open_seqs) < 2:
            s = int(rng.integers(0, 8))
            n = int(rng.integers(1, 40))
            length = open_seqs.get(s, 0)
            if length + n > 500:
                continue
            prefill_keys.add(state.bucket(n, paged.MIN_TOKEN_BUCKET))
            state, _ = ll.prefill(model, state, s, random_tokens(n, seed=int(rng.integers(99))))
            open_seqs[s] = length + n
        else:
            batch = sorted(
                rng.choice(list(open_seqs), size=min(3, len(open_seqs)), replace=False).tolist()
            )
            decode_keys.add(state.bucket(len(batch), paged.MIN_TOKEN_BUCKET))
            state, _ = ll.decode(model, state, batch, [1] * len(batch))
            for s in batch:
                open_seqs[s] += 1
    after = paged.compile_counts()
    # one layer program per token bucket (the rows follow from it) and kind of layer, whatever
    # the sequences' lengths and however many layers
    kinds = len({graph for graph, _ in Split.of(model).layers})
    assert after["step"] - before["step"] <= kinds * len(prefill_keys | decode_keys)
    # and a repeat of an already-seen shape compiles nothing
    s = next(iter(open_seqs))
    n_before = paged.compile_counts()
    state, _ = ll.decode(model, state, [s], [2])
    state, _ = ll.decode(model, state, [s], [3])
    assert paged.compile_counts()["step"] - n_before["step"] <= kinds


def test_a_step_traces_each_kind_of_layer_once(tmp_path, monkeypatch):
    """One compiled program per kind of layer: a new step shape of a 6-layer model (deeper than
    `FUSED_LAYERS`: it runs layer by layer) traces its layer's attention once, not once per
    layer (what a step costs to trace and compile does not grow with depth). The count can
    fail: with every layer its own program, six traces."""
    from checkpoints.tiny import TINY_GQA_CONFIGS, write_random_checkpoint
    from leyline_jax import gqa
    from leyline_jax import model as models

    cfg = TINY_GQA_CONFIGS["llama"] | {"num_hidden_layers": 6, "hidden_size": 48}
    model = ll.load_model(write_random_checkpoint(tmp_path / "deep", cfg))
    traced, real = [], gqa.GQAAttention.paged
    monkeypatch.setattr(gqa.GQAAttention, "paged", lambda *a: traced.append(1) or real(*a))

    def traces(tokens: int) -> int:
        traced.clear()
        state = ll.init_state(model.config, num_pages=16, page_size=16, max_seqs=2)
        ll.prefill(model, state, 0, random_tokens(tokens))
        return len(traced)

    assert not Split.of(model).fused
    assert traces(3) == 1
    monkeypatch.setattr(models._Graph, "__eq__", lambda a, b: a is b)  # each layer its own
    monkeypatch.setattr(models._Graph, "__hash__", lambda a: id(a))
    monkeypatch.setattr(models.Split, "of", _one_graph_per_layer)
    assert traces(7) == 6


def test_one_program_and_layer_by_layer_agree(np_ckpt, monkeypatch):
    """A shallow model's step as one program and the same step layer by layer (what a deeper
    model runs) give the same logits and write the same KV: a prefill, a batched decode and
    the full forward. The tolerance can fail: logits of another token differ by far more."""
    from leyline_jax import model as models

    model = ll.load_model(np_ckpt("deepseek_v2"))  # a dense layer, then MoE layers: two kinds

    def run() -> tuple:
        state = ll.init_state(
            model.config, num_pages=16, page_size=4, max_seqs=2, kv_dtype=jnp.float32
        )
        state, a = ll.prefill(model, state, 0, random_tokens(11))
        state, _ = ll.prefill(model, state, 1, random_tokens(5, seed=3))
        state, b = ll.decode(model, state, [0, 1], [7, 8])
        pools = [np.asarray(x, np.float64) for x in (*state.pools.moved, *state.pools.rotated)]
        return [np.asarray(a), np.asarray(b), np.asarray(model(random_tokens(9)))], pools

    assert Split.of(model).fused
    one = run()
    monkeypatch.setattr(models, "FUSED_LAYERS", 0)
    assert not Split.of(model).fused
    by_layer = run()
    for x, y in zip(one[0] + one[1], by_layer[0] + by_layer[1], strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(one[0][0], by_layer[0][1][0], rtol=1e-5, atol=1e-5)


def _one_graph_per_layer(model):
    from leyline_jax import model as models

    def pair(module):
        return models._Graph.split(module, {})

    return models.Split(pair(models.Ends(model)), tuple(pair(x) for x in model.layers))


def test_buckets_are_powers_of_the_growth():
    """`bucket` is the smallest power of the growth at least n (and the minimum), capped at the
    maximum, against a plain enumeration; `ladder` is the set of buckets n in [1, top] takes.
    Every growth is checked, so one that ignored it (powers of two always) fails."""
    for growth in (2, 3, 4):
        powers = [growth**k for k in range(12)]
        for minimum, maximum in ((1, None), (3, 48), (16, 512), (1, 64)):
            for n in range(0, 600):
                want = min(p for p in powers if p >= max(n, minimum))
                want = want if maximum is None else min(want, maximum)
                assert kv.bucket(n, minimum, maximum, growth) == want, (n, minimum, growth)
            top = maximum or 100
            each = sorted({kv.bucket(n, minimum, top, growth) for n in range(1, top + 1)})
            assert kv.ladder(top, minimum, growth) == each
    assert kv.ladder(512, 16, 4) == [16, 64, 256, 512]


@pytest.mark.parametrize("growth", [0, 1, 2.0, "4", True, -4])
def test_a_bad_bucket_growth_is_refused(small_model, growth):
    """The ladder's growth is an integer of at least 2: anything else is refused by name."""
    from serve.engine import EngineConfig

    with pytest.raises(ValueError, match="bucket_growth"):
        ll.init_state(small_model.config, num_pages=4, page_size=4, max_seqs=1,
                      bucket_growth=growth)  # fmt: skip
    with pytest.raises(ValueError, match="bucket_growth"):
        EngineConfig(bucket_growth=growth)


def test_long_prefill_runs_in_chunks(np_ckpt):
    """Prompts longer than the state's max_step_tokens go through several steps of at most
    that many tokens (no shape outside `step_shapes`); same logits."""
    model = ll.load_model(np_ckpt("glm4_moe_lite"))
    tokens = random_tokens(3 * 48 + 30, seed=9)
    state = ll.init_state(
        model.config,
        num_pages=100,
        page_size=16,
        max_seqs=1,
        kv_dtype=jnp.float32,
        max_step_tokens=48,
        bucket_growth=2,
    )
    assert [t for t, _ in paged.step_shapes(state)] == [1, 2, 4, 8, 16, 32, 48]
    before = paged.compile_counts()["step"]
    state, logits = ll.prefill(model, state, 0, tokens)
    assert_logits_match(np.asarray(logits), np.asarray(model(tokens))[-1])
    assert ll.tokens(state, 0) == tokens.tolist()
    assert paged.compile_counts()["step"] - before <= 2  # 48 and 32 tokens (bucket(30) = 32)
    with pytest.raises(ValueError, match="49 tokens in one step; the state's max_step_tokens"):
        paged.extend(model, state, [0], [list(range(49))])


def test_bookkeeping_needs_no_device(np_ckpt):
    """Every host operation and check works with the device pools deleted: the page table,
    lengths, token ids and refcounts are host data, and nothing but a device step reads the
    pools (a deleted array raises on any read)."""
    model = ll.load_model(np_ckpt("deepseek_v3"))
    state = ll.init_state(model.config, num_pages=16, page_size=4, max_seqs=4)
    state, _ = ll.prefill(model, state, 0, random_tokens(9))
    for leaf in jax.tree.leaves(state.pools):
        leaf.delete()
    state = ll.fork(state, 0, 1)
    state = allocator.retain(state, [int(state.page_table[0, 0])])
    state = allocator.adopt(state, 2, [int(state.page_table[0, 0])], random_tokens(9)[:4].tolist())
    state = allocator.release(state, [int(state.page_table[0, 0])])
    state = ll.free(state, 1)
    assert ll.tokens(state, 0) == random_tokens(9).tolist()
    with pytest.raises(ll.OutOfPagesError):
        ll.prefill(model, state, 3, random_tokens(60))
    with pytest.raises(ll.SequenceError):
        ll.decode(model, state, [1], [1])
    with pytest.raises(ll.DirectiveError):
        ll.apply_directive(model, state, 0, ll.Directive(3, 99))
    with pytest.raises(RuntimeError, match="deleted"):  # a device step does read the pools
        ll.decode(model, state, [0], [1])


def _unaliased_bytes(compiled) -> tuple[int, int]:
    """XLA's own accounting of a compiled program (no timing): temporary bytes, and output bytes
    not written in place over a donated input."""
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes, m.output_size_in_bytes - m.alias_size_in_bytes


def _step_bytes(model, num_pages: int, tokens: int, fused: bool) -> tuple[int, int]:
    """`_unaliased_bytes` of the ragged step for one row of `tokens` new tokens on a pool of
    `num_pages` pages: the whole step as one program (`fused`), or one layer's program."""
    state = ll.init_state(model.config, num_pages=num_pages, page_size=16, max_seqs=2)
    block = np.ones(tokens, np.int32)
    state, plan = allocator.append(allocator.open_seq(state, 0), [0], [block])
    rows = dataclasses.asdict(paged._rows(state, [0], [block], [0], plan.slots))
    meta = tuple(rows[k] for k in ("kv_lens", "page_indices", "cu_q_lens", "num_rows"))
    args = [rows[k] for k in ("cow_src", "cow_dst", "positions", "slots")]
    graph = Split.of(model)
    if fused:
        args = [*args[:2], rows["tokens"], *args[2:], meta, rows["last"]]
        return _unaliased_bytes(paged._whole_step.lower(*graph.whole, state.pools, *args).compile())
    h = jnp.zeros((len(rows["tokens"]), model.config.hidden_size), model.dtype)
    lowered = paged.layer_step.lower(*graph.layers[-1], state.pools.layer(0), h, *args, meta)
    return _unaliased_bytes(lowered.compile())


def _splice_bytes(model, num_pages: int) -> tuple[int, int]:
    """`_unaliased_bytes` of the splice step (move + rotate of 64 slots) on `num_pages` pages."""
    from leyline_jax import splice
    from pallas_kernels.splice_rotate import Runs

    state = ll.init_state(model.config, num_pages=num_pages, page_size=16, max_seqs=2)
    idx = jnp.arange(64, dtype=jnp.int32)
    inv, table = splice.rotation_tables(model.config, 256)
    runs = Runs(idx, idx + 64, jnp.ones_like(idx), idx, idx + 1)
    lowered = splice.splice_layer.lower(state.pools.layer(0), runs, inv, table, impl=None)
    return _unaliased_bytes(lowered.compile())


@pytest.mark.parametrize("tokens", [1, 40])  # a decode row; a prefill chunk
def test_a_step_never_copies_a_pool(np_ckpt, monkeypatch, tokens):
    """Every layer's pages are their own arrays, written and read in place: the ragged step's and
    the splice step's temporary memory and unaliased outputs are the same for a pool of 64 pages
    as for 4096 (when attention sliced one layer out of stacked pools, or read a flattened view
    of a pool the step writes, XLA kept a copy of a layer's pool and the step's cost grew with
    the pool; the flattened view showed only in the decode row's program, 2.4 MB against 38 MB).
    The same measure on a step whose attention is handed a copy of its layer's pages grows with
    the pool: it can fail."""
    model = ll.load_model(np_ckpt("deepseek_v3"))
    for fused in (True, False):  # a shallow model's one program; a deep model's layer program
        assert _step_bytes(model, 64, tokens, fused) == _step_bytes(model, 4096, tokens, fused)
    assert _splice_bytes(model, 64) == _splice_bytes(model, 4096)
    from leyline_jax import mla

    def on_a_copy(attend, at):  # `attend` handed a flipped copy of the pages (argument `at`)
        def attend_on_a_copy(*args, **kw):
            args = list(args)
            args[at] = jnp.flip(args[at], 0)
            return attend(*args, **kw)

        return attend_on_a_copy

    paged.layer_step.clear_cache()  # no trace of the real attention may serve the patched lowering
    # both forms' entry points: a 40-token step (bucket 64) is traced through ref_ragged_paged_mla
    monkeypatch.setattr(mla, "ragged_paged_attention", on_a_copy(mla.ragged_paged_attention, 2))
    monkeypatch.setattr(mla, "ref_ragged_paged_mla", on_a_copy(mla.ref_ragged_paged_mla, 3))
    try:
        small, _ = _step_bytes(model, 64, tokens, False)
        big, _ = _step_bytes(model, 4096, tokens, False)
    finally:
        paged.layer_step.clear_cache()  # nor the patched trace any later call
    assert big - small >= 4000 * 16 * model.config.kv_lora_rank * 2  # a bf16 layer pool, at least
