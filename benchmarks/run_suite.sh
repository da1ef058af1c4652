#!/usr/bin/env bash
# On the GPU machine, from the repo root: `kernelfuse bench` over the dev problems of one level (LEVEL, default 2;
# optimized, then judged against eager and torch.compile unless --baselines says otherwise), JSONL + HTML report + log copied to ${OUT:-out}/suite/. Each finished
# problem prints one line with its verdict and wall time.
#
# Resumable across calls: the state lives in ${STATE:-/tmp/kernelfuse_suite} (kept while the machine stays warm).
# The run is interrupted (SIGINT: the suite kills its children and exits) after SECONDS (default 540, under the
# device tool's 10-minute limit); run the script again to continue with --resume. FRESH=1 starts over.
#   bash benchmarks/run_suite.sh [SECONDS] [extra bench arguments, e.g. --gpus all or --ray]
# LIST=FILE runs the problem files listed in FILE (one path per line) instead of the whole level folder.
# benchmarks/run_levels.sh runs it over several levels in one device call.
# SEED=FILE: where the state is gone (the machine went back between calls), resume from a JSONL an earlier call
# brought back (carry it with the call).
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # a caller's own path kept (a carried package)
LIMIT=${1:-540}
shift || true
L=${LEVEL:-2}
KB=${KB:-../shared/kernelbench}  # a KernelBench folder (levelN inside); else the copy carried to the device
[ -d "$KB" ] || KB=.device_carry/kernelbench
kb=$KB/level$L
targets=("$kb")
[ -n "${LIST:-}" ] && mapfile -t targets < "$LIST"
STATE=${STATE:-/tmp/kernelfuse_suite}
DEST=${OUT:-out}/suite
[ "${FRESH:-0}" = 1 ] && rm -rf "$STATE"
mkdir -p "$STATE" "$DEST"
if [ ! -s "$STATE/level$L.jsonl" ] && [ -n "${SEED:-}" ]; then
  echo "no state in $STATE: resuming from $SEED"; cp "$SEED" "$STATE/level$L.jsonl"
fi
resume=()
[ -s "$STATE/level$L.jsonl" ] && resume=(--resume)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$STATE/bench.log"
echo "cores: $(nproc) · limit ${LIMIT} s · ${resume[*]:-fresh run}" | tee -a "$STATE/bench.log"
start=$(date +%s)
timeout -s INT -k 30 "$LIMIT" python3 -m kernelfuse bench "${targets[@]}" --jsonl "$STATE/level$L.jsonl" \
  --out-dir "$STATE/modelnew" --report "$STATE/level$L.html" "${resume[@]}" "$@" 2>&1 | tee -a "$STATE/bench.log"
rc=${PIPESTATUS[0]}
echo "bench exit code $rc after $(( $(date +%s) - start )) s" | tee -a "$STATE/bench.log"
python3 - "$STATE/level$L.jsonl" <<'PY' | tee -a "$STATE/bench.log"
import collections, json, sys
keys = [json.loads(line)["key"] for line in open(sys.argv[1]) if line.endswith("\n")]
dups = [k for k, n in collections.Counter(keys).items() if n > 1]
print(f"records: {len(keys)} · distinct: {len(set(keys))} · duplicates: {dups or 'none'}")
PY
cp "$STATE/level$L.jsonl" "$STATE/bench.log" "$DEST"/
# each problem's time-stamped build and judge logs (where its seconds went), one archive: the device tool brings
# back a few files only
tar -czf "$DEST/logs.tgz" -C /tmp $(cd /tmp && ls -d kernelfuse_bench_*/*/ 2>/dev/null) 2>/dev/null
[ -f "$STATE/level$L.html" ] && cp "$STATE/level$L.html" "$DEST"/
exit 0
