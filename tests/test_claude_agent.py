"""The Claude Agent SDK (`claude_agent_sdk.query` and the Claude Code CLI its wheel bundles)
against a SmolLM2-135M-Instruct server, offline: a short system prompt and one in-process tool
(`@tool` + `create_sdk_mcp_server`). The CLI asks, gets a `tool_use`, runs the tool, sends its
`tool_result` and gets the final answer, every request a 200 with `thinking`,
`output_config.effort`, `context_management`, `metadata.user_id`, `cache_control` and the betas
as the CLI sends them; the `tool_result` request reads the whole first request (its prompt and
reply) from the session's KV, and a resumed `query` (a new CLI process) reads the whole
conversation so far, in the session `X-Claude-Code-Session-Id` names.

The CLI is configured as a user would: `ANTHROPIC_BASE_URL` and `ANTHROPIC_API_KEY` (a tenant's
key, sent as `x-api-key`), HOME a temporary folder, telemetry, error reports, updates and other
non-essential traffic off; `CLAUDE_CODE_SIMPLE` (the CLI's bare mode: no environment section
after the prompt, which a 135M model follows instead of the prompt),
`CLAUDE_CODE_MAX_OUTPUT_TOKENS` (the CLI asks 32,000 of a model it does not know) and
`CLAUDE_CODE_EXTRA_BODY` (fields merged into every request: `temperature` 0, greedy, since the
CLI sends none, and a `stop_sequences` of a blank line, so an answer ends at its first
paragraph). The model writes the call because the prompt asks it to repeat one; nothing forces
it (`tool_choice` is the CLI's own, `auto`).
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

sdk = pytest.importorskip("claude_agent_sdk")

# its time is SmolLM2 generating text, not compiling: XLA optimises (tests/conftest.py)
pytestmark = pytest.mark.xla_optimized

KEY = "key-of-claude-1"
MODEL = "smollm2"
TOOL = "mcp__weather__get_weather"  # Claude Code's name for tool get_weather of server weather
CALL = f'<tool_call>\n{{"name": "{TOOL}", "arguments": {{"city": "Paris"}}}}\n</tool_call>'
ANSWER = "Rain, 12 C in Paris."


@pytest.fixture(scope="module")
def server():
    from serve.engine import EngineConfig
    from serve.http.auth import Tenants
    from serve.http.backend import load_backend
    from serve.http.server import ServerThread

    config = EngineConfig(num_pages=128, page_size=16, max_seqs=2, max_seq_len=1024)
    backend = load_backend("smollm2", config, tenants=Tenants({KEY: "claude"}))
    with ServerThread(backend) as srv:
        yield srv


def cli_env(url: str, home: str) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": KEY,
        "HOME": home,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_SIMPLE": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "100",
        "CLAUDE_CODE_EXTRA_BODY": json.dumps({"temperature": 0, "stop_sequences": ["\n\n"]}),
    }


def counters(url: str) -> dict[str, float]:
    """The server's Prometheus counters of `/v1/messages` requests (by status) and of prompt
    tokens (by source)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for m in re.finditer(r'^leyline_(\w+)_total\{(\w+)="([^"]+)"(?:,(\w+)="([^"]+)")?\} (\S+)$',
                         text, re.M):  # fmt: skip
        name, k, v, k2, v2, value = m.groups()
        if name == "http_requests" and v == "/v1/messages":
            out[f"status {v2}"] = float(value)
        elif name == "prompt_tokens":
            out[v] = float(value)
    return out


def requests_of(messages) -> list[tuple[int, dict, dict]]:
    """Per API request the CLI made, from the raw events the SDK passes on: (the whole prompt,
    as `message_start` counts it; `message_delta`'s usage split; `message_delta` itself)."""
    out, prompt = [], None
    for m in messages:
        if isinstance(m, sdk.StreamEvent):
            ev = m.event
            if ev["type"] == "message_start":
                prompt = ev["message"]["usage"]["input_tokens"]
            elif ev["type"] == "message_delta":
                out.append((prompt, ev["usage"], ev))
    return out


def test_a_tool_turn_and_the_next_turn_from_the_sessions_kv(server, tmp_path):
    calls = []

    @sdk.tool("get_weather", "The weather in a city.", {"city": str})
    async def get_weather(args):
        calls.append(args)
        return {"content": [{"type": "text", "text": ANSWER}]}

    tools = sdk.create_sdk_mcp_server(name="weather", version="1.0.0", tools=[get_weather])
    stderr: list[str] = []

    def options(**more):
        return sdk.ClaudeAgentOptions(
            system_prompt="You answer with the get_weather tool.",
            mcp_servers={"weather": tools}, tools=[], allowed_tools=[TOOL], max_turns=3,
            model=MODEL, env=cli_env(server.url, str(tmp_path)), cwd=str(tmp_path),
            setting_sources=[], include_partial_messages=True, stderr=stderr.append, **more,
        )  # fmt: skip

    async def ask(prompt: str, **more) -> list:
        async def run():
            return [m async for m in sdk.query(prompt=prompt, options=options(**more))]

        return await asyncio.wait_for(run(), timeout=120)

    before = counters(server.url)
    first = asyncio.run(ask("Repeat exactly: " + CALL))
    said = [m for m in first if isinstance(m, sdk.AssistantMessage | sdk.UserMessage)]
    (use,) = said[0].content  # the model's call, as the CLI read it from the stream
    assert isinstance(use, sdk.ToolUseBlock), stderr
    assert (use.name, use.input) == (TOOL, {"city": "Paris"})
    assert calls == [{"city": "Paris"}]  # the CLI ran the in-process tool
    (result,) = said[1].content
    assert isinstance(result, sdk.ToolResultBlock) and result.tool_use_id == use.id
    assert result.content == [{"type": "text", "text": ANSWER}]
    (text,) = said[2].content  # the answer to the tool_result turn
    assert isinstance(text, sdk.TextBlock) and text.text.strip()
    done = first[-1]
    assert isinstance(done, sdk.ResultMessage)
    assert (done.subtype, done.is_error, done.num_turns) == ("success", False, 2)
    session = done.session_id  # the CLI's session: its X-Claude-Code-Session-Id header
    (p1, u1, d1), (p2, u2, d2) = requests_of(first)
    assert d1["delta"]["stop_reason"] == "tool_use" and d2["leyline"]["session_id"] == session
    assert u1["cache_read_input_tokens"] == 0  # a fresh server: all prefilled
    # the tool_result request reads the whole first request from the session's KV: its
    # prompt and its reply but the last token sampled (never fed)
    assert u2["cache_read_input_tokens"] == p1 + u1["output_tokens"] - 1
    assert u2["input_tokens"] == p2 - u2["cache_read_input_tokens"] < 32

    # the next turn: a new CLI process resuming the session re-sends the conversation, and
    # the server reads all of it but the new prompt from the same session's KV
    second = asyncio.run(ask("Thanks. Is it cold?", resume=session))
    done2 = second[-1]
    assert isinstance(done2, sdk.ResultMessage) and not done2.is_error, stderr
    assert done2.session_id == session and done2.subtype == "success"
    ((p3, u3, d3),) = requests_of(second)
    assert d3["leyline"]["session_id"] == session
    assert u3["cache_read_input_tokens"] >= p2  # the whole tool_result request, and its reply
    assert u3["input_tokens"] == p3 - u3["cache_read_input_tokens"] < 32
    assert done2.usage["cache_read_input_tokens"] == u3["cache_read_input_tokens"]

    # the server's own counters: three requests, none refused, the reads above reused
    after = counters(server.url)
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    reads = [u["cache_read_input_tokens"] for u in (u1, u2, u3)]
    prefilled = [u["input_tokens"] for u in (u1, u2, u3)]
    assert {k: grew.pop(k, 0) for k in ("status 200", "prefilled")} == {
        "status 200": 3, "prefilled": sum(prefilled)}  # fmt: skip
    assert grew.pop("reused", 0) + grew.pop("spliced", 0) == sum(reads) and not grew
    # and the session is the one the header named (closing it: 404 if there were none)
    key = {"x-api-key": KEY}
    assert httpx.delete(f"{server.url}/v1/sessions/{session}", headers=key).status_code == 200
