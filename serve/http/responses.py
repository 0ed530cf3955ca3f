"""`POST /v1/responses`: OpenAI's Responses API (what the OpenAI Agents SDK calls by default), on
the chat path: the input items become chat messages, the turn runs as a chat turn (the edit
channel, sessions, tools, `tool_choice` and `text.format` enforced as there), and the answer is
a `response` object, or its stream of events.

Input: a string (one user message) or items: messages (`role`, content a string or
`input_text` / `output_text` parts), `function_call` (an assistant's call) and
`function_call_output` (its result, a tool message); `instructions` is the system message.
`include: ["message.output_text.logprobs"]` (with `top_logprobs` alternatives) reports the
output text's tokens' log-probabilities, as chat does (`serve.http.logprobs`).

A stored response (`store`, the default) is a conversation: `previous_response_id` continues
it (the caller's tenant's only; another's is not found), and its session is the conversation's,
so a continued chain is an extension of its KV, spliced when the caller edits. What is stored
is the conversation as the model ran it, every edit applied (a FORGET's evicted text is not
kept). The store is in memory, bounded per tenant (`MAX_STORED`, the oldest dropped first), and
gone at a restart. A reply the budget cut is "incomplete"; errors name the Responses fields.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from serve.http import body, formats, logprobs
from serve.http.body import Received
from serve.http.chat_completions import ChatReply, render
from serve.http.errors import APIError
from serve.http.reply import Outcome, data, usage
from serve.http.responses_input import (
    ResponsesRequest,
    Stored,
    chat_request,
    messages_of,
    renamed,
)
from serve.http.text import OutputText, tool_markers
from serve.http.turn import SessionHeader, Turns


class ResponsesReply(ChatReply):
    """A turn's answer as a `response` object, or its events (`response.created` ...
    `response.completed`, each with its `sequence_number`)."""

    prefix, field = "resp", "input"

    def __init__(self, rreq, req, caller, turn, text, backend, store_as):
        super().__init__(req, caller, turn, text, backend)
        self.rreq, self.store_as, self.seq = rreq, store_as, 0
        self.rid = self.head["id"] = f"resp_{uuid.uuid4().hex}"  # OpenAI's form of the id
        self.mid = f"msg_{uuid.uuid4().hex}"
        self.created = time.time()

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"event": kind, **data({"type": kind, "sequence_number": self.seq - 1, **fields})}

    def _response(self, status: str, output: list, use: dict | None) -> dict:
        cut = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.head["model"],
            "output": output,
            "usage": use,
            "error": None,
            "incomplete_details": cut,
            "instructions": self.rreq.instructions,
            "metadata": {},
            "parallel_tool_calls": self.rreq.parallel_tool_calls is not False,
            "temperature": self.rreq.temperature,
            "top_p": self.rreq.top_p,
            "tool_choice": self.rreq.tool_choice or "auto",
            "tools": self.rreq.tools or [],
            "previous_response_id": self.rreq.previous_response_id,
            "store": self.rreq.store,
            "session_id": self.key,
        }

    def _message(self, text: str, status: str = "completed", lps=None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if lps is not None:  # asked (`include`): every generated token's
            part["logprobs"] = lps
        return {
            "type": "message",
            "id": self.mid,
            "status": status,
            "role": "assistant",
            "content": [part] if status != "in_progress" else [],
        }

    def _done(self, out: Outcome, streamed: bool = False) -> tuple[dict, list, list]:
        """(the response, its output items, its calls), the conversation stored. A reply the
        budget cut is "incomplete" (`incomplete_details.reason` "max_output_tokens")."""
        content, calls, extra = self._finish(out)
        status = "completed" if self.finish_reason(out.output) == "stop" else "incomplete"
        # a stream announced its message item first: it stays, empty, beside the calls
        lps = None  # every generated token's, where asked
        if self.req.logprobs_k is not None:
            lps = logprobs.chat_content(self.text.tok, out.output, out.logprobs)
        message = self._message(content, status, lps)
        items = [message] if content or not calls or streamed else []
        for c in calls:
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{c['id']}",
                    "call_id": c["id"],
                    "name": c["function"]["name"],
                    "arguments": c["function"]["arguments"],
                    "status": "completed",
                }
            )
        u = usage(out.stats, len(out.output))
        use = {
            "input_tokens": u["prompt_tokens"],
            "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            **{k: u[k] for k in ("reused_tokens", "spliced_tokens", "prefilled_tokens")},
        }
        if self.store_as is not None:
            said = {"role": "assistant", "content": content or ""}
            if calls:
                said["tool_calls"] = calls
            tenant, session, system = self.store_as
            history = self.turn.messages  # edited: what a FORGET evicted is not stored
            if system and history[:1] == system:
                history = history[1:]
            stored = Stored(tenant, session, [*history, said])
            self.backend.responses.put(self.rid, stored)
        return self._response(status, items, use) | extra, items, calls

    def body(self, out: Outcome) -> dict:
        self.text.update(out.output, final=True)
        return self._done(out)[0]

    def opening(self) -> list[dict]:
        first = self._response("in_progress", [], None)
        return [
            self._event("response.created", response=first),
            self._event("response.in_progress", response=first),
            self._event(
                "response.output_item.added", output_index=0, item=self._message("", "in_progress")
            ),
            self._event(
                "response.content_part.added",
                item_id=self.mid,
                output_index=0,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            ),
        ]

    def delta(self, text: str, out: Outcome | None = None) -> dict:
        at = dict(item_id=self.mid, output_index=0, content_index=0)
        if out is not None and (lps := self._logprobs(out)) is not None:
            at["logprobs"] = lps["content"]  # the tokens' not yet reported
        return self._event("response.output_text.delta", delta=text, **at)

    def closing(self, out: Outcome) -> list[dict]:
        events = []
        tail = self.text.update(out.output, final=True)
        if tail:
            events.append(self.delta(tail, out))
        resp, items, calls = self._done(out, streamed=True)
        message = items[0] if items and items[0]["type"] == "message" else self._message("")
        text = message["content"][0]["text"]
        at = dict(item_id=self.mid, output_index=0, content_index=0)
        events += [
            self._event("response.output_text.done", text=text, **at),
            self._event("response.content_part.done", part=message["content"][0], **at),
            self._event("response.output_item.done", output_index=0, item=message),
        ]
        for i, item in enumerate(it for it in items if it["type"] == "function_call"):
            k = i + 1
            events += [
                self._event("response.output_item.added", output_index=k, item=item),
                self._event("response.output_item.done", output_index=k, item=item),
            ]
        events.append(self._event(f"response.{resp['status']}", response=resp))
        return events


def add_route(app, turns: Turns) -> None:
    backend = turns.backend

    def prepare(received: Received, header: str | None, tenant: str):
        """(the request, its chat request, its caller, its turn, its sampling, its store_as):
        the body parsed, the conversation put together and rendered, the grammar compiled.
        The work that grows with the body, for a worker thread (`serve.http.body`)."""
        rreq = received.parse(ResponsesRequest)
        if rreq.session_id and header and rreq.session_id != header:
            why = "session_id and the X-Session-Id header name different sessions"
            raise APIError(400, why, "session_id")
        # the conversation as stored: without instructions, which each request gives anew
        said, session = [], rreq.session_id or header
        if rreq.previous_response_id is not None:
            prior = backend.responses.get(tenant, rreq.previous_response_id)
            said, session = [*prior.messages], session or prior.session
        said += messages_of(rreq.input)
        system = (
            [] if rreq.instructions is None else [{"role": "system", "content": rreq.instructions}]
        )
        if session is None and rreq.store:
            session = f"resp_{uuid.uuid4().hex}"
        req = chat_request(rreq, system + said, session)
        caller = turns.session(req, None, tenant)
        try:
            turn = render(req, caller.key, backend.tokenizer, backend.sessions, backend.max_seq_len)
            grammar = formats.grammar(req, backend)
            sampling = turns.sampling(req, len(turn.final), *req.max_new, grammar=grammar)
        except APIError as e:
            raise renamed(e) from None
        store_as = (tenant, session, system) if rreq.store else None
        return rreq, req, caller, turn, sampling, store_as

    @app.post("/v1/responses", openapi_extra=body.documented(app, ResponsesRequest))
    async def responses(request: Request, x_session_id: SessionHeader = None):
        received, tenant = await body.received(request), request.state.tenant
        # off the event loop: a long input delays no other request
        rreq, req, caller, turn, sampling, store_as = await body.in_thread(
            prepare, received, x_session_id, tenant
        )
        job = turns.start(turn.prompt, sampling, req, caller, turn.directives)
        tok = backend.tokenizer
        markers = tool_markers(tok) if turn.use_tools else ()
        text = OutputText(tok, tok.stop_tokens, req.stops, markers)
        reply = ResponsesReply(rreq, req, caller, turn, text, backend, store_as)
        return await turns.respond(job, request, reply)
