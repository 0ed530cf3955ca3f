"""How a route words a turn's answer: `Outcome` (what the turn's events gave: its tokens, their
log-probabilities, its statistics), `Reply` (subclassed per route: chat completion, text
completion, response, message; whole or as SSE events), OpenAI's `usage` with ours beside it,
and `data` (one SSE event)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from serve.http.auth import Caller
from serve.http.errors import APIError
from serve.http.text import OutputText


@dataclasses.dataclass
class Outcome:
    """What a turn's events gave its route."""

    output: list[int] = dataclasses.field(default_factory=list)  # the generated token ids
    stats: object = None  # TurnStats, once the turn ended
    gone: bool = False  # the client went away first
    logprobs: list = dataclasses.field(default_factory=list)  # `Request.logprobs`, if asked
    logprobs_sent: int = 0  # ... of them in the answer so far (a stream's)

    def fresh_logprobs(self) -> tuple[list[int], list]:
        """(the tokens, their log-probability entries) not yet in the answer, now counted in."""
        a = self.logprobs_sent
        self.logprobs_sent = len(self.logprobs)
        return self.output[a : self.logprobs_sent], self.logprobs[a:]


class Reply:
    """How a route words a turn's answer (subclassed per route). `field`: the request field
    an engine error names; `text`, `req` and `key`: the turn's output text, request and
    session name (the `caller`'s), which every answer reports; `head`: the fields every object
    of the answer opens with (`prefix`: its id's, `kind`: its `object`)."""

    field = "messages"
    prefix = kind = ""

    def __init__(self, req, caller: Caller, text: OutputText, model_name: str):
        self.req, self.caller, self.key, self.text = req, caller, caller.name, text
        self.head = {
            "id": f"{self.prefix}-{uuid.uuid4().hex}",
            "object": self.kind,
            "created": int(time.time()),
            "model": model_name,
        }

    def finish_reason(self, output: list[int]) -> str:
        """ "stop" for a stop string or token (not with `ignore_eos`), else "length"."""
        eos = bool(output) and output[-1] in self.text.stop_ids and not self.req.ignore_eos
        stopped = self.text.stopped or eos
        return "stop" if stopped else "length"

    def leyline(self, prompt, output, directives=()) -> dict:
        """The answer's `leyline` object: the session, the token directives the turn carried
        and, when asked, the prompt's and the output's token ids."""
        extra: dict = {"session_id": self.key}
        if directives:
            extra["directives"] = [
                {
                    "start": d.start,
                    "end": d.end,
                    "replacement_tokens": len(d.replacement),
                    "mode": d.mode.name.lower(),
                }
                for d in directives
            ]
        if self.req.options.return_token_ids:
            extra["prompt_token_ids"] = list(prompt)
            extra["output_token_ids"] = list(output)
        return extra

    def opening(self) -> list[dict]:  # SSE events before the first delta
        return []

    def delta(self, text: str, out: Outcome | None = None) -> dict:  # the SSE event carrying
        raise NotImplementedError  # new text (and, where asked, `out`'s fresh log-probabilities)

    def deltas(self, text: str, out: Outcome | None = None) -> list[dict]:  # the SSE events
        return [self.delta(text, out)]  # carrying new text

    def error(self, e: APIError) -> dict:  # the SSE event of an error mid-stream
        return data(e.body())

    def end(self) -> list[dict]:  # the SSE events every stream ends with
        return [{"data": "[DONE]"}]

    def closing(self, out: Outcome) -> list[dict]:  # SSE events after the last delta
        raise NotImplementedError

    def body(self, out: Outcome) -> dict:  # the whole answer
        raise NotImplementedError


def usage(stats, completion: int) -> dict:
    """OpenAI's usage, with ours: reused + spliced = cached, cached + prefilled = prompt."""
    cached = stats.reused_tokens + stats.spliced_tokens
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": stats.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "reused_tokens": stats.reused_tokens,
        "spliced_tokens": stats.spliced_tokens,
        "prefilled_tokens": stats.prefilled_tokens,
        "recomputed_tokens": stats.recomputed_tokens,
    }


def data(obj) -> dict:
    """One SSE event carrying `obj` as JSON."""
    return {"data": json.dumps(obj, ensure_ascii=False)}
