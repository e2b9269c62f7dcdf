#!/usr/bin/env bash
# The test suite on the CPU (tests marked gpu are skipped without CUDA; scripts/gpu_check.sh runs them).
# pytest exits 5 when it collects no test, which fails this script like any other error.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q "$@"
