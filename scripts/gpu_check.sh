#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the device machine (H200): GPU tests at real sizes, then
# the benchmarks. Logs and JSON land in $OUT (default ./out); a short table is printed last.
#   device run:  bash scripts/gpu_check.sh            (carry: .whl with the fla-core and gguf wheels)
# Set GPU_CHECK_PARTS to a subset of "tests kernels tree moe ar verify draft spec projections profile
# profile_verify train fp8 fp8_sweep prefill batch" to run only those parts, MOE_SWEEP=1 to have the moe part also time its tile settings,
# GPU_TESTS to test paths, VERIFY_NS to the verify step's tree sizes, SPEC_BUDGETS to the speculative step's tree
# sizes, SMOL_GGUF to the SmolLM2 GGUF (staged from .stage/smol) for the fp8 part's GSM8K agreement run and the
# batch part, BATCH_BUDGET to the batch part's tree budget (a number or auto). All
# parts take longer than one 10-minute device call: e.g. "tests" in one call, "ar verify spec
# profile" in the next.
# The tuned kernel choices (dflash_tfm/tuning.py) are timed at first use and kept in $OUT/cache/tuning, so they
# come back with the logs; carry that folder in (DFLASH_TFM_CACHE) to reuse an earlier call's choices.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export DFLASH_TFM_CACHE=${DFLASH_TFM_CACHE:-$OUT/cache}
PARTS=" ${GPU_CHECK_PARTS:-tests kernels tree moe ar verify draft spec projections profile train} "
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:src:.
else
  export PYTHONPATH=src:.
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/versions.txt" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/versions.txt"
status=0
run() {  # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || status=1
}
has() { [[ $PARTS == *" $1 "* ]]; }
has tests && run gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/kernels tests/spec tests/models tests/engine}
has kernels && run bench_gdn_decode python3 -m benchmarks.bench_gdn_decode
has kernels && run bench_gdn_fused_decode python3 -m benchmarks.bench_gdn_fused_decode
has tree && run bench_tree_kernels python3 -m benchmarks.bench_tree_kernels
has moe && run bench_moe_experts python3 -m benchmarks.bench_moe_experts ${MOE_SWEEP:+--sweep} --out "$OUT/moe_experts.json"
# verify(N) / AR on the MoE target: a tree reads the union of its tokens' experts (the adaptive budget's cost).
has moe && run bench_verify_step_moe python3 -m benchmarks.bench_verify_step --target qwen3.5-35b-a3b \
  --ns 1 4 8 16 32 65 --out "$OUT/verify_step_moe.json"
# The MoE AR step against the bytes one token reads, and its speculative steps at every size the budget may take.
has moe && run bench_ar_decode_moe python3 -m benchmarks.bench_ar_decode --target qwen3.5-35b-a3b --contexts 1024 \
  --iters 50 --out "$OUT/ar_decode_moe.json"
has moe && run bench_spec_step_moe python3 -m benchmarks.bench_spec_step --target qwen3.5-35b-a3b \
  --budgets ${SPEC_BUDGETS:-8 16 32 64} --tfm-children-per-node 16 --steps 30 --out "$OUT/spec_step_moe.json"
has ar && run bench_ar_decode python3 -m benchmarks.bench_ar_decode --out "$OUT/ar_decode.json"
has verify && run bench_verify_step python3 -m benchmarks.bench_verify_step --ns ${VERIFY_NS:-1 16 65 129} \
  --out "$OUT/verify_step.json"
has draft && run bench_dflash_draft python3 -m benchmarks.bench_dflash_draft --profile
# The tree build first: it is the shorter of the two "spec" parts, and a call cut by its time limit still
# returns what ran.
has spec && run bench_tree_build python3 -m benchmarks.bench_tree_build --profile
# Every size the adaptive budget may take (the step-time table behind benchmarks/project_speedup.py).
has spec && run bench_spec_step python3 -m benchmarks.bench_spec_step --budgets ${SPEC_BUDGETS:-8 16 32 64 128} \
  --tfm-children-per-node 16 --tfm-round-units 16 8 --out "$OUT/spec_step.json"
has projections && run bench_projection_kernels python3 -m benchmarks.bench_projection_kernels
has profile && run profile_decode python3 -m benchmarks.profile_decode_step
(has profile || has profile_verify) && run profile_verify python3 -m benchmarks.profile_decode_step --verify-nodes 65
# FP8 targets: the FP8 kernel tests at 27B shapes, the kernel against BF16 cuBLAS, AR step and verify in FP8.
has fp8 && run fp8_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_matmul.py \
  tests/loading/test_fp8_checkpoints.py
has fp8 && run bench_fp8_linear python3 -m benchmarks.bench_fp8_linear --out "$OUT/fp8_linear.json"
has fp8_sweep && run sweep_fp8_linear python3 -m benchmarks.bench_fp8_linear --sweep --rows ${FP8_SWEEP_ROWS:-1 65} \
  --out "$OUT/fp8_sweep.json"
has fp8 && run bench_ar_decode_fp8 python3 -m benchmarks.bench_ar_decode --quantization fp8 --out "$OUT/ar_decode_fp8.json"
has fp8 && run bench_verify_step_fp8 python3 -m benchmarks.bench_verify_step --ns 1 16 65 --quantization fp8 \
  --out "$OUT/verify_step_fp8.json"
has fp8 && [ -n "${SMOL_GGUF:-}" ] && run fp8_agreement python3 -m benchmarks.fp8_agreement --target-path "$SMOL_GGUF" \
  --dataset-dir .stage/datasets --out "$OUT/fp8_agreement.json"
# Prompt prefill: the first prefill at a new length (what a request pays before its first token) and again.
has prefill && run bench_prefill_exact python3 -m benchmarks.bench_prefill --pad-to 1 --profile 517 \
  --out "$OUT/prefill_exact.json"
has prefill && run bench_prefill python3 -m benchmarks.bench_prefill --profile 517 --out "$OUT/prefill.json"
# Continuous batching, AR against each speculative algorithm, at concurrency 1 / 4 / 16 / 32 (SmolLM2 staged).
has batch && [ -n "${SMOL_GGUF:-}" ] && run batch_throughput python3 -m benchmarks.batch_throughput \
  --target-path "$SMOL_GGUF" --dataset-dir .stage/datasets --concurrency 1 4 16 32 --budget ${BATCH_BUDGET:-16} \
  --out "$OUT/batch_throughput.json"
has train && run bench_training_step python3 -m benchmarks.bench_training_step --profile --out "$OUT/training_step.json"
echo; cat "$OUT/summary.txt"
exit $status
