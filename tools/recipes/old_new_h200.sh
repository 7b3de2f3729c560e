#!/usr/bin/env bash
# Old against new on one H200, for a change that must not change speed: the same measuring
# code (the old tree's tools) over the two packages, in alternating processes (old, new, old,
# new), each a fresh engine, on random weights in published shapes.
#
#   git archive OLD_COMMIT minisgl tools tests | tar -x -C .ab/old      # here, once
#   OUT=/tmp/out OLD=.ab/old STAGES=tests,latency bash tools/recipes/old_new_h200.sh
#   OUT=/tmp/out OLD=.ab/old STAGES=offline bash tools/recipes/old_new_h200.sh
#
# tests: the GPU tests of the new package. latency: ms/token (32 in, 128 out) at BATCHES
# (1,8) on the SHAPES (Qwen3-0.6B and Llama-3.2-1B). offline: nano-vllm's workload on the
# Qwen3-0.6B shape.
# TOKENIZER_FROM: a folder with SmolLM2's tokenizer files (prompts are random ids anyway).
set -u
OUT=${OUT:?set OUT to a folder for the results}
OLD=$(cd "${OLD:?set OLD to a folder with the old package and its tools}" && pwd)
NEW=$PWD
TOK=${TOKENIZER_FROM:-.gpu_tok}
ROUNDS=${ROUNDS:-2}
STAGES=${STAGES:-tests,latency}
SHAPES=${SHAPES:-qwen3-0.6b,llama-3.2-1b}
BATCHES=${BATCHES:-1,8}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
log() { tee -a "$OUT/run.log"; }
git log -1 --format='new: %h %s' 2>/dev/null | log
nvidia-smi -L | log
for shape in ${SHAPES//,/ }; do
  [ -d "/root/$shape" ] || PYTHONPATH=$NEW python3 tools/make_random_model.py --shape "$shape" \
      --out "/root/$shape" --tokenizer-from "$TOK" --device cuda 2>&1 | tail -1 | log
done
side() {  # side NAME TOOL ARGS...: one process of the old or the new package
  local dir=$NEW
  [ "$1" = old ] && dir=$OLD
  PYTHONPATH=$dir python3 "$OLD/tools/$2" "${@:3}" 2>&1 | grep -v -E "^\[|it/s|Warning"
}
if [[ $STAGES == *tests* ]]; then
  PYTHONPATH=$NEW timeout 300 python3 -m pytest -q tests/test_gpu.py tests/test_kernel_choice.py \
      tests/test_ch28_fp8.py tests/test_fused_decode.py tests/test_elementwise.py tests/test_argmax.py \
      tests/test_rope_store.py -k "not smol and not SmolLM2" 2>&1 | tail -25 | log
fi
if [[ $STAGES == *latency* ]]; then
  for shape in ${SHAPES//,/ }; do
    for round in $(seq "$ROUNDS"); do
      for s in old new; do
        echo "== latency $shape round $round $s" | log
        side $s bench_latency.py --model "/root/$shape" --skip-hf --skip-eager --batch-sizes "$BATCHES" \
            --input-len 32 --output-len 128 | grep -E "^\| |ms/token|batch 1" | log
      done
    done
  done
fi
if [[ $STAGES == *offline* ]]; then
  for round in $(seq "$ROUNDS"); do
    for s in old new; do
      echo "== offline round $round $s" | log
      side $s bench_offline.py --model /root/qwen3-0.6b --num-seqs 256 --min-input 100 \
          --max-input 1024 --min-output 100 --max-output 1024 --skip-hf | tail -6 | log
    done
  done
fi
