"""Constrained decoding through llguidance: a turn whose `SamplingParams.grammar` is set samples
only tokens its grammar allows (structured output: `response_format` JSON, tool calls).

`Grammars(tokenizer_json, vocab, eos)`: one per served model, from the tokenizer's own
`tokenizers` JSON (llguidance reads it as it is: byte-level and special tokens included), the
model's vocabulary (ids past the tokenizer's are never allowed) and the ids that end a reply
(allowed once the grammar is complete, and only then). `Grammar`: one compiled grammar,
immutable, shared by any number of turns; each turn gets its own `Matcher` (the parse state)
when it is made (`serve.engine.types.Request`).

Per step, the engine fills each constrained row's bitmask (`Matcher.fill`, in the layout of
`serve.sampling.mask_words`) on the host while the step's forward runs, and
`serve.sampling.sample` masks the logits with it; the sampled token is fed back
(`Matcher.accept`). llguidance was chosen over xgrammar (both measured on SmolLM2's 49k
vocabulary, BENCHMARKS.md): both cost microseconds a token, and llguidance needs nothing beyond
numpy where xgrammar brings torch, triton and transformers into a server's install.
"""

from __future__ import annotations

import json

import llguidance
import numpy as np


class Grammars:
    """Grammars for one tokenizer and model vocabulary."""

    def __init__(self, tokenizer_json: str, vocab: int, eos: tuple[int, ...]):
        self.vocab = int(vocab)
        self._tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab, eos_token=list(eos))

    def json_schema(self, schema: dict | None) -> Grammar:
        """JSON text valid against `schema` (a JSON Schema; None: any JSON object). Raises
        ValueError naming what llguidance cannot take."""
        schema = {"type": "object"} if schema is None else schema
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except (TypeError, ValueError) as e:
            raise ValueError(f"the schema is not one this server can enforce: {e}") from e
        return self.grammar(text)

    def lark(self, text: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (`%json {schema}` rules, `<[id]>` tokens)."""
        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the grammar is not one this server can enforce: {e}") from e
        return self.grammar(compiled)

    def grammar(self, text: str) -> Grammar:
        why = llguidance.LLMatcher.validate_grammar(text, self._tok)
        if why:
            raise ValueError(f"the grammar is not one this server can enforce: {why}")
        return Grammar(self, text)


class Grammar:
    """A compiled grammar (immutable): what `SamplingParams.grammar` holds."""

    def __init__(self, grammars: Grammars, text: str):
        self.grammars, self.text = grammars, text

    def matcher(self) -> Matcher:
        return Matcher(llguidance.LLMatcher(self.grammars._tok, self.text))


class Matcher:
    """One turn's parse state."""

    def __init__(self, m):
        self._m = m

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (int32[`mask_words(vocab)`], contiguous)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return bool(self._m.consume_token(int(token)))
