"""`POST /v1/completions`: a text completion of a prompt (text or token ids), in a session like
a chat turn (`session_id` / `X-Session-Id`): the engine diffs the prompt against the session's
tokens, so an edited prompt is spliced."""

from __future__ import annotations

import asyncio

from fastapi import Request

from serve.http import formats, logprobs
from serve.http.auth import Caller
from serve.http.errors import APIError
from serve.http.reply import Outcome, Reply, data, usage
from serve.http.schema import CompletionRequest
from serve.http.text import OutputText
from serve.http.turn import SessionHeader, Turns


class TextReply(Reply):
    """A completion's answer: `text_completion` objects, whole or one per event."""

    field, prefix, kind = "prompt", "cmpl", "text_completion"

    def __init__(self, req, caller: Caller, prompt, text: OutputText, model_name: str):
        super().__init__(req, caller, text, model_name)
        self.prompt = prompt
        self.offset = 0  # where the next reported token's text starts (`text_offset`)

    def _body(self, choices, out: Outcome | None = None, with_usage: bool = True) -> dict:
        b = dict(self.head, choices=choices)
        if out is not None:
            if with_usage:
                b["usage"] = usage(out.stats, len(out.output))
            b["session_id"] = self.key
            b["leyline"] = self.leyline(self.prompt, out.output)
        return b

    def _logprobs(self, out: Outcome) -> dict | None:
        """The choice's `logprobs` for the tokens not yet reported (None: not asked)."""
        if self.req.logprobs_k is None:
            return None
        lps = logprobs.completion(self.text.tok, *out.fresh_logprobs(), self.offset)
        self.offset += sum(map(len, lps["tokens"]))
        return lps

    def _choice(self, text: str, out: Outcome | None, finish=None) -> dict:
        lps = out and self._logprobs(out)
        return {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}

    def delta(self, text: str, out: Outcome | None = None) -> dict:
        return data(self._body([self._choice(text, out)]))

    def closing(self, out: Outcome) -> list[dict]:
        delta = self.text.update(out.output, final=True)
        last = self._choice(delta, out, self.finish_reason(out.output))
        opts = self.req.stream_options
        if opts is not None and opts.include_usage:
            return [data(self._body([last])), data(self._body([], out))]
        return [data(self._body([last], out, with_usage=False))]  # usage only when asked

    def body(self, out: Outcome) -> dict:
        self.text.update(out.output, final=True)
        fin = self.finish_reason(out.output)
        return self._body([self._choice(self.text.text, out, fin)], out)


def add_route(app, turns: Turns) -> None:
    backend = turns.backend

    @app.post("/v1/completions")
    async def completions(
        req: CompletionRequest, request: Request, x_session_id: SessionHeader = None
    ):
        caller = turns.session(req, x_session_id, request)
        tok = backend.tokenizer
        if isinstance(req.prompt, str):
            prompt = await asyncio.to_thread(tok.encode, req.prompt)  # off the event loop
            if not prompt:
                raise APIError(400, "prompt: the text encodes to no token", "prompt")
        else:
            prompt, vocab = list(req.prompt), backend.vocab_size
            bad = [t for t in prompt if t >= vocab]
            if bad:
                why = f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})"
                raise APIError(400, why, "prompt")
        grammar = await asyncio.to_thread(formats.grammar, req, backend)
        sampling = turns.sampling(req, len(prompt), req.max_tokens, "max_tokens", grammar)
        job = turns.start(prompt, sampling, req, caller)
        text = OutputText(tok, tok.stop_tokens, req.stops, ())
        reply = TextReply(req, caller, prompt, text, backend.model_name)
        return await turns.respond(job, request, reply)
