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
(`Matcher.accept`).

A budget that ends inside the grammar would cut the reply into text that does not parse (a
model that keeps extending a string). So a constrained turn closes in time: in its last
`CLOSE_WITHIN` tokens the matcher plans a completion its grammar accepts (`Matcher.closing`:
the grammar's forced tokens, else the first allowed of a short list of one-byte tokens that end
a JSON string, object or array, then the shortest values), and once the plan needs all but
`SLACK` of the tokens left, only the plan's tokens are allowed. The turn then ends when the plan
does (`Matcher.closed`): a reply the budget shaped, reported as cut ("length"), that parses.

llguidance was chosen over xgrammar (both measured on SmolLM2's 49k vocabulary, BENCHMARKS.md):
both cost microseconds a token, and llguidance needs nothing beyond numpy where xgrammar brings
torch, triton and transformers into a server's install.
"""

from __future__ import annotations

import json

import llguidance
import numpy as np

CLOSE_WITHIN = 128  # tokens left at which a constrained turn starts planning its close
SLACK = 8  # the most one free token may lengthen the close (it opens that many strings, arrays)
# one-byte tokens a close tries, in order, where the grammar forces nothing: inside a string,
# the quote that ends it; outside, a bracket or brace that ends a value, a comma or colon, then
# the shortest values (an empty string, a zero, an empty array or object, a literal); then any
# other printable byte, a space last (never what a close needs)
_IN_STRING, _OUTSIDE = b'"', b'}],:"0[{tfn-'


class Grammars:
    """Grammars for one tokenizer and model vocabulary."""

    def __init__(self, tokenizer_json: str, vocab: int, eos: tuple[int, ...]):
        self.vocab = int(vocab)
        self._tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab, eos_token=list(eos))
        byte_token = {}  # printable byte -> the token that is that byte alone, where one is
        for b in [*range(33, 127), 32]:
            ids = self._tok.tokenize_bytes(bytes([b]))
            if len(ids) == 1:
                byte_token[b] = ids[0]

        def order(first: bytes) -> list[int]:
            head = [byte_token[b] for b in first if b in byte_token]
            return head + [t for t in byte_token.values() if t not in head]

        # the one-byte tokens a close tries, in order, inside a JSON string and outside one
        self._close_order = {True: order(_IN_STRING), False: order(_OUTSIDE)}

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
        return Matcher(llguidance.LLMatcher(self.grammars._tok, self.text), self.grammars)


class Matcher:
    """One turn's parse state."""

    def __init__(self, m, grammars: Grammars):
        self._m, self._g = m, grammars
        self._lex = _Lexer()  # inside a JSON string or not, from the text accepted so far
        self._check_at = CLOSE_WITHIN  # tokens left at which the close is next planned
        self._plan: list[int] | None = None  # the close, once only its tokens are allowed
        self.closed = False  # the close was forced and is complete: the turn ends here

    def fill(self, row: np.ndarray, left: int | None = None) -> None:
        """Write the allowed next tokens into `row` (int32[`mask_words(vocab)`], contiguous).
        `left`: the tokens the turn may still make, this one included (None: no budget)."""
        if self._plan is None and left is not None and left <= self._check_at:
            self._schedule(left)
        if self._plan:
            t, row[:] = self._plan[0], 0
            row[t >> 5] = np.array([1 << (t & 31)], np.uint32).view(np.int32)[0]
            return
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        if not self._m.consume_token(int(token)):
            return False
        self._lex.feed(self._g._tok.decode_bytes([int(token)]))
        if self._plan:
            self._plan.pop(0)
            self.closed = not self._plan
        return True

    def closing(self, limit: int) -> list[int] | None:
        """Tokens (at most `limit`) after which the grammar accepts, found greedily from
        here; None if none was found."""
        m, lex, out = self._m.deep_copy(), self._lex.copy(), []
        while not m.is_accepting():
            forced = m.compute_ff_tokens()
            if not forced:
                allowed = np.frombuffer(m.compute_bitmask(), np.uint32)
                order = self._g._close_order[lex.in_string]
                forced = [t for t in order if allowed[t >> 5] >> (t & 31) & 1][:1]
            if not forced or len(out) + len(forced) > limit or not m.consume_tokens(forced):
                return None
            out += forced
            lex.feed(self._g._tok.decode_bytes(forced))
        return out

    def _schedule(self, left: int) -> None:
        """Plan the close: forced from now when it needs all but `SLACK` of the `left` tokens,
        else planned again before a run of free tokens (each lengthening it by at most
        `SLACK`) could make it too long."""
        plan = self.closing(left + SLACK)
        if plan is None:
            self._check_at = left - 1
        elif len(plan) + SLACK >= left:
            self._plan = plan or None
        else:
            self._check_at = left - max(1, (left - len(plan) - SLACK) // (SLACK + 1))


class _Lexer:
    """Whether text is inside a JSON string (a quote not escaped opens or ends one)."""

    def __init__(self, in_string: bool = False, escaped: bool = False):
        self.in_string, self.escaped = in_string, escaped

    def copy(self) -> _Lexer:
        return _Lexer(self.in_string, self.escaped)

    def feed(self, text: bytes) -> None:
        for b in text:
            if self.escaped:
                self.escaped = False
            elif self.in_string and b == 0x5C:  # backslash
                self.escaped = True
            elif b == 0x22:  # quote
                self.in_string = not self.in_string
