"""Agent traces: one format, and a seeded synthetic generator.

Format: JSONL, one session per line,

    {"id": "...", "steps": [{"messages": [...], "tools": [...]}, ...]}

where each step is the chat request the harness sent at that step (OpenAI chat format: system,
user, assistant with `tool_calls`, tool results; `tools` optional). Steps grow: a step's messages
start with the previous step's messages plus the assistant turn that answered it (an unedited
harness); a policy may then edit older messages (see `serve.policies`).

`python -m serve.traces --sessions 16 --turns 6 --tool-words 600 --seed 0 --out FILE` writes
them. `synthetic(...)`: a seeded generator with controllable turn count and tool-output length: a
user task, then per turn an assistant tool call and the tool's output (text made of English-like
words, so token counts are those of real text), and a final assistant answer.
"""

from __future__ import annotations

import json
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


def synthetic(
    sessions: int = 8,
    turns: int = 8,
    tool_words: int = 400,
    seed: int = 0,
) -> list[dict]:
    """`sessions` traces of `turns` tool turns each; a tool output is ~`tool_words` words
    (x0.5-1.5, seeded). Each step is the request after one more tool result."""
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
            call_id = f"call_{s}_{t}"
            messages.append(
                {
                    "role": "assistant",
                    "content": _text(rng, 12),
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": tool,
                                "arguments": json.dumps({"arg": _text(rng, 4)}),
                            },
                        }
                    ],
                }
            )
            n = int(tool_words * rng.uniform(0.5, 1.5))
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "name": tool, "content": _text(rng, n)}
            )
            steps.append({"messages": [dict(m) for m in messages], "tools": TOOLS})
        out.append({"id": f"synthetic-{seed}-{s}", "steps": steps})
    return out


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


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write seeded synthetic agent traces (JSONL)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tool-words", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    write(a.out, synthetic(a.sessions, a.turns, a.tool_words, a.seed))


if __name__ == "__main__":
    main()
