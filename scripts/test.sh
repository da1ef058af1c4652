#!/usr/bin/env bash
# Install kernelfuse with its test tools into .venv (torch's CUDA 13 build, so the generated CUDA can be
# compile-checked with nvcc), lint, and run the test suite. GPU tests are skipped where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch 2.14.1 is the CUDA 13 build (compiles CUDA extensions); pip takes it from the local wheel cache where present.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.14.1" numpy pytest ruff
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda /usr/local/cuda-*; do
    if [ -f "$d/include/cuda_runtime_api.h" ]; then export CUDA_HOME="$d"; break; fi
  done
fi
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest -q -rs "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
