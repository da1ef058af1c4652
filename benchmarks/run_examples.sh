#!/usr/bin/env bash
# On the GPU machine, from the repo root: kernelfuse optimize on the three bundled problems, then kernelfuse
# eval of the three seed replies (from ../shared/seeds or .device_carry/seeds). Logs go to ${OUT:-out}/.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
LOG=${OUT:-out}
mkdir -p "$LOG" out
what=${1:-all}
if [ "$what" = all ] || [ "$what" = optimize ]; then
  for p in gemm_add_relu gemm_sigmoid_scaling_residualadd conv2d_relu_biasadd; do
    python3 -m kernelfuse optimize "examples/$p.py" -o "out/${p}_new.py" 2>&1 | grep -v Warning | tee "$LOG/optimize_$p.log"
  done
fi
if [ "$what" = all ] || [ "$what" = seeds ]; then
  seeds=../shared/seeds; [ -d "$seeds" ] || seeds=.device_carry/seeds
  python3 -m kernelfuse eval examples/gemm_add_relu.py "$seeds"/002_*.txt --json "$LOG/seed002.json" 2>&1 | tee "$LOG/seed002.log"
  python3 -m kernelfuse eval examples/gemm_sigmoid_scaling_residualadd.py "$seeds"/003_*.txt --json "$LOG/seed003.json" 2>&1 | tee "$LOG/seed003.log"
  python3 -m kernelfuse eval examples/conv2d_relu_biasadd.py "$seeds"/004_*.txt --json "$LOG/seed004.json" 2>&1 | tee "$LOG/seed004.log"
fi
