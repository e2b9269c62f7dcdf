#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct bundle (DFlash drafter + Weaver) and measure its τ, on the device machine.
# docs/TRAINING.md explains the pipeline; this script runs it in phases so each fits one device call, with the
# work directory $WORK kept on the (warm) machine between calls and everything worth keeping copied to $OUT.
#
#   PHASES="stage"        copy the carried GGUF parts .stage/smol/part_* to /tmp/smol (one call per part that
#                         does not fit beside the others: a call carries at most 64 MiB with the tree), the
#                         carried .stage/datasets and prompts to /tmp/stage (later calls need not carry them), and
#                         an earlier run's rows .stage/data/d*.jsonl if carried: gen keeps them and skips
#                         their prompts (or .stage/prev_rows.tar.gz, an earlier run's returned data.tar.gz)
#   PHASES="gen dflash"   join the GGUF, generate data, train the drafter (right after; carry the last part,
#                         plus .whl, .stage/prompts.jsonl[.gz] and .stage/datasets unless earlier calls of this
#                         machine installed / staged them)
#   PHASES="weaver tau"   train Weaver, measure τ (right after; nothing more to carry then; on a machine that
#                         went cold, stage again and carry a returned drafter as .stage/bundle/dflash, or
#                         name a drafter directory of the tree as WEAVER_DRAFTER)
# Sizes come from the environment (defaults: a small run; the bundle README has the committed bundle's calls);
# DEVICE=cpu runs it small here.
# DFLASH_INIT / WEAVER_INIT continue training from a saved drafter directory / Weaver file (e.g. the
# committed bundle under src/dflash_tfm/assets/smollm2_bundle), so training can span several calls.
# Only 8 files of at most 16 MiB come back from a device call, so results collect in $WORK/out and are packed
# into $OUT/results.tar.gz at exit, with the drafter's weights beside it in 15 MiB parts
# ($OUT/model.safetensors.part_*; `cat` them back together) and the generated rows as $OUT/data.tar.gz when that
# fits in one returned file.
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL_OUT=${OUT:-out}; mkdir -p "$FINAL_OUT"
PHASES=${PHASES:-"gen dflash weaver tau"}
WORK=${WORK:-/tmp/bundle_work}; mkdir -p "$WORK/data" "$WORK/bundle"
OUT=$WORK/out; mkdir -p "$OUT"
pack() {
  tar czf "$FINAL_OUT/results.tar.gz" --exclude=model.safetensors -C "$OUT" .
  [ -f "$OUT/bundle/dflash/model.safetensors" ] && split -b 15M "$OUT/bundle/dflash/model.safetensors" \
    "$FINAL_OUT/model.safetensors.part_"
  return 0
}
trap pack EXIT
GGUF=${GGUF:-/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf}
DEVICE=${DEVICE:-cuda}
GEN_PROCS=${GEN_PROCS:-3}           # shards (2 greedy, 1 sampled), each a batched generator
GEN_BATCH=${GEN_BATCH:-256}
GEN_SECONDS=${GEN_SECONDS:-240}     # wall-clock cap for data generation; rows are flushed one by one
GEN_LIMIT=${GEN_LIMIT:-30000}  # prompts (all shards): the whole staged mixture (21,574) in ~3 minutes
GEN_TOKENS=${GEN_TOKENS:-256}
GEN_EXTRA_SAMPLES=${GEN_EXTRA_SAMPLES:-0}  # more T = 1 samples per prompt of GEN_EXTRA_SOURCES (ids key#t1sJ)
GEN_EXTRA_SOURCES=${GEN_EXTRA_SOURCES:-gsm8k_train}
DFLASH_MINUTES=${DFLASH_MINUTES:-4.5}
DFLASH_STEPS=${DFLASH_STEPS:-4000}
DFLASH_BATCH=${DFLASH_BATCH:-16}
DFLASH_LAYERS=${DFLASH_LAYERS:-}      # default 2 (or DFLASH_INIT's count); more grows DFLASH_INIT (new layers start as no-ops)
DFLASH_DISTILL=${DFLASH_DISTILL:-}    # 1: soft labels (the target's next-token distributions) instead of the data's tokens
DFLASH_SCHEDULE=${DFLASH_SCHEDULE:-cosine}  # constant here + cosine in the next call (DFLASH_INIT=it) = one WSD cycle
WEAVER_MINUTES=${WEAVER_MINUTES:-3}
WEAVER_STEPS=${WEAVER_STEPS:-20000}
WEAVER_DRAFTER=${WEAVER_DRAFTER:-.stage/bundle/dflash}  # the frozen drafter when this call trained none
WEAVER_SAVE_DTYPE=${WEAVER_SAVE_DTYPE:-float32}  # bfloat16 halves weaver.pth (room for a larger drafter)
TAU_PROMPTS=${TAU_PROMPTS:-20}
TAU_TOKENS=${TAU_TOKENS:-256}
TAU_SECONDS=${TAU_SECONDS:-240}
TAU_DATASETS=${TAU_DATASETS:-"mtbench humaneval gsm8k math500"}
TAU_TEMPS=${TAU_TEMPS:-"0 1"}
TAU_BUDGETS=${TAU_BUDGETS:-"64 32 16"}
TAU_ALGORITHMS=${TAU_ALGORITHMS:-"DFLASH DDTREE DFLASH_TFM"}
# ';' splits the budgets into sets measured by parallel processes (e.g. "64;32 16": 16 processes, one call);
# the chain (DFLASH, budget-free) runs only with the first set.
TAU_BUDGET_SETS=${TAU_BUDGET_SETS:-$TAU_BUDGETS}
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-15}
# Dozens of short-lived processes share 16 cores: compiling the fused helpers in each would cost more than it
# saves (τ does not depend on it; tok/s from these contended runs is not a speed measurement anyway).
export DFLASH_TFM_COMPILE=0
# Wheels: installed from a carried .whl/, or already installed by an earlier call on this (warm) machine.
if [ "$DEVICE" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
if [ "$DEVICE" = cuda ] && [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:src:.; else export PYTHONPATH=src:.; fi
PY=${PY:-python3}
t0=$SECONDS
say() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$OUT/train_bundle.txt"; }

staged() {  # a carried .stage/ item, else the copy a stage call of this (warm) machine left in /tmp/stage
  if [ -e ".stage/$1" ]; then echo ".stage/$1"; else echo "/tmp/stage/$1"; fi
}

if [[ $PHASES == *stage* ]]; then
  mkdir -p /tmp/smol && cp .stage/smol/part_* /tmp/smol/ 2>/dev/null && say "staged $(ls .stage/smol)"
  for item in datasets prompts.jsonl prompts.jsonl.gz; do  # so later calls need not carry them
    [ -e ".stage/$item" ] && mkdir -p /tmp/stage && cp -r ".stage/$item" /tmp/stage/ && say "staged $item"
  done
  if ls .stage/data/d*.jsonl >/dev/null 2>&1; then
    mkdir -p "$WORK/prev_data" && cp .stage/data/d*.jsonl "$WORK/prev_data/" && say "staged $(ls .stage/data)"
  fi
  if [ -f .stage/prev_rows.tar.gz ]; then  # an earlier run's data.tar.gz (its rows compress ~5x: they fit a call)
    mkdir -p "$WORK/prev_data" && tar xzf .stage/prev_rows.tar.gz -C "$WORK/prev_data" --strip-components=1 \
      --wildcards '*.jsonl' && say "staged $(ls "$WORK/prev_data" | wc -l) row files from prev_rows.tar.gz"
  fi
fi
join_gguf() {  # the parts staged by earlier calls plus any carried now, in name order
  [ -f "$GGUF" ] && return 0
  mkdir -p /tmp/smol && cp .stage/smol/part_* /tmp/smol/ 2>/dev/null
  cat /tmp/smol/part_* > "$GGUF.tmp" || { say "cannot join the GGUF"; exit 1; }
  # A part missing (a staging call that landed on a fresh machine) leaves no GGUF header: stop, keep no file.
  [ "$(head -c 4 "$GGUF.tmp")" = GGUF ] || { rm -f "$GGUF.tmp"; say "GGUF parts missing: have $(ls /tmp/smol)"; exit 1; }
  mv "$GGUF.tmp" "$GGUF"
  sha256sum "$GGUF" | tee -a "$OUT/train_bundle.txt"
}

if [[ $PHASES == *gen* ]]; then
  join_gguf
  $PY -c "from dflash_tfm.loading.gguf_file import load_gguf_tokenizer as t; t('$GGUF')"  # convert once, cached
  # The batched decode runs as CUDA graphs. Their GPU test runs beside the generation (it took 80 s before it,
  # 4 % of a session's device time); if it fails, this call's new rows are set aside, never trained on.
  if [ "$DEVICE" = cuda ]; then
    ( $PY -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_cuda_speculative_graphs.py -k batched_generation \
        > "$OUT/gen_graph_test.log" 2>&1; echo $? > "$WORK/gen_graph_test.rc" ) &
  fi
  prev=()  # an earlier run's rows (stage phase): kept as data, their prompts not generated again
  for f in "$WORK"/prev_data/d*.jsonl; do
    [ -f "$f" ] && cp "$f" "$WORK/data/dprev_$(basename "$f")" && prev+=("$f")
  done
  prompts=$(staged prompts.jsonl)  # or gzipped, so more prompts fit beside a GGUF part
  gz=$(staged prompts.jsonl.gz)
  [ -f "$gz" ] && gunzip -c "$gz" > "$WORK/prompts.jsonl" && prompts=$WORK/prompts.jsonl
  say "gen: $GEN_PROCS shards + $GEN_EXTRA_SAMPLES extra samples of $GEN_EXTRA_SOURCES, $GEN_BATCH sequences each, at most ${GEN_SECONDS} s, ${#prev[@]} earlier files kept"
  for i in $(seq 0 $((GEN_PROCS - 1))); do
    temp=0.0; [ "$i" -ge $((GEN_PROCS * 2 / 3)) ] && temp=1.0  # a third of the rows sampled at T = 1
    timeout "$GEN_SECONDS" $PY -m dflash_tfm.train.data --model-path "$GGUF" --prompts-file "$prompts" \
      --out "$WORK/data/d$i.jsonl" --limit "$GEN_LIMIT" --num-shards "$GEN_PROCS" --shard-index "$i" \
      --batch-size "$GEN_BATCH" --max-new-tokens "$GEN_TOKENS" --temperature "$temp" --seed "$i" \
      --device "$DEVICE" --max-model-len 1536 ${prev[@]:+--skip-ids-in "${prev[@]}"} \
      > "$OUT/gen_$i.log" 2>&1 &
  done
  for j in $(seq 1 "$GEN_EXTRA_SAMPLES"); do
    timeout "$GEN_SECONDS" $PY -m dflash_tfm.train.data --model-path "$GGUF" --prompts-file "$prompts" \
      --sources $GEN_EXTRA_SOURCES --id-suffix "#t1s$j" --out "$WORK/data/d_extra$j.jsonl" --limit "$GEN_LIMIT" \
      --batch-size "$GEN_BATCH" --max-new-tokens "$GEN_TOKENS" --temperature 1.0 --seed $((100 + j)) \
      --device "$DEVICE" --max-model-len 1536 > "$OUT/gen_extra$j.log" 2>&1 &
  done
  wait
  if [ "$DEVICE" = cuda ] && [ "$(cat "$WORK/gen_graph_test.rc" 2>/dev/null)" != 0 ]; then
    mkdir -p "$WORK/suspect" && mv "$WORK"/data/d[0-9]*.jsonl "$WORK"/data/d_extra*.jsonl "$WORK/suspect/" 2>/dev/null
    say "gen: the graph decode test failed (gen_graph_test.log): this call's rows moved to $WORK/suspect, stopping"
    exit 1
  fi
  $PY -c "import sys; from pathlib import Path; from dflash_tfm.train.data import existing_ids
print(sum(len(existing_ids(p)) for p in sorted(Path(sys.argv[1]).glob('d*.jsonl'))), 'rows')" "$WORK/data" \
    | tee -a "$OUT/train_bundle.txt"  # also drops a last row cut off by the timeout
  # The rows come back beside the results when they fit one returned file (16 MiB), for a later run to reuse.
  tar czf "$FINAL_OUT/data.tar.gz" -C "$WORK" data
  [ "$(stat -c %s "$FINAL_OUT/data.tar.gz")" -le 16000000 ] || { rm "$FINAL_OUT/data.tar.gz"; say "data too big to return"; }
  say "gen done"
fi

use_staged_data() {  # when gen did not run now: rows of an earlier run, staged (stage phase) or carried in .stage/data
  ls "$WORK"/data/d*.jsonl >/dev/null 2>&1 && return 0
  if ls "$WORK"/prev_data/d*.jsonl >/dev/null 2>&1; then cp "$WORK"/prev_data/d*.jsonl "$WORK/data/"
  else cp .stage/data/d*.jsonl "$WORK/data/"; fi
}

if [[ $PHASES == *dflash* ]]; then
  use_staged_data
  join_gguf
  $PY -m dflash_tfm.train.dflash_trainer --model-path "$GGUF" --data "$WORK"/data/d*.jsonl --out "$WORK/bundle/dflash" \
    ${DFLASH_LAYERS:+--num-layers "$DFLASH_LAYERS"} ${DFLASH_DISTILL:+--distill} --target-layer-ids 1 14 27 --steps "$DFLASH_STEPS" --batch-size "$DFLASH_BATCH" --anchors-per-seq 64 \
    --max-len 768 --lr 6e-4 --schedule "$DFLASH_SCHEDULE" --time-budget-minutes "$DFLASH_MINUTES" --device "$DEVICE" \
    ${DFLASH_INIT:+--init-from "$DFLASH_INIT"} 2>&1 | tee "$OUT/train_dflash.log"
  mkdir -p "$OUT/bundle" && cp -r "$WORK/bundle/dflash" "$OUT/bundle/"
  say "dflash done"
fi

if [[ $PHASES == *weaver* ]]; then
  use_staged_data
  [ -f "$WORK/bundle/dflash/config.json" ] || cp -r "$WEAVER_DRAFTER" "$WORK/bundle/dflash"
  join_gguf
  $PY -m dflash_tfm.train.weaver_trainer --model-path "$GGUF" --draft-model-path "$WORK/bundle/dflash" \
    --data "$WORK"/data/d*.jsonl --out "$WORK/bundle/weaver.pth" --steps "$WEAVER_STEPS" --batch-size 32 \
    --positions-per-row 4 --lr 1e-3 --schedule wsd --d-rank 384 --num-heads 6 --mlp-dim 1024 --pool-size 512 \
    --eval-every 500 --time-budget-minutes "$WEAVER_MINUTES" --device "$DEVICE" --save-dtype "$WEAVER_SAVE_DTYPE" \
    ${WEAVER_INIT:+--init-from "$WEAVER_INIT"} 2>&1 | tee "$OUT/train_weaver.log"
  mkdir -p "$OUT/bundle" && cp "$WORK/bundle/weaver.pth" "$WORK/bundle/weaver.pth.json" "$OUT/bundle/"
  say "weaver done"
fi

if [[ $PHASES == *tau* ]]; then
  # One process per dataset, temperature and budget set, 2 threads each (32 processes, one per cell, spent the
  # whole 240 s loading weights on 16 cores; 8 worked). A set's budgets run in sequence; every finished cell is written.
  join_gguf
  [ -d "$WORK/bundle/dflash" ] || cp -r "${TAU_BUNDLE:-src/dflash_tfm/assets/smollm2_bundle}/." "$WORK/bundle/"
  say "tau: datasets ($TAU_DATASETS), temperatures ($TAU_TEMPS), budget sets ($TAU_BUDGET_SETS), at most ${TAU_SECONDS} s"
  mkdir -p "$OUT/tau"
  IFS=';' read -ra budget_sets <<< "$TAU_BUDGET_SETS"
  for ds in $TAU_DATASETS; do
    for temp in $TAU_TEMPS; do
      algorithms=$TAU_ALGORITHMS
      for budgets in "${budget_sets[@]}"; do
        [ -n "${algorithms// }" ] || continue
        name=${ds}_t${temp}_b$(echo $budgets | tr ' ' _)
        OMP_NUM_THREADS=2 timeout "$TAU_SECONDS" $PY -m benchmarks.measure_acceptance --target-path "$GGUF" \
          --bundle "$WORK/bundle" --datasets "$ds" --dataset-dir "$(staged datasets)" --prompts-per-dataset "$TAU_PROMPTS" \
          --max-new-tokens "$TAU_TOKENS" --temperatures "$temp" --budgets $budgets --algorithms $algorithms \
          --device "$DEVICE" --out "$OUT/tau/$name.jsonl" > "$OUT/tau/$name.log" 2>&1 &
        algorithms=$(echo " $algorithms " | sed 's/ DFLASH / /')  # the chain once per dataset and temperature
      done
    done
  done
  wait
  cat "$OUT"/tau/*.jsonl 2>/dev/null | wc -l | xargs echo "tau cells:" | tee -a "$OUT/train_bundle.txt"
  say "tau done"
fi
