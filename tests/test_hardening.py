"""Bad inputs fail alone, with the documented error, before anything changes (issue 17's
defects, one test each; every one failed on the code before the fix).

Engine references: the session's token list as a plain list (what the directives say the
conversation is) and a fresh session given the same final prompt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_CONFIGS

import leyline_jax as ll
from leyline_jax import allocator, paged
from leyline_jax.directives import Directive, Mode
from serve.engine import Engine, RequestError, SamplingParams

PS = 16


@pytest.fixture(scope="module")
def model(np_ckpt):
    return ll.load_model(np_ckpt("deepseek_v3"))


def make_engine(model, **kw):
    return Engine(model, **{**dict(num_pages=64, page_size=PS, max_seqs=4), **kw})


def session_of(engine, n=20):
    """A session holding `n` prompt tokens and one generated token."""
    s = engine.open_session()
    engine.submit(s, list(range(1, n + 1)), sampling=SamplingParams(1)).result()
    return s


def state_leaves(state):
    return [np.asarray(x).copy() for x in jax.tree.leaves(state)]


def assert_same_state(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


# ---- 1. an edit the engine would turn into delete-everything ---------------------------------
@pytest.mark.parametrize(
    "how",
    ["leave_one", "disjoint_prompt", "delete_all_then_append", "leave_one_forget"],
)
def test_edits_that_empty_the_cache_do_not_wedge_the_session(model, how):
    engine = make_engine(model)
    s = session_of(engine)
    old = list(engine.sessions[s].tokens)
    n = len(old)
    if how == "leave_one":
        r = engine.submit(s, [], directives=[Directive(0, n - 1)], sampling=SamplingParams(2))
        want = old[-1:]
    elif how == "leave_one_forget":
        r = engine.submit(
            s, [], directives=[Directive(0, n - 1, (), Mode.FORGET)], sampling=SamplingParams(2)
        )
        want = old[-1:]
    elif how == "disjoint_prompt":
        want = [200 + i for i in range(9)]
        r = engine.submit_prompt(s, want, sampling=SamplingParams(2))
    else:
        r = engine.submit(s, [9, 9], directives=[Directive(0, n)], sampling=SamplingParams(2))
        want = [9, 9]
    out = r.result()
    assert engine.sessions[s].tokens == want + out
    # the output is what a fresh session given the same prompt decodes (nothing was kept)
    fresh = make_engine(model)
    assert fresh.submit(fresh.open_session(), want, sampling=SamplingParams(2)).result() == out
    # the session stays usable and closable
    engine.submit(s, [5], sampling=SamplingParams(1)).result()
    engine.close_session(s)
    assert engine.idle()


# ---- 2. sampling parameters are checked when made --------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        dict(seed=-1),
        dict(seed=2**32),
        dict(seed=1.5),
        dict(stop_tokens=None),
        dict(stop_tokens=5),
        dict(stop_tokens="5"),
        dict(stop_tokens=(1, True)),
        dict(stop_tokens=(-3,)),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(temperature="1"),
        dict(temperature=-0.5),
        dict(top_p=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(max_new_tokens=2.5),
        dict(max_new_tokens=True),
        dict(max_new_tokens=0),
    ],
)
def test_bad_sampling_params_are_refused(kw):
    field = next(iter(kw))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_accept_what_they_document():
    sp = SamplingParams(max_new_tokens=3, temperature=1, top_p=0.5, stop_tokens=[4, 5], seed=7)
    assert sp.stop_tokens == (4, 5) and sp.temperature == 1.0
    SamplingParams(seed=2**32 - 1, stop_tokens=np.array([1, 2]))


def test_submit_refuses_what_is_not_sampling_params_or_out_of_vocab_stops(model):
    engine = make_engine(model)
    s = engine.open_session()
    with pytest.raises(ValueError, match="sampling"):
        engine.submit(s, [1], sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="stop"):
        engine.submit(s, [1], sampling=SamplingParams(stop_tokens=(10**6,)))
    assert not engine.table.turns(engine.sessions[s])


# ---- 3. an edits-only turn applies its directives as given -----------------------------------
def test_edits_only_turn_keeps_each_directives_mode(model):
    """A FORGET beside an AMORTIZE edit in an edits-only turn stays a FORGET: the radix path
    from its start is purged (a new session with the original tokens reuses nothing past the
    FORGET's page) and no edit is merged or rewritten (the AMORTIZE deletion is spliced)."""
    engine = make_engine(model)
    s = engine.open_session()
    first = list(range(1, 61))
    engine.submit(s, first, sampling=SamplingParams(1)).result()
    old = list(engine.sessions[s].tokens)
    r = engine.submit(
        s,
        [],
        directives=[Directive(2, 4), Directive(40, 44, (), Mode.FORGET)],
        sampling=SamplingParams(1),
    )
    r.result()
    want = old[:2] + old[4:40] + old[44:]
    assert engine.sessions[s].tokens[: len(want)] == want
    st = r.stats
    # kept tokens 4..40 were moved, not re-prefilled; the FORGET re-prefilled old[44:]
    assert st.reused_tokens == 2
    assert st.spliced_tokens == 36
    assert st.prefilled_tokens == len(old) - 44
    # the purge: a session sending the original prompt reuses at most the pages before 40
    other = engine.submit(engine.open_session(), first, sampling=SamplingParams(1))
    other.result()
    assert other.stats.reused_tokens <= 40 // PS * PS


# ---- 4. max_seq_len is exact ----------------------------------------------------------------
def test_max_seq_len_is_not_rounded_to_pages(model):
    state = ll.init_state(model.config, num_pages=8, page_size=16, max_seqs=2, max_seq_len=20)
    assert state.max_seq_len == 20
    with pytest.raises(ll.SequenceError, match="max_seq_len=20"):
        ll.prefill(model, state, 0, list(range(30)))
    state, _ = ll.prefill(model, state, 0, list(range(20)))
    with pytest.raises(ll.SequenceError):
        ll.decode(model, state, [0], [1])


def test_engine_max_seq_len_bounds_a_session(model):
    engine = make_engine(model, max_seq_len=100)
    s = engine.open_session()
    r = engine.submit(s, list(range(96)), sampling=SamplingParams(9))
    with pytest.raises(RequestError, match="max_seq_len=100"):
        r.result()
    ok = engine.submit(s, list(range(96)), sampling=SamplingParams(4))
    ok.result()
    assert len(engine.sessions[s].tokens) == 100


def test_default_max_seq_len_respects_the_model(model):
    pos = model.config.max_position_embeddings
    state = ll.init_state(model.config, num_pages=pos, page_size=3, max_seqs=1)
    assert state.max_seq_len == pos
    for bad in (0, -1, 2.5, True, "64"):
        with pytest.raises(ValueError, match="max_seq_len"):
            ll.init_state(model.config, num_pages=8, page_size=16, max_seqs=1, max_seq_len=bad)


# ---- 5. malformed configs and indexes --------------------------------------------------------
@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda c: [c], "JSON object"),
        (lambda c: {**c, "rope_scaling": "yarn"}, "rope_scaling"),
        (lambda c: {**c, "rope_parameters": "yarn"}, "rope_parameters"),
        (lambda c: {**c, "vocab_size": "abc"}, "vocab_size"),
        (lambda c: {**c, "vocab_size": 256.7}, "vocab_size"),
        (lambda c: {**c, "vocab_size": 0}, "vocab_size"),
        (lambda c: {**c, "hidden_size": True}, "hidden_size"),
        (lambda c: {**c, "rope_theta": -1}, "rope_theta"),
        (lambda c: {**c, "rope_theta": "big"}, "rope_theta"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "rope_theta": 0}}, "theta"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "factor": "8"}}, "factor"),
        (lambda c: {**c, "rms_norm_eps": float("nan")}, "rms_norm_eps"),
        (lambda c: {**c, "max_position_embeddings": 0}, "max_position_embeddings"),
    ],
)
def test_malformed_config_names_the_field(tmp_path, change, needle):
    cfg = change(dict(ALL_CONFIGS["deepseek_v3"]))
    with pytest.raises(ll.ConfigError, match=needle):
        ll.MLAConfig.from_hf(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ll.ConfigError, match=needle):
        ll.MLAConfig.from_hf(tmp_path)


@pytest.mark.parametrize(
    "index",
    [
        {"weight_map": ["a", "b"]},
        {"weight_map": {"model.embed_tokens.weight": 3}},
        {"weight_map": {"model.embed_tokens.weight": None}},
        {"weight_map": "x"},
        [1, 2],
    ],
)
def test_malformed_index_is_a_checkpoint_error(tmp_path, np_ckpt, index):
    dst = tmp_path / "ckpt"
    shutil.copytree(np_ckpt("deepseek_v3"), dst)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ll.CheckpointError, match="index"):
        ll.load_model(dst)


# ---- 6. inputs are checked, not coerced ------------------------------------------------------
def test_sequence_ids_are_not_coerced(model):
    state = ll.init_state(model.config, num_pages=8, page_size=16, max_seqs=2)
    state, _ = ll.prefill(model, state, 0, [1, 2, 3])
    before = state_leaves(state)
    for bad in (0.9, "0", True, np.float32(0)):
        with pytest.raises(ll.SequenceError):
            paged.extend(model, state, [bad], [[1]])
        with pytest.raises(ll.SequenceError):
            ll.decode(model, state, [bad], [1])
    assert_same_state(before, state_leaves(state))


def test_engine_refuses_non_integer_tokens(model):
    engine = make_engine(model)
    s = engine.open_session()
    for bad in ([3.7], [True], ["5"], [3.7, True, "5"], [2**70], "abc", [[1, 2]]):
        with pytest.raises(ValueError, match="token"):
            engine.submit(s, bad)
        with pytest.raises(ValueError, match="token"):
            engine.submit_prompt(s, bad)
    assert not engine.table.turns(engine.sessions[s])
    for bad_session in (True, 0.0, "0", 99):
        with pytest.raises(KeyError):
            engine.submit(bad_session, [1])
    with pytest.raises(ValueError, match="Directive"):
        engine.submit(s, [1], directives=[(0, 1)])
    with pytest.raises(ValueError, match="mode"):
        engine.submit_prompt(s, [1], mode="forget")


def test_adopt_and_init_check_their_inputs(model):
    state = ll.init_state(model.config, num_pages=8, page_size=4, max_seqs=2)
    state, _ = ll.prefill(model, state, 0, [1, 2, 3, 4, 5])
    page = int(np.asarray(state.page_table)[0, 0])
    state = allocator.retain(state, [page])
    before = state_leaves(state)
    with pytest.raises(ValueError, match="token"):
        allocator.adopt(state, 1, [page], [1, 2, 3, model.config.vocab_size])
    with pytest.raises(ValueError, match="token"):
        allocator.adopt(state, 1, [page], [1, 2, 3, -1])
    assert_same_state(before, state_leaves(state))
    state = allocator.adopt(state, 1, [page], [1, 2, 3, 4])
    assert ll.tokens(state, 1) == [1, 2, 3, 4]


# ---- 7. release only drops references taken with retain --------------------------------------
def test_release_of_a_page_only_a_sequence_holds_is_refused(model):
    state = ll.init_state(model.config, num_pages=8, page_size=4, max_seqs=2)
    state, _ = ll.prefill(model, state, 0, [1, 2, 3, 4, 5])
    page = int(np.asarray(state.page_table)[0, 0])
    before = state_leaves(state)
    with pytest.raises(ValueError, match="retain"):
        allocator.release(state, [page])
    assert_same_state(before, state_leaves(state))
    state = allocator.retain(state, [page])
    state = allocator.release(state, [page])  # the retained reference goes back
    with pytest.raises(ValueError, match="retain"):
        allocator.release(state, [page])
    state = allocator.free(state, 0)
    assert int(np.asarray(state.refcount).min()) == 0


# ---- 8. the README's decode snippet runs as written ------------------------------------------
def test_readme_paged_snippet_runs(model):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("### The paged KV state", 1)[1].split("```python", 1)[1].split("```")[0]
    namespace = {"ll": ll, "jnp": jnp, "model": model}
    code = block.replace("[...]", "[1, 2, 3]").replace("t0, t1", "4, 5")
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["state"] is not None


# ---- found by the engine fuzzer ---------------------------------------------------------------
def test_a_splice_that_can_never_fit_beside_its_own_pages_fails_alone(model):
    """An AMORTIZE splice fills fresh pages while the session still holds its old ones: a
    session holding half the pool cannot splice its whole length. The turn fails alone (it
    waited forever: the only pages to free were the session's own) and the session stays
    usable."""
    engine = Engine(model, num_pages=24, page_size=8, max_seqs=3, max_seq_len=96)
    s = engine.open_session()
    engine.submit(s, list(range(1, 91)), sampling=SamplingParams(1)).result()  # 12 pages
    r = engine.submit(s, [], directives=[Directive(0, 1)], sampling=SamplingParams(3))
    engine.run_until_idle(max_steps=50)
    with pytest.raises(RequestError, match="pages"):
        r.result()
    assert len(engine.sessions[s].tokens) == 91
    # the same edit as a FORGET cuts before it takes: it fits
    f = engine.submit(
        s, [], directives=[Directive(0, 1, (), Mode.FORGET)], sampling=SamplingParams(1)
    )
    f.result()
    assert engine.sessions[s].tokens[:89] == list(range(2, 91))


def _run_or_wedge(engine, req, steps=300):
    """Step the engine until `req` finishes; fail (rather than loop forever) if it never does."""
    for _ in range(steps):
        if req.finished:
            break
        engine.step()
    assert req.finished, "the turn is wedged: admitted as fitting, never given its pages"
    assert req.error is None, req.error


def test_a_cut_and_splice_turn_that_fits_is_admitted(model):
    """Admission counts what a turn's cut frees before it takes: a session holding 10 of 16
    pages (its clean pages shared with the radix tree) splices before a FORGET that drops 8 of
    them; the turn needs 11 pages beside the 2 it keeps and must run, not wait for ever."""
    engine = make_engine(model, num_pages=16, max_seqs=1)
    s = engine.open_session()
    engine.submit(s, list(range(1, 151)), sampling=SamplingParams(10)).result()
    assert engine.sessions[s].cached == 159
    ds = [Directive(10, 12, (7,)), Directive(20, 30, (), Mode.FORGET)]
    r = engine.submit(s, [1, 2], directives=ds, sampling=SamplingParams(2))
    _run_or_wedge(engine, r)
    st = r.stats
    assert st.reused_tokens + st.spliced_tokens + st.prefilled_tokens == st.prompt_tokens


def test_a_turn_keeping_a_partial_page_counts_it_held(model):
    """A session holding 5 tokens (one partial page of 8) in a 4-page pool asks for a turn
    ending at 24 tokens: 3 pages in all, 2 beyond its own. It fits and must run."""
    engine = Engine(model, num_pages=4, page_size=8, max_seqs=1)
    s = engine.open_session()
    engine.submit(s, [1, 2, 3, 4, 5], sampling=SamplingParams(1)).result()
    r = engine.submit(s, list(range(10, 26)), sampling=SamplingParams(2))
    _run_or_wedge(engine, r)
