#!/usr/bin/env bash
# The device suite: the environment first, then each part in its own process under its own time
# budget, writing OUTDIR/PART.json (its log: OUTDIR/PART.log), then OUTDIR/summary.json and
# OUTDIR/tables.md (every table as markdown). A part that crashes, runs out of memory or out of
# time loses its own results only.
#
#   benchmarks/device/run.sh OUTDIR [--quick] [--smoke]
#
# Full size (one NVIDIA H100 or H200): the budgets below add up to 450 s; with the 10 s the last
# part may get after its timeout and the summary and tables (no jax: a second or two), under 8
# minutes. --quick: the rows the targets are read at and fewer repeats (shapes.quick says what it
# drops), 220 s of budgets, under 4 minutes. --smoke: the same parts at toy sizes on CPU (CI runs
# it, alone and with --quick). Runs from the repository root with PYTHONPATH set to it (nothing
# needs installing, and nothing is installed); $PYTHON (default python3) runs every part. Exit
# status 0 when every part's status is ok.
set -u
usage() {
  echo "usage: $0 OUTDIR [--quick] [--smoke]" >&2
  exit 2
}
[[ $# -ge 1 ]] || usage
outdir=$1
shift
smoke="" quick=""
for arg in "$@"; do
  case $arg in
    --smoke) smoke=--smoke ;;
    --quick) quick=--quick ;;
    *) usage ;;
  esac
done
mkdir -p "$outdir"
out=$(cd "$outdir" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

# name:seconds, run in this order. Budgets are cumulative deadlines: a part that finishes early
# leaves its time to the parts after it, one that overruns is stopped at its own deadline and
# takes nothing from theirs. The environment comes first (seconds: it says at once what does not
# import). The HF part runs before the model part, which sets its rows beside HF's; the model
# part gets the most time (27-layer compiles, 8k-token prefills). The compiled-kernel tests run
# last: they get whatever the measurements left of their budgets, and keep the outcomes of the
# tests that finished if their time runs out.
if [[ -n $smoke ]]; then
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
  parts="env:30 splice:30 attention:30 hf:40 model:70 edit:70 kernels:30" # a hung smoke fails CI in minutes
elif [[ -n $quick ]]; then
  parts="env:15 splice:20 attention:30 hf:25 model:80 edit:30 kernels:20" # 220 s: under 4 minutes
else
  parts="env:20 splice:40 attention:70 hf:60 model:140 edit:80 kernels:40" # 450 s: under 8 minutes
fi

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

start=$(now)
deadline=0
summary_args=()
rm -f "$out/summary.json" "$out/tables.md"
for part in $parts; do
  name=${part%%:*}
  deadline=$((deadline + ${part##*:}))
  budget=$(awk -v d="$deadline" -v s="$(since "$start")" 'BEGIN { printf "%d", d - s }')
  t0=$(now)
  rm -f "$out/$name.json" # a result from an earlier run must not stand in for this one
  if ((budget < 5)); then
    echo "no time left before this part's deadline ($deadline s into the suite)" >"$out/$name.log"
    rc=124
  else
    extra=()
    [[ $name == model ]] && extra=(--hf "$out/hf.json")
    timeout -k 10 "$budget" "$py" -m "benchmarks.device.$name" --out "$out/$name.json" \
      --budget "$budget" $smoke $quick ${extra[@]+"${extra[@]}"} >"$out/$name.log" 2>&1
    rc=$?
  fi
  wall=$(since "$t0")
  echo "$name: exit $rc after $wall s (budget $budget s)"
  # the environment's report (versions, GPU, failed imports) at once, before any measurement
  [[ $name == env ]] && grep -E '^(environment|machine|versions|imports|IMPORT|PART)' "$out/env.log"
  summary_args+=(--part "$name:$rc:$wall:$budget")
done
"$py" -m benchmarks.device.summary "$out" $smoke $quick "${summary_args[@]}"
status=$?
"$py" -m benchmarks.device.to_markdown "$out" --out "$out/tables.md" ||
  echo "tables.md: not written (see above)" >&2
exit $status
