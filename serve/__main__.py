"""A scripted multi-session conversation through the serving engine.

    python -m serve [--model PATH] [--sessions 4] [--turns 4] [--max-new 8] [--num-pages 512]
                    [--compile-cache DIR|off]

Without `--model` it runs the embedded tiny default checkpoint (DeepSeek-V3 family, written
under `--root` on first use). Every session shares one system prompt; each turn appends a
"tool output" and a user message; from the second turn on, the oldest tool output still in full
is replaced by a short stub, by AMORTIZE (odd sessions) or FORGET (every fourth turn of even
sessions). Sessions run concurrently (continuous batching). Per turn it prints the prompt size
and where its tokens came from: reused from cache, spliced (moved + rotated by AMORTIZE), or
prefilled, with time to first token and end-to-end latency. The first turns include compilation;
compiled programs are kept on disk (`serve.compile_cache`), so a second run skips it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import leyline_jax as ll
from checkpoints.tiny import ensure_default_checkpoints
from serve import compile_cache
from serve.engine import Engine, SamplingParams

STUB_LEN = 4


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Hugging Face checkpoint directory")
    ap.add_argument("--root", default=".checkpoints", help="where the embedded default lives")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed first pass that compiles every shape the script touches",
    )
    ap.add_argument(
        "--compile-cache",
        default=None,
        help=f"keep compiled programs in DIR (default ${compile_cache.ENV}, else "
        f"{compile_cache.DEFAULT_DIR}; off: none)",
    )
    args = ap.parse_args(argv)
    compile_cache.enable(args.compile_cache)

    path = args.model or ensure_default_checkpoints(args.root)["deepseek_v3"]
    model = ll.load_model(path)
    print(
        f"model {path} | {args.sessions} sessions x {args.turns} turns | page size "
        f"{args.page_size}, {args.num_pages} pages"
    )
    if not args.no_warmup:
        t0 = time.perf_counter()
        run(model, args, quiet=True)
        print(f"warm-up pass (compiles every shape): {time.perf_counter() - t0:.1f} s")
    run(model, args, quiet=False)


def run(model, args, quiet: bool) -> None:
    out = (lambda *a, **k: None) if quiet else print
    engine = Engine(
        model,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_seqs=max(args.sessions, 1),
    )
    system, script = conversation(model.config.vocab_size, args.sessions, args.turns, args.seed)
    stub = list(range(STUB_LEN))
    sids = [engine.open_session() for _ in range(args.sessions)]
    spans = {s: [] for s in sids}  # (start, end) of each tool output still in full
    out(
        f"{'session':>7} {'turn':>4} {'edit':>8} {'prompt':>6} {'reused':>6} {'spliced':>7} "
        f"{'prefill':>7} {'ttft ms':>8} {'total ms':>8}  generated"
    )
    t0 = time.perf_counter()
    for turn in range(args.turns):
        reqs = []
        for i, sid in enumerate(sids):
            tool, user = script[i][turn]
            s = engine.sessions[sid]
            head = system if turn == 0 else []
            directives, edit = [], ""
            if turn > 0 and spans[sid]:
                start, end = spans[sid].pop(0)
                mode = ll.Mode.FORGET if (i % 2 == 0 and turn % 4 == 3) else ll.Mode.AMORTIZE
                directives = [ll.Directive(start, end, stub, mode)]
                edit = mode.value
                delta = STUB_LEN - (end - start)
                spans[sid] = [(a + delta, b + delta) for a, b in spans[sid]]
            base = len(s.tokens) + sum(d.delta for d in directives) + len(head)
            spans[sid].append((base, base + len(tool)))
            req = engine.submit(
                sid,
                head + tool + user,
                directives=directives,
                sampling=SamplingParams(max_new_tokens=args.max_new),
            )
            reqs.append((sid, edit, req))
            if turn == 0:  # arrivals one iteration apart: later ones find the system prompt
                engine.step()
        engine.run_until_idle()
        for sid, edit, r in reqs:
            st = r.stats
            out(
                f"{sid:>7} {turn:>4} {edit or '-':>8} {st.prompt_tokens:>6} "
                f"{st.reused_tokens:>6} {st.spliced_tokens:>7} {st.prefilled_tokens:>7} "
                f"{st.ttft_s * 1e3:8.1f} {st.latency_s * 1e3:8.1f}  {r.result()}"
            )
    c = engine.counters
    out(
        f"total {time.perf_counter() - t0:.2f} s | tokens reused {c['reused']}, spliced "
        f"{c['spliced']}, prefilled {c['prefilled']}"
    )


if __name__ == "__main__":
    main()
