#!/usr/bin/env bash
# Settings of the few-row GEMV against each other, in one call (docs/benchmarks.md, "A few
# rows on the tensor cores"); by default MINISGL_GEMV_MAX_ROWS=1 against 16 (chapter 20's
# GEMV at 2-4 rows and the tensor cores' kernels/gemv_mma.py at 2-16, where the start-up
# measurement chose them):
#
#   OUT=/tmp/out bash tools/recipes/gemv_rows_h200.sh                 # repo root, ~8 min
#   OUT=/tmp/out SHAPES=qwen3-8b BATCHES=1,8 STARTS=0 bash tools/recipes/gemv_rows_h200.sh
#   OUT=/tmp/out KERNELS=smollm2-135m,qwen3-0.6b VERIFY=smollm2-135m \
#     VARIANTS="extend:VERIFY_ATTN=extend;split:VERIFY_ATTN=split" SHAPES="smollm2-135m qwen3-0.6b" \
#     BATCHES=1,2,4,8,16 STARTS=0 bash tools/recipes/gemv_rows_h200.sh   # any knobs, A/B
#
# 0. KERNELS (models of tools/bench_gemv.py, none by default): each projection at 2-16 rows,
#    every candidate of the start-up measurement (under the first variant's settings) timed
#    beside the library, and the sums of one decode step's projections.
# 1. For each shape of SHAPES (random weights, made on the GPU when missing): decode steps at
#    BATCHES, the VARIANTS in alternating rounds (tools/bench_latency.py --variants), each
#    engine measuring its own choice at its start.
# 2. VERIFY (shapes, none by default): a verify step of VERIFY_KS drafts (4,8) against a
#    decode step at VERIFY_BATCHES (1,4) after prompts of each of VERIFY_LENS tokens (128)
#    (tools/bench_verify_cost.py), one process a variant, VERIFY_ROUNDS times (2), ABAB.
# 3. What the settings cost a start: an engine on the first shape started from empty
#    Triton and kernel-choice caches (a fresh machine) and then warm, each variant STARTS
#    times (2; 0 skips the stage), alternating, with the kernel choice's and the engine's
#    time from their log lines.
#
# TOKENIZER_FROM: a folder with SmolLM2's tokenizer files (prompts are random ids anyway).
# A CPU dry run of stage 3: OUT=/tmp/o SHAPES= START_MODEL=models/tiny-llama bash ...
set -u
OUT=${OUT:?set OUT to a folder for the results}
SHAPES=${SHAPES-qwen3-0.6b llama-3.2-1b qwen3-8b}
BATCHES=${BATCHES:-1,2,4,8,16,64,256}
ROUNDS=${ROUNDS:-2}
VARIANTS=${VARIANTS:-r1:GEMV_MAX_ROWS=1;r16:GEMV_MAX_ROWS=16}
KERNELS=${KERNELS:-}
VERIFY=${VERIFY:-}
VERIFY_LENS=${VERIFY_LENS:-128}
VERIFY_KS=${VERIFY_KS:-4,8}
VERIFY_BATCHES=${VERIFY_BATCHES:-1,4}
VERIFY_ROUNDS=${VERIFY_ROUNDS:-2}
STARTS=${STARTS:-2}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-400}
TOKENIZER_FROM=${TOKENIZER_FROM:-.gpu_tok}
START_MODEL=${START_MODEL:-/root/${SHAPES%% *}}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
log() { tee -a "$OUT/run.log"; }
settings() {  # a variant's knobs as MINISGL_ assignments: "r1:GEMV_MAX_ROWS=1" -> MINISGL_GEMV_MAX_ROWS=1
  local knobs=${1#*:}
  echo "MINISGL_${knobs//,/ MINISGL_}"
}
git log -1 --format='commit %h %s' 2>/dev/null | log
nvidia-smi -L 2>/dev/null | log
IFS=';' read -ra variants <<< "$VARIANTS"
if [ -n "$KERNELS" ]; then
  echo "== each projection's candidates at 2-16 rows: $KERNELS ($SECONDS s)" | log
  env $(settings "${variants[0]}") timeout "$BENCH_TIMEOUT" python3 tools/bench_gemv.py \
      --models "$KERNELS" --rows 2,4,8,16 --normed \
      --reps 5 --output-json "$OUT/gemv.json" 2>&1 | grep -vE "^$|Warning" | log
fi
for shape in $SHAPES; do
  [ -d "/root/$shape" ] || python3 tools/make_random_model.py --shape "$shape" \
      --out "/root/$shape" --tokenizer-from "$TOKENIZER_FROM" --device cuda 2>&1 | tail -1 | log
  echo "== decode steps, $shape, $VARIANTS ($SECONDS s)" | log
  timeout "$BENCH_TIMEOUT" python3 tools/bench_latency.py --model "/root/$shape" --skip-hf --skip-eager \
      --batch-sizes "$BATCHES" --input-len 32 --output-len 64 --step-tokens 32 \
      --variants "$VARIANTS" --rounds "$ROUNDS" \
      --output-json "$OUT/rows_$shape.json" 2>&1 | grep -E "^\||ms/step|Error" | log
done
for shape in $VERIFY; do
  [ -d "/root/$shape" ] || python3 tools/make_random_model.py --shape "$shape" \
      --out "/root/$shape" --tokenizer-from "$TOKENIZER_FROM" --device cuda 2>&1 | tail -1 | log
  for len in $VERIFY_LENS; do
    for round in $(seq 1 "$VERIFY_ROUNDS"); do
      for variant in "${variants[@]}"; do
        echo "== verify steps, $shape, $len prompt tokens, ${variant%%:*}, round $round ($SECONDS s)" | log
        env $(settings "$variant") timeout "$BENCH_TIMEOUT" python3 tools/bench_verify_cost.py \
            --model "/root/$shape" --ks "$VERIFY_KS" --batches "$VERIFY_BATCHES" --input-len "$len" \
            --rounds 2 --output-json "$OUT/verify_${shape}_${len}_${variant%%:*}_$round.json" 2>&1 |
          grep -E "^\||Error" | log
      done
    done
  done
done
for i in $(seq 1 "$STARTS"); do
  for variant in "${variants[@]}"; do
    caches=$(mktemp -d)
    for state in fresh warm; do
      echo "== an engine's start, ${variant%%:*}, $state caches ($SECONDS s)" | log
      env $(settings "$variant") TRITON_CACHE_DIR=$caches/triton MINISGL_CACHE_DIR=$caches/minisgl \
          timeout 300 python3 - "$START_MODEL" <<'EOF' 2>&1 | grep -E "engine ready|kernel choice took|ready in|Error" | log
import logging
import sys
import time

logging.basicConfig(level=logging.INFO)
began = time.perf_counter()
from minisgl.llm import LLM  # noqa: E402 - the imports are part of the start

llm = LLM(sys.argv[1])
print(f"LLM ready in {time.perf_counter() - began:.1f} s")
llm.shutdown()
EOF
    done
    rm -rf "$caches"
  done
done
echo "done at $SECONDS s" | log
