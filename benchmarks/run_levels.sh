#!/bin/bash
# On the GPU machine, from the repo root: the dev levels (LEVELS, default "2 1 3") one after another in one device
# call of LIMIT seconds (default 540), each through benchmarks/run_suite.sh on every GPU (GPUS=all): level 1
# against eager and torch.compile, levels 2 and 3 against compile-ro too. Resumable: call it again while the
# machine is warm (state in $STATE), or carry .device_carry/seed/levelN.jsonl from an earlier call (SEED). A
# level already complete is skipped. KB= the KernelBench folder (see run_suite.sh).
#   bash benchmarks/run_levels.sh [LIMIT] [more bench arguments]
LIMIT=${1:-540}
shift || true
start=$(date +%s)
export STATE=${STATE:-/tmp/kernelfuse_suite}
KB=${KB:-../shared/kernelbench}
[ -d "$KB" ] || KB=.device_carry/kernelbench
for l in ${LEVELS:-2 1 3}; do
  n=$(ls "$KB"/level$l/*.py | wc -l)
  have=$( [ -s "$STATE/level$l.jsonl" ] && wc -l < "$STATE/level$l.jsonl" || echo 0)
  [ "$have" -ge "$n" ] && { echo "level $l complete ($have of $n)"; continue; }
  left=$(( LIMIT - ($(date +%s) - start) ))
  [ "$left" -lt 40 ] && break
  case $l in 1) baselines=eager,compile;; *) baselines=eager,compile,compile-ro;; esac
  seed=.device_carry/seed/level$l.jsonl
  LEVEL=$l KB=$KB SEED=$( [ -s $seed ] && echo $seed ) bash benchmarks/run_suite.sh "$left" --gpus "${GPUS:-all}" \
    --baselines "$baselines" "$@"
done
