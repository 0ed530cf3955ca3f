"""`Engine.cancel`: a turn cancelled where it stands (failed with `TurnCancelled`) and a turn
its caller's stop condition ended (`stop=True`: finished with its output so far); the session
consistent after either, its next turn reusing what the cut turn cached."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import leyline_jax as ll
from checkpoints.tiny import ensure_default_checkpoints
from serve.engine import Engine, SamplingParams, Status, TurnCancelled


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = ensure_default_checkpoints(tmp_path_factory.mktemp("ckpt"))["deepseek_v3"]
    return Engine(ll.load_model(path), num_pages=64, page_size=8, max_seqs=2,
                  kv_dtype=jnp.float32)  # fmt: skip


def decode_until(engine, request, n):
    while len(request.output) < n:
        engine.step()


@pytest.mark.parametrize("stop", [False, True])
def test_a_decoding_turn_cut_where_it_stands(engine, stop):
    before = dict(engine.counters)
    sid = engine.open_session()
    prompt = np.random.default_rng(int(stop)).integers(0, 256, 21).tolist()
    r = engine.submit(sid, prompt, sampling=SamplingParams(max_new_tokens=12))
    decode_until(engine, r, 3)
    assert engine.cancel(r, stop=stop) and not engine.cancel(r, stop=stop)
    if stop:
        assert r.status is Status.DONE and r.error is None and r.result() == r.output
    else:
        assert r.status is Status.FAILED and isinstance(r.error, TurnCancelled)
    assert len(r.output) == 3 and r.stats.latency_s is not None
    key, other = ("stopped_turns", "cancelled_turns")[:: 1 if stop else -1]
    assert engine.counters[key] - before.get(key, 0) == 1
    assert engine.counters[other] == before.get(other, 0)
    # the session holds the prompt and the three tokens; the next turn extends it
    assert engine.sessions[sid].tokens == prompt + r.output
    nxt = engine.submit(sid, [5, 6], sampling=SamplingParams(max_new_tokens=2))
    nxt.result()
    assert nxt.stats.prompt_tokens == len(prompt) + 3 + 2
    assert nxt.stats.reused_tokens >= len(prompt) + 2  # the cut turn's KV (its last token fed now)
    engine.close_session(sid)


def test_a_stop_before_any_token_is_a_cancel(engine):
    sid = engine.open_session()
    r = engine.submit(sid, [1, 2, 3], sampling=SamplingParams(max_new_tokens=4))
    assert r.status is Status.QUEUED and engine.cancel(r, stop=True)
    assert r.status is Status.FAILED and isinstance(r.error, TurnCancelled)
    engine.close_session(sid)
