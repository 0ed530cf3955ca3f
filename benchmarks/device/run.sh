#!/usr/bin/env bash
# The device suite: each part in its own process under its own time budget, writing
# OUTDIR/PART.json (its log: OUTDIR/PART.log), then OUTDIR/summary.json. A part that crashes,
# runs out of memory or out of time loses its own results only.
#
#   benchmarks/device/run.sh OUTDIR [--smoke]
#
# Full size (one NVIDIA H200): the budgets below add up to 520 s, under 9 minutes with the
# summary and the 10 s a part that ignores its timeout gets before it is killed. --smoke: the
# same parts at toy sizes on CPU (CI runs it). Runs from the repository root with PYTHONPATH
# set to it (nothing needs installing, and nothing is installed); $PYTHON (default python3)
# runs every part. Exit status 0 when every part's status is ok.
set -u
if [[ $# -lt 1 || $# -gt 2 || ($# -eq 2 && $2 != --smoke) ]]; then
  echo "usage: $0 OUTDIR [--smoke]" >&2
  exit 2
fi
smoke=${2:-}
mkdir -p "$1"
out=$(cd "$1" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

# name:seconds, run in this order. Budgets are cumulative deadlines: a part that finishes early
# leaves its time to the parts after it, one that overruns is stopped at its own deadline and
# takes nothing from theirs. The HF part runs before the model part, which sets its rows beside
# HF's; the model and edit parts get most of the time (27-layer compiles, 32k-token prefills).
if [[ -n $smoke ]]; then
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
  parts="kernels:30 splice:30 attention:30 hf:40 model:70 edit:70" # a hung smoke fails CI in minutes
else
  parts="kernels:90 splice:45 attention:70 hf:75 model:145 edit:95" # 520 s: under 9 minutes
fi

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

start=$(now)
deadline=0
summary_args=()
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
      --budget "$budget" $smoke ${extra[@]+"${extra[@]}"} >"$out/$name.log" 2>&1
    rc=$?
  fi
  wall=$(since "$t0")
  echo "$name: exit $rc after $wall s (budget $budget s)"
  summary_args+=(--part "$name:$rc:$wall")
done
"$py" -m benchmarks.device.summary "$out" $smoke "${summary_args[@]}"
