"""Log-probabilities in OpenAI's two shapes, from the engine's entries (`Request.logprobs`: per
generated token, its log-probability and the k most likely tokens', from the model's own
distribution: `serve.sampling.token_logprobs`).

- Chat (`logprobs: true`, `top_logprobs: k`): `logprobs.content`, one object per token: its
  text, `logprob`, its UTF-8 `bytes` and `top_logprobs` (k objects of the same three fields).
- Completions (`logprobs: k`): `tokens`, `token_logprobs`, `top_logprobs` (a token's text to
  its log-probability, k of them) and `text_offset` (where each token's text starts in the
  completion's text).

One entry per generated token, as `leyline.output_token_ids` counts them (a stop string that
cuts the text does not cut the entries; an end-of-turn token has one). A token's text is its
own decoding: one that ends inside a multi-byte character decodes to U+FFFD. A log-probability
below -9999 (-inf) is written as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(float(x), FLOOR)


def chat_content(tok, ids, entries) -> list[dict]:
    """Chat's `logprobs.content` for generated tokens `ids` and their entries."""

    def one(i: int, lp: float) -> dict:
        text = tok.decode([i])
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}

    return [
        dict(one(i, lp), top_logprobs=[one(j, lq) for j, lq in top])
        for i, (lp, top) in zip(ids, entries, strict=True)
    ]


def completion(tok, ids, entries, offset: int = 0) -> dict:
    """A completion choice's `logprobs` for generated tokens `ids` and their entries, the
    first token's text starting at character `offset` of the completion."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, (lp, top) in zip(ids, entries, strict=True):
        text = tok.decode([i])
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(lp))
        out["top_logprobs"].append({tok.decode([j]): _lp(lq) for j, lq in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out
