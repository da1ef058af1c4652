#!/usr/bin/env bash
# On the GPU machine, from the repo root: `kernelfuse bench` over the 50 level-2 dev problems (optimized, then
# judged against eager and torch.compile), JSONL + HTML report + log copied to ${OUT:-out}/suite/. Each finished
# problem prints one line with its verdict and wall time.
#
# Resumable across calls: the state lives in ${STATE:-/tmp/kernelfuse_suite} (kept while the machine stays warm).
# The run is interrupted (SIGINT: the suite kills its children and exits) after SECONDS (default 540, under the
# device tool's 10-minute limit); run the script again to continue with --resume. FRESH=1 starts over.
#   bash benchmarks/run_suite.sh [SECONDS] [extra bench arguments, e.g. --gpus all or --ray]
# LIST=FILE runs the problem files listed in FILE (one path per line) instead of the whole level-2 folder.
# SEED=FILE: where the state is gone (the machine went back between calls), resume from a JSONL an earlier call
# brought back (carry it with the call).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
LIMIT=${1:-540}
shift || true
kb=../shared/kernelbench/level2
[ -d "$kb" ] || kb=.device_carry/kernelbench/level2
targets=("$kb")
[ -n "${LIST:-}" ] && mapfile -t targets < "$LIST"
STATE=${STATE:-/tmp/kernelfuse_suite}
DEST=${OUT:-out}/suite
[ "${FRESH:-0}" = 1 ] && rm -rf "$STATE"
mkdir -p "$STATE" "$DEST"
if [ ! -s "$STATE/level2.jsonl" ] && [ -n "${SEED:-}" ]; then
  echo "no state in $STATE: resuming from $SEED"; cp "$SEED" "$STATE/level2.jsonl"
fi
resume=()
[ -s "$STATE/level2.jsonl" ] && resume=(--resume)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$STATE/bench.log"
echo "cores: $(nproc) · limit ${LIMIT} s · ${resume[*]:-fresh run}" | tee -a "$STATE/bench.log"
start=$(date +%s)
timeout -s INT -k 30 "$LIMIT" python3 -m kernelfuse bench "${targets[@]}" --jsonl "$STATE/level2.jsonl" \
  --out-dir "$STATE/modelnew" --report "$STATE/level2.html" "${resume[@]}" "$@" 2>&1 | tee -a "$STATE/bench.log"
rc=${PIPESTATUS[0]}
echo "bench exit code $rc after $(( $(date +%s) - start )) s" | tee -a "$STATE/bench.log"
python3 - "$STATE/level2.jsonl" <<'PY' | tee -a "$STATE/bench.log"
import collections, json, sys
keys = [json.loads(line)["key"] for line in open(sys.argv[1]) if line.endswith("\n")]
dups = [k for k, n in collections.Counter(keys).items() if n > 1]
print(f"records: {len(keys)} · distinct: {len(set(keys))} · duplicates: {dups or 'none'}")
PY
cp "$STATE/level2.jsonl" "$STATE/bench.log" "$DEST"/
# each problem's time-stamped build and judge logs (where its seconds went), one archive: the device tool brings
# back a few files only
tar -czf "$DEST/logs.tgz" -C /tmp $(cd /tmp && ls -d kernelfuse_bench_*/*/ 2>/dev/null) 2>/dev/null
[ -f "$STATE/level2.html" ] && cp "$STATE/level2.html" "$DEST"/
exit 0
