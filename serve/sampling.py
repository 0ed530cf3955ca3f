"""Sampling: what a turn asks for (`SamplingParams`, checked when made) and the one jitted draw
per step (`sample`), whose key depends on (seed, step) only, so a row draws the same token
whatever batch it is in; for the turns that ask, penalties on the logits first (`penalties`,
`penalize`) and the drawn tokens' log-probabilities (`token_logprobs`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from leyline_jax.hf_config import is_int

# the most alternatives a token's log-probability comes with (`SamplingParams.logprobs`; as
# vLLM's default `max_logprobs`, OpenAI's `top_logprobs` bound)
MAX_LOGPROBS = 20


def is_real(v) -> bool:
    return (is_int(v) or isinstance(v, (float, np.floating))) and math.isfinite(v)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a turn generates. Checked when made: a bad field raises ValueError naming it.

    max_new_tokens: int >= 1. temperature: finite, >= 0 (0: greedy). top_p: in (0, 1].
    stop_tokens: token ids (any sequence of non-negative ints; kept as a tuple). seed: in
    [0, 2**32): with (seed, step) it fixes a sampled row's draw, whatever batch it is in.
    grammar: a `serve.grammar.Grammar` the output must follow (None: unconstrained); its end
    is a stop token, so give the stop tokens its `Grammars` was made with. logprobs: None (none),
    or k in [0, MAX_LOGPROBS]: each generated token's log-probability and the k most likely
    tokens' (`Request.logprobs`; `token_logprobs`). presence_penalty, frequency_penalty in
    [-2, 2] and repetition_penalty > 0, as vLLM applies them (`penalties`): 0, 0, 1 change
    nothing."""

    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    seed: int = 0
    grammar: object = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**32)")
        if self.grammar is not None and not callable(getattr(self.grammar, "matcher", None)):
            raise ValueError(f"grammar={self.grammar!r} must be a serve.grammar.Grammar")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_real(v) or not -2 <= v <= 2:
                raise ValueError(f"{name}={v!r} must be a number in [-2, 2]")
        if not is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be a number > 0")
        lp = self.logprobs
        if lp is not None and (not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={lp!r} must be None or an integer in [0, {MAX_LOGPROBS}]")
        stops = self.stop_tokens
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (Sequence, np.ndarray)):
            raise ValueError(f"stop_tokens={stops!r} must be a sequence of token ids")
        if not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_tokens={stops!r} must hold non-negative integer token ids")
        for name, value in (
            ("max_new_tokens", int(self.max_new_tokens)),
            ("temperature", float(self.temperature)),
            ("top_p", float(self.top_p)),
            ("seed", int(self.seed)),
            ("stop_tokens", tuple(int(t) for t in stops)),
            ("logprobs", None if lp is None else int(lp)),
            ("presence_penalty", float(self.presence_penalty)),
            ("frequency_penalty", float(self.frequency_penalty)),
            ("repetition_penalty", float(self.repetition_penalty)),
        ):
            object.__setattr__(self, name, value)

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0, 0, 1)


def penalties(rows, shape) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`penalize`'s operands for logits of `shape` [B, V], the first rows' from `rows` of
    (SamplingParams, the turn's generated tokens, every token of its session): vLLM's rules.
    f32[B, V] `add`: -(frequency x count + presence x (count > 0)) over the generated tokens;
    f32[B, V] `scale`: the repetition penalty at every token of the session (prompt and
    output), 1 elsewhere. Rows past `rows` change nothing."""
    vocab = shape[1]
    add, scale = np.zeros(shape, np.float32), np.ones(shape, np.float32)
    for b, (sp, output, seen) in enumerate(rows):
        if not sp.penalized:
            continue
        counts = np.bincount(np.asarray(output, np.int64), minlength=vocab)[:vocab]
        add[b] = -(sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0))
        scale[b, np.asarray(seen, np.int64)] = sp.repetition_penalty
    return jnp.asarray(add), jnp.asarray(scale)


@jax.jit
def penalize(logits, add, scale):
    """Logits with `penalties` applied: a token's logit divided by its repetition penalty where
    positive, multiplied where negative, then `add` (vLLM's order)."""
    logits = jnp.where(logits > 0, logits / scale, logits * scale)
    return logits + add


def tokens(logits, turns, emitted: set[int], texts) -> jax.Array:
    """A step's draw (i32[B] on the device) from its logits [B, V]: one row per turn of `turns`
    (`serve.engine.Request`s), then padding. Every row is drawn (padding and turns still
    prefilling are discarded), so it compiles one shape per row bucket, like the step; the
    turns in `emitted` (indices) take theirs, under their grammars' masks; penalties where a
    turn asks (else nothing more runs), over `texts[i]`, every token of turns[i]'s session
    (its prompt and output so far)."""
    pad = logits.shape[0] - len(turns)

    def col(values, dtype):
        return jnp.asarray(np.asarray(values + [values[0]] * pad, dtype))

    if any(turns[i].sampling.penalized for i in emitted):
        ops = [(r.sampling, r.output, text) for r, text in zip(turns, texts, strict=True)]
        logits = penalize(logits, *penalties(ops, logits.shape))
    return sample(
        logits,
        col([r.sampling.temperature for r in turns], np.float32),
        col([r.sampling.top_p for r in turns], np.float32),
        col([r.sampling.seed for r in turns], np.uint32),
        col([len(r.output) for r in turns], np.int32),
        grammar_masks(
            [r.matcher if i in emitted else None for i, r in enumerate(turns)],
            [r.sampling.max_new_tokens - len(r.output) for r in turns],
            logits.shape,
        ),
    )


def mask_words(vocab: int) -> int:
    """int32 words of one row of `sample`'s mask: bit t % 32 of word t // 32 is token t."""
    return (vocab + 31) // 32


def grammar_masks(matchers, lefts, shape) -> jnp.ndarray | None:
    """`sample`'s mask for logits of `shape` [B, V]: all ones but for the rows whose matcher
    (`serve.grammar.Matcher`, None: unconstrained) fills its own, with the tokens its turn may
    still make (`lefts`); None when no row has one. The engine fills it on the host while the
    step's forward runs."""
    if all(m is None for m in matchers):
        return None
    masks = np.full((shape[0], mask_words(shape[1])), -1, np.int32)
    for i, (m, left) in enumerate(zip(matchers, lefts, strict=True)):
        if m is not None:
            m.fill(masks[i], left)
    return jnp.asarray(masks)


@jax.jit
def sample(logits, temperature, top_p, seed, step, mask=None):
    """One token per row of f32[B, V] logits: greedy where temperature == 0, else a draw from
    the top-p nucleus of softmax(logits / temperature). The key depends on (seed, step) only, so
    a row draws the same token whatever batch it is in. A step whose rows are all greedy skips
    the nucleus (a sort of the vocabulary per row: ~8 ms a row at 32k tokens on CPU). `mask`
    (i32[B, ceil(V / 32)], `serve.grammar`): only tokens whose bit is set may be drawn."""
    if mask is not None:
        v = jnp.arange(logits.shape[-1], dtype=jnp.int32)
        allowed = (mask[:, v >> 5] >> (v & 31)) & 1
        logits = jnp.where(allowed == 1, logits, -jnp.inf)

    def row(lg, t, p, s, n):
        key = jax.random.fold_in(jax.random.PRNGKey(s), n)
        scaled = lg / jnp.maximum(t, 1e-6)
        order = jnp.argsort(-scaled)
        probs = jax.nn.softmax(scaled[order])
        keep = (jnp.cumsum(probs) - probs) < p  # the smallest prefix with mass >= p
        drawn = order[jax.random.categorical(key, jnp.where(keep, scaled[order], -jnp.inf))]
        return jnp.where(t > 0, drawn, jnp.argmax(lg)).astype(jnp.int32)

    def greedy(lg, *_):  # the same tokens without sorting the vocabulary for every row
        return jnp.argmax(lg, axis=-1).astype(jnp.int32)

    args = (logits, temperature, top_p, seed, step)
    return jax.lax.cond(jnp.any(temperature > 0), jax.vmap(row), greedy, *args)


@jax.jit
def token_logprobs(logits, tokens):
    """(log p(tokens[b]) under row b, the MAX_LOGPROBS most likely tokens' ids and log p, most
    likely first) for f32[B, V] logits and i32[B] tokens: the model's own distribution (the
    log-softmax of the logits), before temperature, top-p or a grammar's mask, as vLLM reports
    by default. Run only for steps where a turn asks (`SamplingParams.logprobs`)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, logits.shape[-1]))
    return chosen, top_ids, top_lp
