"""Log-probabilities against Hugging Face PyTorch: each generated token's log-probability and
its k alternatives (`SamplingParams.logprobs`; the HTTP `logprobs` fields) are the log-softmax
of the transformers model's logits (float64) at that token's position — in the engine (a GQA
model; greedy and sampled turns) and over HTTP through the official `openai` client (the MLA
default model; chat and completions, whole and streamed). Bad values are 400s naming the
field."""

from __future__ import annotations

import numpy as np
import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from test_parity import hf_logits  # noqa: E402

import leyline_jax as ll  # noqa: E402
from serve.engine import Engine, SamplingParams  # noqa: E402

ATOL = 1e-4  # fp32 model and KV against the float64 reference


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference(hf, prompt, output) -> np.ndarray:
    """The reference's log-probabilities of each output token's position, f64[len(output), V]."""
    lp = log_softmax(hf_logits(hf, [*prompt, *output]))
    return lp[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def check(entries, output, ref, k):
    assert len(entries) == len(output) == len(ref)
    for (lp, top), t, row in zip(entries, output, ref, strict=True):
        assert abs(lp - row[t]) < ATOL, (lp, row[t])
        ids, lps = [i for i, _ in top], np.array([q for _, q in top])
        assert ids == list(np.argsort(-row, kind="stable")[:k])
        np.testing.assert_allclose(lps, row[ids], atol=ATOL)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_logprobs_are_the_models(hf_ckpt, hf_model, temperature):
    path = hf_ckpt("llama")
    engine = Engine(ll.load_model(path, dtype=jnp.float32), num_pages=32, page_size=16,
                    max_seqs=2, kv_dtype=jnp.float32)  # fmt: skip
    prompt = list(range(3, 40))
    s = engine.open_session()
    sp = SamplingParams(max_new_tokens=6, temperature=temperature, seed=7, logprobs=4)
    r = engine.submit(s, prompt, sampling=sp)
    out = r.result()
    ref = reference(hf_model(path), prompt, out)
    check(r.logprobs, out, ref, 4)
    if temperature:  # a drawn token's own log-probability, not the most likely one's
        assert any(t != row.argmax() for t, row in zip(out, ref, strict=True)), out
    # the check fails where the positions are off by one
    with pytest.raises(AssertionError):
        check(r.logprobs[1:], out[1:], ref[:-1], 4)
    # a turn that does not ask gets none, and the same tokens
    r2 = engine.submit(engine.open_session(), prompt, sampling=SamplingParams(
        max_new_tokens=6, temperature=temperature, seed=7))  # fmt: skip
    assert r2.result() == out and r2.logprobs == []


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)


IDS = {"leyline": {"return_token_ids": True}}


def test_chat_logprobs_whole_and_streamed(client, tiny_server, hf_model):
    msgs = [{"role": "user", "content": "Name three rivers."}]
    kw = dict(model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True)
    r = client.chat.completions.create(**kw, top_logprobs=3, extra_body=IDS)
    ids = r.model_extra["leyline"]
    content = r.choices[0].logprobs.content
    entries = [(c.logprob, [(None, t.logprob) for t in c.top_logprobs]) for c in content]
    ref = reference(hf_model(tiny_server.checkpoint), ids["prompt_token_ids"],
                    ids["output_token_ids"])  # fmt: skip
    assert len(content) == r.usage.completion_tokens == len(ref)
    for c, t, row in zip(content, ids["output_token_ids"], ref, strict=True):
        assert abs(c.logprob - row[t]) < ATOL
        np.testing.assert_allclose([x.logprob for x in c.top_logprobs], np.sort(row)[::-1][:3],
                                   atol=ATOL)  # fmt: skip
        assert c.bytes == list(c.token.encode())
    assert entries[0][0] == pytest.approx(max(q for _, q in entries[0][1]))  # greedy: the top
    streamed = [
        x.logprob
        for chunk in client.chat.completions.create(**kw, top_logprobs=3, stream=True)
        if chunk.choices and chunk.choices[0].logprobs is not None
        for x in chunk.choices[0].logprobs.content
    ]
    assert streamed == [c.logprob for c in content]
    none = client.chat.completions.create(**{**kw, "logprobs": False})
    assert none.choices[0].logprobs is None
    zero = client.chat.completions.create(**kw)  # logprobs without alternatives
    assert [c.top_logprobs for c in zero.choices[0].logprobs.content] == [[]] * len(content)


def test_completion_logprobs_whole_and_streamed(client, tiny_server, hf_model):
    kw = dict(model="tiny", prompt="The river", max_tokens=5, temperature=0, logprobs=2)
    r = client.completions.create(**kw, extra_body=IDS)
    ids = r.model_extra["leyline"]
    lp = r.choices[0].logprobs
    ref = reference(hf_model(tiny_server.checkpoint), ids["prompt_token_ids"],
                    ids["output_token_ids"])  # fmt: skip
    want = [row[t] for t, row in zip(ids["output_token_ids"], ref, strict=True)]
    np.testing.assert_allclose(lp.token_logprobs, want, atol=ATOL)
    assert [len(t) for t in lp.top_logprobs] == [len(set(t)) for t in lp.top_logprobs]
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens])[:-1])
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True)
              if c.choices and c.choices[0].logprobs is not None]  # fmt: skip
    assert sum((c.token_logprobs for c in chunks), []) == lp.token_logprobs
    assert sum((c.text_offset for c in chunks), []) == lp.text_offset


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": 1}, "logprobs"),  # a boolean, not coerced
        ("completions", {"logprobs": True}, "logprobs"),  # an integer
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_logprobs_are_named(client, route, body, field):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            msgs = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,
                                           extra_body=body)  # fmt: skip
        else:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == field, e.value.body


def test_responses_logprobs_whole_and_streamed(client, tiny_server, hf_model):
    kw = dict(model="tiny", input="Name a river.", max_output_tokens=5, temperature=0)
    asked = dict(include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**kw, **asked, extra_body=IDS)
    ids = r.model_extra["leyline"]
    lps = r.output[0].content[0].logprobs
    ref = reference(hf_model(tiny_server.checkpoint), ids["prompt_token_ids"],
                    ids["output_token_ids"])  # fmt: skip
    want = [row[t] for t, row in zip(ids["output_token_ids"], ref, strict=True)]
    np.testing.assert_allclose([x.logprob for x in lps], want, atol=ATOL)
    assert [len(x.top_logprobs) for x in lps] == [2] * len(want)
    deltas = [x.logprob for ev in client.responses.create(**kw, **asked, stream=True)
              if ev.type == "response.output_text.delta" for x in ev.logprobs or []]  # fmt: skip
    assert deltas == [x.logprob for x in lps]
    assert client.responses.create(**kw).output[0].content[0].logprobs in (None, [])
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw, **asked | {"top_logprobs": 21})
    assert e.value.body["param"] == "top_logprobs"
