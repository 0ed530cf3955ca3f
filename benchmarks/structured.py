"""Structured output on SmolLM2-135M-Instruct: how often constrained replies hold, and what the
grammar mask costs a decode step.

- `json_schema`: `--requests` chat requests (the schemas below, nested objects, enums, arrays,
  in turn; temperature 0.7, a seed each) through the official `openai` client against
  `serve.http` (8 at a time); each reply parsed and validated against its schema by
  jsonschema_rs (an independent validator), finish reasons counted.
- `tool_choice`: the same number each of `required` (with `parallel_tool_calls` false, and
  default), a named function, and `none`: how many replies carry a call, of the named function,
  with arguments valid against the tool's parameters; the calls made and the finish reasons
  (a reply the budget cut keeps its complete calls).
- Mask cost: a decode step of 8 rows (each 64 prompt tokens in) on an engine of the same
  model, unconstrained against every row constrained by `json_object` (the mask filled on the
  host while the forward runs, uploaded, applied in `sample`; each row's close planned in
  every step, `serve.grammar`), medians over `--steps` steps;
  and llguidance's fill of one row's mask, timed alone over the token ids the served
  `json_schema` replies were made of.

    python -m benchmarks.structured [--requests 50] [--steps 30] [--out FILE.json]
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import statistics
import time

import jsonschema_rs
import numpy as np
import openai

from benchmarks import harness
from serve.engine import Engine
from serve.engine.config import EngineConfig
from serve.http.backend import load_backend
from serve.http.server import ServerThread
from serve.sampling import SamplingParams, mask_words

_OBJ = dict(type="object", additionalProperties=False)
SCHEMAS = [
    _OBJ | dict(properties={"name": {"type": "string"}, "age": {"type": "integer"}},
                required=["name", "age"]),
    _OBJ | dict(properties={"color": {"enum": ["red", "green", "blue"]}, "hex": {"type": "string"}},
                required=["color", "hex"]),
    _OBJ | dict(properties={"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
                required=["tags"]),
    _OBJ | dict(properties={"user": _OBJ | dict(properties={"id": {"type": "integer"},
                "email": {"type": "string"}}, required=["id", "email"]),
                "active": {"type": "boolean"}}, required=["user", "active"]),
    _OBJ | dict(properties={"steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": _OBJ
                | dict(properties={"n": {"type": "integer"}, "do": {"type": "string"}},
                       required=["n", "do"])}}, required=["steps"]),
    _OBJ | dict(properties={"city": {"type": "string"}, "temp_c": {"type": "number"},
                "sky": {"enum": ["clear", "cloudy", "rain"]}}, required=["city", "temp_c", "sky"]),
    _OBJ | dict(properties={"title": {"type": "string"}, "year": {"type": "integer"},
                "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]},
                           "maxItems": 2}}, required=["title", "year", "genres"]),
    _OBJ | dict(properties={"point": _OBJ | dict(properties={"x": {"type": "number"},
                "y": {"type": "number"}}, required=["x", "y"]), "label": {"type": "string"}},
                required=["point", "label"]),
    _OBJ | dict(properties={"answer": {"enum": ["yes", "no"]}, "why": {"type": "string"}},
                required=["answer", "why"]),
    _OBJ | dict(properties={"items": {"type": "array", "maxItems": 3, "items": _OBJ | dict(
                properties={"sku": {"type": "string"}, "qty": {"type": "integer"}},
                required=["sku", "qty"])}, "total": {"type": "number"}},
                required=["items", "total"]),
]  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": _OBJ | dict(
        properties={"city": {"type": "string"}}, required=["city"])}},
    {"type": "function", "function": {"name": "add", "parameters": _OBJ | dict(
        properties={"a": {"type": "integer"}, "b": {"type": "integer"}}, required=["a", "b"])}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid(schema, text: str) -> bool:
    try:
        jsonschema_rs.validate(schema, json.loads(text))
        return True
    except (ValueError, jsonschema_rs.ValidationError):
        return False


def json_schema_arm(client, n: int) -> tuple[dict, list[list[int]]]:
    def one(i):
        schema = SCHEMAS[i % len(SCHEMAS)]
        fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
        r = client.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=200, temperature=0.7, seed=i,
            response_format=fmt, extra_body={"leyline": {"return_token_ids": True}},
        )  # fmt: skip
        c = r.choices[0]
        ids = r.model_extra["leyline"]["output_token_ids"]
        return _valid(schema, c.message.content), c.finish_reason, ids

    with cf.ThreadPoolExecutor(8) as ex:
        res = list(ex.map(one, range(n)))
    finishes = [f for _, f, _ in res]
    out = {"requests": n, "valid": sum(v for v, _, _ in res)}
    out |= {f"finish_{f}": finishes.count(f) for f in sorted(set(finishes))}
    return out, [ids for _, _, ids in res]


def tool_arm(client, n: int, choice, parallel) -> dict:
    def one(i):
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = client.chat.completions.create(
            model="smollm2", messages=WEATHER, tools=TOOLS, tool_choice=choice, max_tokens=80,
            temperature=0.7, seed=i, **kw,
        )  # fmt: skip
        calls = r.choices[0].message.tool_calls or []
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        ok = all(_valid(params[c.function.name], c.function.arguments) for c in calls)
        return bool(calls), [c.function.name for c in calls], ok, r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(8) as ex:
        res = list(ex.map(one, range(n)))
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    finishes = [f for *_, f in res]
    return {
        "requests": n,
        "with_a_call": sum(c for c, *_ in res),
        "only_the_named": None if named is None else sum(ns == [named] for _, ns, *_ in res),
        "arguments_valid": sum(c and ok for c, _, ok, _ in res),
        "calls": sum(len(ns) for _, ns, *_ in res),  # a budget-cut last call is not counted
    } | {f"finish_{f}": finishes.count(f) for f in sorted(set(finishes))}


def mask_cost(engine: Engine, grammars, replies: list[list[int]], steps: int) -> dict:
    """Decode steps of 8 rows, unconstrained and constrained, and one row's fill alone."""
    rng = np.random.default_rng(0)

    def decode_steps(grammar) -> float:
        prompts = [rng.integers(0, 49152, 64).tolist() for _ in range(8)]
        # a budget the measured steps stay inside but near: the close is planned in each step
        # (`serve.grammar.CLOSE_WITHIN`), no row is closed and ended by it
        sp = SamplingParams(steps + 64, grammar=grammar)
        return statistics.median(harness.decode_step_times(engine, prompts, sp, steps)[0])

    plain = decode_steps(None)
    grammar = grammars.json_schema(None)
    constrained = decode_steps(grammar)
    fills = []
    for ids in replies:
        m = grammar.matcher()  # json_object: every reply is a JSON object
        row = np.zeros(mask_words(grammars.vocab), np.int32)
        for t in ids:
            s = time.perf_counter()
            m.fill(row)
            fills.append(time.perf_counter() - s)
            if not m.accept(t):
                break
    return {
        "step_8_rows_s": plain,
        "step_8_rows_constrained_s": constrained,
        "overhead_fraction": constrained / plain - 1,
        "fill_one_row_median_s": statistics.median(fills),
        "fill_one_row_p90_s": harness.percentile(fills, 90),
        "fills": len(fills),
    }


def main() -> None:
    ap = harness.parser(__doc__, out=None)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    config = EngineConfig(num_pages=512, page_size=16, max_seqs=8, max_seq_len=1024)
    backend = load_backend("smollm2", config)
    n = args.requests
    with ServerThread(backend) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4)  # compile
        schema_res, replies = json_schema_arm(client, n)
        print("json_schema", schema_res, flush=True)
        named = {"type": "function", "function": {"name": "add"}}
        tools = {
            "required, parallel_tool_calls false": tool_arm(client, n, "required", False),
            "required": tool_arm(client, n, "required", None),
            "named (add)": tool_arm(client, n, named, None),
            "none": tool_arm(client, n, "none", None),
        }
        for k, v in tools.items():
            print("tool_choice", k, v, flush=True)
    cost = mask_cost(backend.worker.engine, backend.grammars, replies, args.steps)
    print("mask cost", cost)
    harness.save_json(
        args.out,
        {"command": "python -m benchmarks.structured", "platform": harness.platform(),
         "json_schema": schema_res, "tool_choice": tools, "mask_cost": cost},
    )  # fmt: skip


if __name__ == "__main__":
    main()
