"""Real agent clients against `serve.http` serving SmolLM2-135M-Instruct: the OpenAI Agents SDK
on its default model path (the Responses API) with a function tool, and LangChain's
`with_structured_output` with a pydantic schema (both of its methods: `json_schema`, and
`function_calling`, a named `tool_choice`), and litellm's `completion` with a required tool
call. Each runs turns of one session (the session header), and the engine's counters show a
later turn reusing the first's KV, and a turn whose history the agent edited (a tool's output
cut short, a request reworded) spliced: the edit channel holds through each client."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

from pydantic import BaseModel  # noqa: E402

# its time is SmolLM2 generating text, not compiling: XLA optimises (tests/conftest.py)
pytestmark = pytest.mark.xla_optimized


@pytest.fixture(scope="module")
def server():
    from serve.engine import EngineConfig
    from serve.http.backend import load_backend
    from serve.http.server import ServerThread

    config = EngineConfig(num_pages=256, page_size=16, max_seqs=2, max_seq_len=2048)
    with ServerThread(load_backend("smollm2", config)) as srv:
        yield srv


def reused(server) -> int:
    return server.backend.worker.engine.counters["reused"]


def test_the_agents_sdk_calls_a_tool_through_responses(server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "rain, 12 C"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    settings = ModelSettings(
        tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0.0,
        extra_headers={"X-Session-Id": "agent-sdk-1"},
    )  # fmt: skip
    agent = Agent(
        name="weather", instructions="Answer briefly.", tools=[get_weather],
        model=OpenAIResponsesModel(model="smollm2", openai_client=client), model_settings=settings,
    )  # fmt: skip
    counters = server.backend.worker.engine.counters
    before = reused(server)
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls, [r.output for r in result.raw_responses]
    assert isinstance(result.final_output, str)
    # the second model call re-sent the history with the tool's output: its prefix reused
    assert reused(server) - before > 20
    # the next run re-sends the history with the tool's output cut short: an edit, spliced
    history = result.to_input_list()
    outputs = [item for item in history if item.get("type") == "function_call_output"]
    assert outputs
    for item in outputs:
        item["output"] = "rain"
    history.append({"role": "user", "content": "And in Rome?"})
    spliced, before = counters["spliced"], reused(server)
    Runner.run_sync(agent, history, max_turns=3)
    assert counters["spliced"] > spliced and reused(server) - before > 20


class Person(BaseModel):
    name: str
    age: int


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(server, method):
    from langchain_openai import ChatOpenAI

    def structured(**kw):
        llm = ChatOpenAI(
            base_url=server.url + "/v1", api_key="none", model="smollm2", temperature=0,
            max_tokens=150, max_retries=0, default_headers={"X-Session-Id": f"lc-{method}"},
            **kw,
        )  # fmt: skip
        return llm.with_structured_output(Person, method=method)

    counters = server.backend.worker.engine.counters
    history = [("user", "Invent a person.")]
    before = reused(server)
    p = structured().invoke(history)
    assert isinstance(p, Person)
    history += [("assistant", p.model_dump_json()), ("user", "Another one.")]
    # the re-sent reply (compact JSON, not the tokens sampled) is an edit at the session's end,
    # re-prefilled (FORGET): greedy SmolLM2 after an AMORTIZE splice of it repeats itself inside
    # the JSON until the budget closes it (then "length", which the client refuses to parse)
    q = structured(extra_body={"leyline": {"mode": "forget"}}).invoke(history)
    assert isinstance(q, Person)
    assert reused(server) - before > 10  # the second turn extends the first's session
    # the agent rewords its first request: an edit early in the history, the rest spliced
    history[0] = ("user", "Invent a person, please.")
    history += [("assistant", q.model_dump_json()), ("user", "One more.")]
    spliced = counters["spliced"]
    assert isinstance(structured().invoke(history), Person)
    assert counters["spliced"] - spliced > 20


def test_litellm_calls_a_tool_and_splices_an_edited_history(server):
    import json
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    litellm = pytest.importorskip("litellm")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    kw = dict(
        model="openai/smollm2", api_base=server.url + "/v1", api_key="none", temperature=0,
        max_tokens=60, tools=tools, extra_headers={"X-Session-Id": "litellm-1"},
    )  # fmt: skip
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = litellm.completion(messages=history, tool_choice="required", parallel_tool_calls=False,
                           **kw)  # fmt: skip
    assert r.choices[0].message.tool_calls, r
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    said = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": "rain, 12 C, wind from the west"}
    history += [said, result]
    counters = server.backend.worker.engine.counters
    reused, spliced = counters["reused"], counters["spliced"]
    litellm.completion(messages=history, **kw)
    assert counters["reused"] - reused > 20  # the call's turn extends the first's session
    # the agent drops the tool output's detail: an edit of its history, spliced (AMORTIZE)
    history[-1] = dict(result, content="rain")
    reused = counters["reused"]
    litellm.completion(messages=history, **kw)
    assert counters["spliced"] > spliced and counters["reused"] - reused > 20
