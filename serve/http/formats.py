"""Structured output over HTTP: the grammar (`serve.grammar`) a request asks for, enforced by
the sampling step.

- `response_format` `json_object`: any JSON object; `json_schema`: JSON valid against
  `json_schema.schema` (`strict` or not: the schema is always enforced).
- `tool_choice` `required`: one or more tool calls (one with `parallel_tool_calls: false`),
  each naming one of `tools` with arguments valid against its `parameters`; a named function:
  one call of it. Written in the layout the
  chat format renders calls in (`serve.chat`): ChatML's Hermes blocks
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, DeepSeek's special-token
  layout (calls begin, then per call: call begin, `function`, separator, the name and the
  arguments in a json fence, call end; then calls end); so `serve.http.text.parse_tool_calls`
  reads them back. `auto` and `none` are not constrained.
"""

from __future__ import annotations

import json

from serve.chat_formats import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP
from serve.http.errors import APIError
from serve.http.schema import NamedToolChoice


def grammar(req, backend):
    """The `serve.grammar.Grammar` the request asks for (None: unconstrained). Compiles it:
    call it off the event loop."""
    fmt = getattr(req, "response_format", None)
    choice = getattr(req, "tool_choice", None)
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and fmt is not None and fmt.type != "text":
        why = "response_format cannot be combined with a required or named tool_choice"
        raise APIError(400, why, "response_format")
    if forced:
        return _tool_grammar(req, backend)
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
    param = "response_format.json_schema.schema" if schema is not None else "response_format"
    try:
        return _grammars(backend, "response_format").json_schema(schema)
    except ValueError as e:
        raise APIError(400, str(e), param) from e


def _grammars(backend, param: str):
    if backend.grammars is None:
        why = "this model's tokenizer cannot constrain its output"
        raise APIError(400, why, param)
    return backend.grammars


def _tool_grammar(req, backend):
    tools = {t.function.name: t.function.parameters or {"type": "object"} for t in req.tools or []}
    if not tools:
        raise APIError(
            400, "tool_choice: a required or named tool_choice needs `tools`", "tool_choice"
        )
    names = list(tools)
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.name
        if name not in tools:
            raise APIError(400, f"tool_choice names {name!r}, not in `tools`", "tool_choice")
        names = [name]
    grammars, tok = _grammars(backend, "tool_choice"), backend.tokenizer
    if tok.format.name == "chatml":
        rules = _hermes(names, tools)
    else:
        rules = _deepseek(names, tools, tok)
    one = isinstance(req.tool_choice, NamedToolChoice) or req.parallel_tool_calls is False
    try:
        return grammars.lark(rules + _start(one, tok.format.name == "chatml", tok))
    except ValueError as e:
        raise APIError(400, f"tools: {e}", "tools") from e


def _hermes(names, tools) -> str:
    """A Hermes block: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, as the
    layout renders it; each tool's `parameters` the root of its own `%json` rule (so that its
    local `$ref`s resolve)."""
    rules = [
        'call: "<tool_call>\\n" body "\\n</tool_call>"',
        f"body: {' | '.join(f'body{i}' for i in range(len(names)))}",
    ]
    for i, n in enumerate(names):
        head = json.dumps(f'{{"name": {json.dumps(n)}, "arguments": ')  # a Lark string
        rules.append(f'body{i}: {head} args{i} "}}"')
        rules.append(f"args{i}: %json {json.dumps(tools[n])}")
    return "\n".join(rules) + "\n"


def _deepseek(names, tools, tok) -> str:
    """DeepSeek's call: special tokens by id, the name, the arguments in a json fence."""
    sp = {s: f"<[{tok.special(s)}]>" for s in (CALL_BEGIN, TOOL_SEP, CALL_END)}
    rules = [f"call: {' | '.join(f'call{i}' for i in range(len(names)))}"]
    for i, n in enumerate(names):
        fence = json.dumps(f"{n}\n```json\n")  # a Lark string: JSON's escapes
        head = f'{sp[CALL_BEGIN]} "function" {sp[TOOL_SEP]} {fence}'
        rules.append(f'call{i}: {head} args{i} "\\n```" {sp[CALL_END]}')
        rules.append(f"args{i}: %json {json.dumps(tools[n])}")
    return "\n".join(rules) + "\n"


def _start(one: bool, chatml: bool, tok) -> str:
    calls = "call" if one else ('call ("\\n" call)*' if chatml else "call+")
    if chatml:
        return f"start: {calls}\n"
    begin, end = (f"<[{tok.special(s)}]>" for s in (CALLS_BEGIN, CALLS_END))
    return f"start: {begin} {calls} {end}\n"
