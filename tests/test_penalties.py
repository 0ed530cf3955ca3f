"""Presence, frequency and repetition penalties (`SamplingParams`; the HTTP fields) against a
plain reference: greedy decoding over Hugging Face PyTorch's logits (float64) with OpenAI's
and vLLM's rules applied in numpy — a token's logit divided by the repetition penalty where
positive and multiplied where negative if the token is in the prompt or the output so far, then
minus frequency x its count and presence x (count > 0) in the output. The engine (a GQA model)
and the server (the MLA default model, through the official `openai` client) pick the same
tokens; each case's penalties change what is picked (the reference without them differs)."""

from __future__ import annotations

import numpy as np
import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from test_parity import hf_logits  # noqa: E402

import leyline_jax as ll  # noqa: E402
from serve.engine import Engine, SamplingParams  # noqa: E402


def greedy(hf, prompt, n, presence=0.0, frequency=0.0, repetition=1.0) -> list[int]:
    """`n` tokens decoded greedily with the penalties applied to the reference's logits."""
    seq, out = list(prompt), []
    for _ in range(n):
        lg = hf_logits(hf, seq)[-1].copy()
        counts = np.bincount(out, minlength=lg.size)[: lg.size]
        seen = np.zeros(lg.size, bool)
        seen[seq] = True
        lg[seen] = np.where(lg[seen] > 0, lg[seen] / repetition, lg[seen] * repetition)
        lg -= frequency * counts + presence * (counts > 0)
        t = int(lg.argmax())
        seq.append(t)
        out.append(t)
    return out


CASES = [
    dict(presence_penalty=2.0),
    dict(frequency_penalty=2.0),
    dict(repetition_penalty=2.0),
    dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=0.8),
]


def ref_kwargs(case: dict) -> dict:
    return dict(presence=case.get("presence_penalty", 0.0),
                frequency=case.get("frequency_penalty", 0.0),
                repetition=case.get("repetition_penalty", 1.0))  # fmt: skip


def test_engine_penalties_pick_the_references_tokens(hf_ckpt, hf_model):
    path = hf_ckpt("llama")
    hf = hf_model(path)
    engine = Engine(ll.load_model(path, dtype=jnp.float32), num_pages=32, page_size=16,
                    max_seqs=2, kv_dtype=jnp.float32)  # fmt: skip
    prompt = [5, 9, 5, 9, 5, 9, 11, 5, 9, 5, 13]
    plain = greedy(hf, prompt, 8)
    for case in CASES:
        want = greedy(hf, prompt, 8, **ref_kwargs(case))
        assert want != plain, case  # the penalties matter here: the comparison can fail
        r = engine.submit(engine.open_session(), prompt,
                          sampling=SamplingParams(max_new_tokens=8, **case))  # fmt: skip
        assert r.result() == want, case
    r = engine.submit(engine.open_session(), prompt, sampling=SamplingParams(max_new_tokens=8))
    assert r.result() == plain


@pytest.mark.parametrize("case", CASES[:2])
def test_http_penalties_pick_the_references_tokens(tiny_server, hf_model, case):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    ids = {"leyline": {"return_token_ids": True}}
    r = client.completions.create(model="tiny", prompt="the the the the", max_tokens=6,
                                  temperature=0, extra_body=ids | case)  # fmt: skip
    got = r.model_extra["leyline"]
    hf = hf_model(tiny_server.checkpoint)
    prompt = got["prompt_token_ids"]
    want = greedy(hf, prompt, len(got["output_token_ids"]), **ref_kwargs(case))
    assert got["output_token_ids"] == want
    assert want != greedy(hf, prompt, len(want))


@pytest.mark.parametrize(
    "body, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": "1"}, "presence_penalty"),  # a number, not coerced
    ],
)
def test_bad_penalties_are_named(tiny_server, body, field):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=body)
    assert e.value.body["param"] == field, e.value.body
