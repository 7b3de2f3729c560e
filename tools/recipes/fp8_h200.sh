#!/usr/bin/env bash
# FP8 weights against bf16 on the H200 (docs/ch28_fp8.md, docs/benchmarks.md), in parts that
# each fit in one 10-minute call on a fresh machine. Random weights in Qwen3's shapes (speed
# does not depend on the values), made by tools/make_random_model.py; the FP8 runs quantise
# them on load (--quantization fp8), and the block-scaled run loads an FP8 copy made by
# tools/make_fp8_model.py as it is.
#
#   OUT=/tmp/out bash tools/recipes/fp8_h200.sh latency-0.6b   # from the repository root
#   OUT=/tmp/out bash tools/recipes/fp8_h200.sh offline-0.6b
#   OUT=/tmp/out bash tools/recipes/fp8_h200.sh latency-8b
#   OUT=/tmp/out bash tools/recipes/fp8_h200.sh checks
#
# latency-*: tools/bench_latency.py at batch 1, 2, 4, 8, 64 (CUDA graphs), bf16 then FP8
#   (0.6b: then the block-scaled folder too), and tools/bench_fp8.py kernels: each
#   projection shape in bf16, the FP8 GEMV and FP8 _scaled_mm, by rows (which FP8 path
#   should take which batch: quant/fp8.py's GEMV_MAX_ROWS).
# offline-0.6b: nano-vllm's workload (256 requests, input and output U[100, 1024]) with
#   tools/bench_offline.py, bf16 then FP8.
# checks: the chapter's tests on the GPU (the bf16 paths, cuBLAS's block recipe if this
#   torch has it) and, where models/SmolLM2-135M-Instruct was carried, greedy agreement.
# Everything lands in $OUT as <part>.log (and the latency runs' JSON). Settings from the
# environment: PY, TOKENIZER_FROM (a folder with tokenizer files), ATTN (default auto),
# WORK (where models are written; 64 GB of disk holds the 8B model and its FP8 copy).
set -euo pipefail
PART=${1:?name a part: latency-0.6b, offline-0.6b, latency-8b or checks}
OUT=${OUT:?set OUT to a folder for the results}
PY=${PY:-python3}
TOKENIZER_FROM=${TOKENIZER_FROM:-.gpu_tok}
ATTN=${ATTN:-auto}
WORK=${WORK:-/root/fp8}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/$PART.log
exec > >(tee -a "$LOG") 2>&1
echo "== $PART, $(date -u), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), torch $($PY -c 'import torch; print(torch.__version__)')"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader

model() {  # model SHAPE -> the folder, made once
  local dir=$WORK/$1
  [ -f "$dir/config.json" ] || $PY tools/make_random_model.py --shape "$1" --out "$dir" \
    --tokenizer-from "$TOKENIZER_FROM" --device cuda >&2
  echo "$dir"
}

latency() {  # latency MODEL TAG [flags]: ms per token / step at batch 1, 2, 4, 8, 64
  local m=$1 tag=$2
  shift 2
  echo -e "\n== bench_latency $tag $*"
  $PY tools/bench_latency.py --model "$m" --device cuda --attn "$ATTN" --skip-hf --skip-eager \
    --batch-sizes 1,2,4,8,64 --output-len 256 --step-tokens 64 \
    --output-json "$OUT/latency_$tag.json" "$@"
}

case $PART in
  latency-0.6b)
    M=$(model qwen3-0.6b)
    latency "$M" 0.6b_bf16
    latency "$M" 0.6b_fp8 --quantization fp8
    [ -f "$WORK/qwen3-0.6b-fp8/config.json" ] || $PY tools/make_fp8_model.py "$M" "$WORK/qwen3-0.6b-fp8" --device cuda
    latency "$WORK/qwen3-0.6b-fp8" 0.6b_fp8_blocks
    echo -e "\n== bench_fp8 kernels, Qwen3-0.6B shapes"
    $PY tools/bench_fp8.py kernels --model "$M" --layers 28 --sweep --rows 1,2,4,8
    $PY tools/bench_fp8.py kernels --model "$M" --layers 28 --rows 16,64
    ;;
  offline-0.6b)
    M=$(model qwen3-0.6b)
    for q in "" fp8; do
      echo -e "\n== bench_offline ${q:-bf16}, nano-vllm's workload"
      $PY tools/bench_offline.py --model "$M" --device cuda --attn "$ATTN" --skip-hf \
        --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 \
        ${q:+--quantization $q}
    done
    ;;
  latency-8b)
    M=$(model qwen3-8b)
    latency "$M" 8b_bf16
    latency "$M" 8b_fp8 --quantization fp8
    echo -e "\n== bench_fp8 kernels, Qwen3-8B shapes"
    $PY tools/bench_fp8.py kernels --model "$M" --rows 1,2,4,8,16,64
    ;;
  checks)
    $PY -m pytest -q tests/test_fp8.py -k "gpu or fp8_gemv or quantiser or scaled_mm" -rs
    if [ -f models/SmolLM2-135M-Instruct/config.json ]; then
      $PY tools/bench_fp8.py agreement --device cuda --dtype bfloat16
    fi
    ;;
  *)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
echo "== done in ${SECONDS}s"
