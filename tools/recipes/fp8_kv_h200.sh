#!/usr/bin/env bash
# An FP8 KV cache's values widened where they are loaded (MINISGL_FP8_V_WIDEN=first) against
# Triton's own order (last, the default), on the H200 (docs/benchmarks.md, "An FP8 KV
# cache's values, widened where they are loaded"). The knob is read once a process, when the
# kernels build, so every comparison here is of processes, alternated ROUNDS times (2):
#
#   OUT=/tmp/out bash tools/recipes/fp8_kv_h200.sh kernels    # from the repository root, ~4 min
#   OUT=/tmp/out bash tools/recipes/fp8_kv_h200.sh offline    # ~5 min
#   OUT=/tmp/out bash tools/recipes/fp8_kv_h200.sh step       # ~6 min
#
# kernels: tools/sweep_attention.py over e4m3 K/V at Qwen3-0.6B's heads (16 query, 8 KV, 128
#   channels): the fused decode at batch 256, 64 and 8 after 1,024 tokens and batch 1 after
#   4,096, under twelve launches each (Triton's default pipeline depth and 2 stages); and a
#   verify of 8 drafts (the split kernel, 9 rows a request) at batch 8 after 1,024 tokens.
# offline: nano-vllm's workload (256 requests, input and output U[100, 1024]) with
#   tools/bench_offline.py: bf16 K/V, then e4m3 last, then e4m3 first, ROUNDS times.
# step: tools/bench_latency.py's decode steps at batch 1, 8, 64 and 256 after 1,000 prompt
#   tokens, bf16 K/V and e4m3 both ways, ROUNDS times (the target: an e4m3 step at batch 256
#   1.8x faster than a bf16 one).
# Random weights in Qwen3-0.6B's shape, made once on the GPU (tools/make_random_model.py).
# Settings from the environment: PY, TOKENIZER_FROM (a folder with tokenizer files), WORK.
set -uo pipefail
PART=${1:?name a part: kernels, offline or step}
OUT=${OUT:?set OUT to a folder for the results}
PY=${PY:-python3}
ROUNDS=${ROUNDS:-2}
TOKENIZER_FROM=${TOKENIZER_FROM:-.gpu_tok}
WORK=${WORK:-/root}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$PART.log") 2>&1
echo "== $PART, $(date -u), $(git log -1 --format=%h 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
M=$WORK/q06
[ -f "$M/config.json" ] || $PY tools/make_random_model.py --shape qwen3-0.6b --out "$M" \
  --tokenizer-from "$TOKENIZER_FROM" --device cuda >/dev/null

case $PART in
  kernels)
    for r in $(seq "$ROUNDS"); do
      for w in last first; do
        echo "== round $r, MINISGL_FP8_V_WIDEN=$w ($SECONDS s)"
        MINISGL_FP8_V_WIDEN=$w timeout 300 $PY tools/sweep_attention.py --q-heads 16 \
          --kv-heads 8 --head-dim 128 --kv-dtypes fp8_e4m3 \
          --decode 256x1024,64x1024,8x1024,1x4096 --block-n 32,64,128 --warps 2,4 --stages 0,2 \
          --extend-lens "" --verify 8x1033x9 --verify-block-tokens 0 \
          --output-json "$OUT/sweep_${w}_$r.json" 2>&1 | grep -vE "^$|Warning|warn_once"
      done
    done
    ;;
  offline)
    for r in $(seq "$ROUNDS"); do
      for side in bf16:last fp8_e4m3:last fp8_e4m3:first; do
        kv=${side%%:*} w=${side#*:} flag=()
        [ "$kv" = fp8_e4m3 ] && flag=(--kv-cache-dtype fp8_e4m3)
        echo "== round $r, K/V $kv, MINISGL_FP8_V_WIDEN=$w ($SECONDS s)"
        MINISGL_FP8_V_WIDEN=$w timeout 300 $PY tools/bench_offline.py --model "$M" --device cuda \
          --skip-hf --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 \
          --max-output 1024 "${flag[@]}" 2>&1 |
          grep -E "^\\||rror"
      done
    done
    ;;
  step)
    for r in $(seq "$ROUNDS"); do
      for side in bf16:last fp8_e4m3:last fp8_e4m3:first; do
        kv=${side%%:*} w=${side#*:} flag=()
        [ "$kv" = fp8_e4m3 ] && flag=(--kv-cache-dtype fp8_e4m3)
        echo "== round $r, K/V $kv, MINISGL_FP8_V_WIDEN=$w ($SECONDS s)"
        MINISGL_FP8_V_WIDEN=$w timeout 300 $PY tools/bench_latency.py --model "$M" --device cuda \
          --skip-hf --skip-eager --batch-sizes 1,8,64,256 --input-len 1000 --output-len 64 \
          --step-tokens 32 "${flag[@]}" \
          --output-json "$OUT/step_${kv}_${w}_$r.json" 2>&1 | grep -E "^\||ms|rror"
      done
    done
    ;;
  *)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
echo "== done in ${SECONDS}s"
