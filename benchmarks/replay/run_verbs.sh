#!/usr/bin/env bash
# The SCRATCH and MOVE replays in BENCHMARKS.md (issue 16). Run from the repository root.
# SCRATCH: traces whose assistant replies carry reasoning blocks, exact-prefix radix vs AMORTIZE
# edit detection vs SCRATCH; the history re-sent drops every earlier reply's reasoning
# (DeepSeek-R1's rule: sets `scratch`) or only earlier user turns' (`interleaved`).
# MOVE: the truncation policy shifts history after each stubbed output; radix and AMORTIZE,
# each with MOVE off and on.
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .bench
[ -f .bench/synthetic_reasoning.jsonl ] || $PY -m benchmarks.traces --sessions 16 --turns 6 --tool-words 900 --seed 0 --reasoning-words 200 --out .bench/synthetic_reasoning.jsonl
[ -f .bench/bfcl_base_reasoning.jsonl ] || $PY -m benchmarks.traces --bfcl base --reasoning-words 200 --out .bench/bfcl_base_reasoning.jsonl
[ -f .bench/synthetic.jsonl ] || $PY -m benchmarks.traces --sessions 16 --turns 6 --tool-words 900 --seed 0 --out .bench/synthetic.jsonl
[ -f .bench/bfcl_long.jsonl ] || $PY -m benchmarks.traces --bfcl long_context --out .bench/bfcl_long.jsonl
common=(--concurrency 1,4 --compile-cache .jax_cache)
sets=${SETS:-scratch move interleaved}
for s in $sets; do
    case $s in
        scratch)
            $PY -m benchmarks.replay --traces .bench/synthetic_reasoning.jsonl --arms radix,amortize,scratch \
                "${common[@]}" --out benchmarks/replay/synthetic_reasoning_scratch
            $PY -m benchmarks.replay --traces .bench/bfcl_base_reasoning.jsonl --sample 16 --seed 0 \
                --arms radix,amortize,scratch "${common[@]}" --out benchmarks/replay/bfcl_base_reasoning_scratch
            ;;
        interleaved)  # reasoning of the agentic turn in progress re-sent, earlier turns' dropped
            $PY -m benchmarks.replay --traces .bench/bfcl_base_reasoning.jsonl --sample 16 --seed 0 \
                --reasoning-rule interleaved --arms radix,amortize,scratch "${common[@]}" \
                --out benchmarks/replay/bfcl_base_interleaved_scratch
            ;;
        move)
            $PY -m benchmarks.replay --traces .bench/synthetic.jsonl --arms radix,radix_move,amortize,amortize_move \
                "${common[@]}" --policy truncate --keep 2 --out benchmarks/replay/synthetic_truncate2_move
            $PY -m benchmarks.replay --traces .bench/synthetic.jsonl --arms radix,radix_move,amortize,amortize_move \
                "${common[@]}" --out benchmarks/replay/synthetic_none_move
            $PY -m benchmarks.replay --traces .bench/bfcl_long.jsonl --sample 16 --seed 0 \
                --arms radix,radix_move,amortize,amortize_move "${common[@]}" --policy truncate --keep 2 \
                --out benchmarks/replay/bfcl_long_truncate2_move
            ;;
    esac
done
