#!/bin/bash
# On the GPU machine, from the repo root: all dev levels with `kernelfuse bench --gpus all`, resumable across
# calls (state in $STATE, or seeded from .device_carry/seed/levelN.jsonl when the machine went back). Order:
# level 2, 1, 3. LIMIT seconds in all.
# `bash benchmarks/run_levels.sh 550` per device call (LEVELS="2 3" for fewer; KB= the KernelBench folder, default
# ../shared/kernelbench, else a copy carried in .device_carry/kernelbench). JSONL, HTML reports, logs and the
# emitted files go to $OUT/suite. Level 1 is timed against eager and compile, levels 2 and 3 compile-ro too.
export PYTHONPATH=.:.device_carry/site PYTHONUNBUFFERED=1
KB=${KB:-../shared/kernelbench}
[ -d "$KB" ] || KB=.device_carry/kernelbench
LIMIT=${1:-540}; start=$(date +%s)
S=${STATE:-/tmp/kf_all}; mkdir -p $S $OUT/suite
nvidia-smi -L; nproc
for l in ${LEVELS:-2 1 3}; do
  [ -s $S/level$l.jsonl ] || { [ -s .device_carry/seed/level$l.jsonl ] && cp .device_carry/seed/level$l.jsonl $S/ && echo "seeded level $l"; }
done
for l in ${LEVELS:-2 1 3}; do
  n=$(ls $KB/level$l/*.py | wc -l)
  have=$( [ -s $S/level$l.jsonl ] && wc -l < $S/level$l.jsonl || echo 0)
  [ "$have" -ge "$n" ] && { echo "level $l complete ($have)"; continue; }
  case $l in 1) bl=eager,compile;; *) bl=eager,compile,compile-ro;; esac
  left=$(( LIMIT - ($(date +%s)-start) )); [ $left -lt 40 ] && break
  resume=(); [ -s $S/level$l.jsonl ] && resume=(--resume)
  timeout -s INT -k 30 $left python3 -m kernelfuse bench $KB/level$l --gpus all \
    --baselines $bl --jsonl $S/level$l.jsonl --out-dir $S/modelnew$l --report $S/level$l.html "${resume[@]}" >> $S/bench$l.log 2>&1
  echo "level $l rc=$? at $(( $(date +%s)-start )) s; records $(wc -l < $S/level$l.jsonl) of $n"
done
cp $S/level*.jsonl $S/level*.html $OUT/suite/ 2>/dev/null
tar czf $OUT/suite/logs.tgz -C $S $(cd $S && ls bench*.log) 2>/dev/null
tar czf $OUT/suite/modelnew.tgz -C $S $(cd $S && ls -d modelnew*) 2>/dev/null
ls -la $OUT/suite
