"""`POST /v1/completions`: a text completion of a prompt (text or token ids), in a session like
a chat turn (`session_id` / `X-Session-Id`): the engine diffs the prompt against the session's
tokens, so an edited prompt is spliced."""

from __future__ import annotations

from fastapi import Request

from serve.chat import TooLong
from serve.http import body, formats, logprobs
from serve.http.auth import Caller
from serve.http.body import Received
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


def prompt_ids(req: CompletionRequest, backend) -> list[int]:
    """The prompt's token ids: its text encoded, or its ids, each checked against the
    vocabulary (400 naming `prompt`)."""
    if isinstance(req.prompt, str):
        context = backend.max_seq_len
        try:  # counted before its ids are made (`serve.chat.TooLong`)
            prompt = backend.tokenizer.encode(req.prompt, limit=context - 1)
        except TooLong as e:
            why = f"the prompt is at least {e.tokens} tokens; this model's context is {context}"
            raise APIError(400, why, "prompt", code="context_length_exceeded") from None
        if not prompt:
            raise APIError(400, "prompt: the text encodes to no token", "prompt")
        return prompt
    prompt, vocab = list(req.prompt), backend.vocab_size
    bad = [t for t in prompt if t >= vocab]
    if bad:
        why = f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})"
        raise APIError(400, why, "prompt")
    return prompt


def add_route(app, turns: Turns) -> None:
    backend = turns.backend

    def prepare(received: Received, header: str | None, tenant: str):
        """(the request, its caller, its prompt's ids, its sampling): the work that grows with
        the body, for a worker thread (`serve.http.body`)."""
        req = received.parse(CompletionRequest)
        caller = turns.session(req, header, tenant)
        prompt = prompt_ids(req, backend)
        grammar = formats.grammar(req, backend)
        sampling = turns.sampling(req, len(prompt), req.max_tokens, "max_tokens", grammar)
        return req, caller, prompt, sampling

    @app.post("/v1/completions", openapi_extra=body.documented(app, CompletionRequest))
    async def completions(request: Request, x_session_id: SessionHeader = None):
        received, tenant = await body.received(request), request.state.tenant
        # off the event loop: parsing, tokenizing (a long prompt delays no other request)
        req, caller, prompt, sampling = await body.in_thread(
            prepare, received, x_session_id, tenant
        )
        job = turns.start(prompt, sampling, req, caller)
        tok = backend.tokenizer
        text = OutputText(tok, tok.stop_tokens, req.stops, ())
        reply = TextReply(req, caller, prompt, text, backend.model_name)
        return await turns.respond(job, request, reply)
