"""Agent traces: one format, and a seeded synthetic generator.

Format: JSONL, one session per line,

    {"id": "...", "steps": [{"messages": [...], "tools": [...]}, ...]}

where each step is the chat request the harness sent at that step (OpenAI chat format: system,
user, assistant with `tool_calls`, tool results; `tools` optional). Steps grow: a step's messages
start with the previous step's messages plus the assistant turn that answered it (an unedited
harness); a policy may then edit older messages (see `serve.policies`).

`python -m benchmarks.traces --sessions 16 --turns 6 --tool-words 600 --seed 0 --out FILE`
writes them (`--bfcl base|long_context [--limit N]`: bfcl-eval's conversations instead).
`synthetic(...)`: a seeded generator with controllable turn count and tool-output length: a
user task, then per turn an assistant tool call and the tool's output (text made of
English-like words, so token counts are those of real text).

Reasoning: an assistant message may carry `reasoning_content` (the DeepSeek API's field: what a
reasoning model thought before answering; `serve.chat.render` never re-sends it, and
`serve.chat.render_reply` places it). `add_reasoning(traces, words, seed)` gives every assistant
message ~`words` words of seeded reasoning (`synthetic(..., reasoning_words=N)`, `--reasoning-words
N` on the command line, bfcl traces too). Its text comes from a random stream of its own, keyed by
(seed, trace id, message position): the same message carries the same reasoning in every step,
and the rest of a trace is what it is without reasoning. `reply_of(step, next_step)`: the
assistant message that answered a step.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no "
    "file line error value result status request response table column row index query user "
    "server client token cache page memory time date count total name path config build test "
    "open close read write update delete create list search fetch return found missing ok"
).split()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
        },
    }
    for name, desc in (
        ("search_files", "Search the repository for a pattern."),
        ("read_file", "Read a file."),
        ("run_tests", "Run the test suite."),
        ("query_db", "Run a SQL query."),
    )
]


def _text(rng: np.random.Generator, words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words))


def _tool_call(call_id: str, name: str, arguments: str, text: str, result: str) -> list[dict]:
    """An assistant message (`text`) calling tool `name` with `arguments` (JSON), then the
    tool's message with its `result`."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": text, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "name": name, "content": result},
    ]


def synthetic(
    sessions: int = 8,
    turns: int = 8,
    tool_words: int = 400,
    seed: int = 0,
    reasoning_words: int = 0,
) -> list[dict]:
    """`sessions` traces of `turns` tool turns each; a tool output is ~`tool_words` words
    (x0.5-1.5, seeded). Each step is the request after one more tool result. `reasoning_words`
    > 0: `add_reasoning(..., reasoning_words, seed)` (the rest of the traces is unchanged)."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(sessions):
        messages = [
            {"role": "system", "content": "You are a coding agent. " + _text(rng, 60)},
            {"role": "user", "content": "Task: " + _text(rng, 40)},
        ]
        steps = []
        for t in range(turns):
            tool = TOOLS[int(rng.integers(0, len(TOOLS)))]["function"]["name"]
            text, arguments = _text(rng, 12), json.dumps({"arg": _text(rng, 4)})
            n = int(tool_words * rng.uniform(0.5, 1.5))
            messages += _tool_call(f"call_{s}_{t}", tool, arguments, text, _text(rng, n))
            steps.append({"messages": [dict(m) for m in messages], "tools": TOOLS})
        out.append({"id": f"synthetic-{seed}-{s}", "steps": steps})
    return add_reasoning(out, reasoning_words, seed) if reasoning_words else out


def _reasoning(words: int, seed: int, trace_id: str, index: int) -> str:
    """~`words` words (x0.5-1.5) from a stream of their own: (seed, trace id, message position)."""
    rng = np.random.default_rng([seed, zlib.crc32(trace_id.encode()), index])
    return _text(rng, max(1, int(words * rng.uniform(0.5, 1.5))))


def add_reasoning(traces: Iterable[dict], words: int, seed: int = 0) -> list[dict]:
    """The traces with `reasoning_content` (~`words` words, x0.5-1.5, seeded) on every assistant
    message that has none; the input is not modified. An assistant message's reasoning depends
    only on (seed, its trace's id, its position in the message list), so a message repeated by
    later steps carries the same text. `words` 0: the traces as they are."""
    if words < 0:
        raise ValueError(f"reasoning words must be >= 0, not {words}")
    if not words:
        return list(traces)

    def messages(t, msgs):
        return [
            {**m, "reasoning_content": _reasoning(words, seed, t["id"], i)}
            if m.get("role") == "assistant" and not m.get("reasoning_content")
            else m
            for i, m in enumerate(msgs)
        ]

    return [
        {**t, "steps": [{**s, "messages": messages(t, s["messages"])} for s in t["steps"]]}
        for t in traces
    ]


def reply_of(step_messages: list[dict], next_step_messages: list[dict]) -> dict | None:
    """The assistant message that answers a step: the first message the next step has after the
    step's messages, if it is an assistant's (None otherwise, e.g. a user turn follows, or there
    is no next step's message). Positional: the next step's earlier messages are not compared,
    so a policy's edits there do not matter."""
    n = len(step_messages)
    m = next_step_messages[n] if len(next_step_messages) > n else None
    return m if m is not None and m.get("role") == "assistant" else None


def write(path: str | Path, traces: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in traces:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")


def read(path: str | Path, limit: int | None = None) -> Iterator[dict]:
    """Traces from a JSONL file (checked: an id and a list of steps with messages)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if limit is not None and n >= limit:
                return
            if not line.strip():
                continue
            t = json.loads(line)
            if not isinstance(t.get("steps"), list) or any(
                not isinstance(s.get("messages"), list) for s in t["steps"]
            ):
                raise ValueError(f"{path}:{n + 1}: a trace needs 'steps' with 'messages'")
            t.setdefault("id", f"line-{n + 1}")
            yield t


# ---- bfcl-eval multi-turn conversations ------------------------------------------------------
BFCL_CATEGORIES = ("base", "long_context")


def _bfcl_root():
    import bfcl_eval  # installed with --no-deps: only its data and pure-Python back-ends are used

    return Path(bfcl_eval.__file__).parent


def _bfcl_call(instances: dict, call: str):
    """Run one ground-truth call string `name(arg=...)` on the back-end instance owning it."""
    import ast

    node = ast.parse(call.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a function call: {call!r}")
    name = node.func.id
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    for inst in instances.values():
        if hasattr(inst, name) and not name.startswith("_"):
            try:
                result = getattr(inst, name)(*args, **kwargs)
            except Exception as e:  # the back-end's own failure is the tool's output
                result = f"Error during execution: {e}"
            return name, kwargs | {f"arg{i}": a for i, a in enumerate(args)}, result
    raise ValueError(f"no back-end has a function {name!r}")


def bfcl(category: str = "base", limit: int | None = None) -> list[dict]:
    """bfcl-eval's multi-turn conversations as traces: each user turn, then each ground-truth
    call of that turn as an assistant tool call whose output is what executing it on the
    shipped back-ends returns (the long-context set loads its large scenarios). A step is the
    request after each user message and after each tool output; `tools` are the back-ends'
    function documents."""
    import importlib

    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING
    from bfcl_eval.constants.executable_backend_config import (
        MULTI_TURN_FUNC_DOC_FILE_MAPPING as DOCS,
    )

    if category not in BFCL_CATEGORIES:
        raise ValueError(f"unknown bfcl category {category!r}: {', '.join(BFCL_CATEGORIES)}")
    root = _bfcl_root() / "data"
    name = f"BFCL_v4_multi_turn_{category}.json"
    with open(root / name) as f:
        questions = [json.loads(line) for line in f]
    with open(root / "possible_answer" / name) as f:
        answers = {a["id"]: a["ground_truth"] for a in map(json.loads, f)}
    out = []
    for q in questions[:limit]:
        instances = {}
        for cls in q["involved_classes"]:
            module = importlib.import_module(CLASS_FILE_PATH_MAPPING[cls])
            inst = getattr(module, cls)()
            if hasattr(inst, "_load_scenario"):
                inst._load_scenario(
                    json.loads(json.dumps(q["initial_config"].get(cls, {}))),
                    long_context=category == "long_context",
                )
            instances[cls] = inst
        tools = []
        for cls in q["involved_classes"]:
            with open(root / "multi_turn_func_doc" / DOCS[cls]) as f:
                tools += [{"type": "function", "function": json.loads(line)} for line in f]
        messages, steps = [], []
        for t, (turn, calls) in enumerate(zip(q["question"], answers[q["id"]], strict=False)):
            messages += [dict(m) for m in turn]
            steps.append({"messages": [dict(m) for m in messages], "tools": tools})
            for c, call in enumerate(calls):
                fn, kwargs, result = _bfcl_call(instances, call)
                content = result if isinstance(result, str) else json.dumps(result, default=str)
                messages += _tool_call(f"call_{t}_{c}", fn, json.dumps(kwargs), "", content)
                steps.append({"messages": [dict(m) for m in messages], "tools": tools})
        out.append({"id": q["id"], "steps": steps})
    return out


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write agent traces (JSONL)")
    ap.add_argument("--bfcl", default=None, help=f"a bfcl-eval set: {', '.join(BFCL_CATEGORIES)}")
    ap.add_argument("--limit", type=int, default=None, help="first N bfcl conversations")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tool-words", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    reasoning = "~N words of seeded reasoning_content on every assistant message (default: none)"
    ap.add_argument("--reasoning-words", type=int, default=0, help=reasoning)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.bfcl:
        out = add_reasoning(bfcl(a.bfcl, a.limit), a.reasoning_words, a.seed)
    else:
        out = synthetic(a.sessions, a.turns, a.tool_words, a.seed, a.reasoning_words)
    write(a.out, out)


if __name__ == "__main__":
    main()
