#!/usr/bin/env bash
# The replay results in BENCHMARKS.md: generate the traces, then replay each set with the
# reference truncation policy (keep 2) and without a policy. Run from the repository root.
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .bench
# Every XLA program compiled in one process maps memory. Before the ragged step the
# long_context replay compiled many shapes and died at the default limit (65530) with "LLVM
# compilation error: Cannot allocate memory"; its shapes are bounded by buckets now, but the
# limit is still checked.
if [ "$(cat /proc/sys/vm/max_map_count 2>/dev/null || echo 0)" -lt 262144 ]; then
    echo "warning: vm.max_map_count < 262144; raise it (sysctl -w vm.max_map_count=262144)" >&2
fi
[ -f .bench/synthetic.jsonl ] || $PY -m benchmarks.traces --sessions 16 --turns 6 --tool-words 900 --seed 0 --out .bench/synthetic.jsonl
[ -f .bench/bfcl_long.jsonl ] || $PY -m benchmarks.traces --bfcl long_context --out .bench/bfcl_long.jsonl
[ -f .bench/bfcl_base.jsonl ] || $PY -m benchmarks.traces --bfcl base --out .bench/bfcl_base.jsonl
run() {  # name trace-file [extra args]
    local name=$1 file=$2; shift 2
    $PY -m benchmarks.replay --traces "$file" --arms radix,amortize,forget --concurrency 1,4,8,16 \
        --compile-cache .jax_cache "$@" --policy truncate --keep 2 --out "benchmarks/replay/${name}_truncate2"
    $PY -m benchmarks.replay --traces "$file" --arms radix,amortize,forget --concurrency 1,4,8,16 \
        --compile-cache .jax_cache "$@" --out "benchmarks/replay/${name}_none"
}
sets=${SETS:-synthetic bfcl_long bfcl_base}
for s in $sets; do
    case $s in
        synthetic) run synthetic .bench/synthetic.jsonl ;;
        bfcl_long) run bfcl_long .bench/bfcl_long.jsonl --sample 16 --seed 0 ;;
        bfcl_base) run bfcl_base .bench/bfcl_base.jsonl --sample 16 --seed 0 ;;
    esac
done
