#!/usr/bin/env bash
# Install kernelfuse with its test tools into .venv, lint, and run the test suite. GPU tests are skipped where no
# GPU is present. A torch already importable in .venv (the quick start's, or the system's through
# --system-site-packages) is kept when it is a CUDA build (it compiles the generated CUDA with nvcc); only
# otherwise is the pinned CUDA 13 build installed: torch is downloaded at most once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  # torch 2.14.1 is the CUDA 13 build; pip takes it from the local wheel cache where present.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.14.1"
fi
# Ray and matplotlib are optional for users (kernelfuse[ray], kernelfuse[report]) but not for the tests: bench's
# Ray path runs on a local CPU cluster and the HTML report is built and parsed, so both are installed here.
.venv/bin/python -m pip install --quiet --disable-pip-version-check numpy pytest ruff ray matplotlib
# The model zoo's test (the `zoo` extra): transformers, and the torchvision release built for this torch (torch
# 2.N.p pairs with torchvision 0.(N+15).p), installed without its dependencies so that torch is never replaced.
tv=$(.venv/bin/python -c "import torch; v = torch.__version__.split('+')[0].split('.'); print(f'0.{int(v[1]) + 15}.{v[2]}')")
.venv/bin/python -m pip install --quiet --disable-pip-version-check transformers pillow
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "torchvision==$tv"
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda /usr/local/cuda-*; do
    if [ -f "$d/include/cuda_runtime_api.h" ]; then export CUDA_HOME="$d"; break; fi
  done
fi
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest -q -rs --durations=15 "$@"  # the slowest tests listed: the suite is kept lean
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
