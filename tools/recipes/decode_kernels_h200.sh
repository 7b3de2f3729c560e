#!/usr/bin/env bash
# The decode-step kernel comparisons of docs/benchmarks.md ("One decode layer, few kernels"):
# random weights in a published shape, the fused decode kernel's tests on the GPU, then the
# variants of MINISGL_FUSED_DECODE in alternating rounds (bench_latency.py
# --variants) and a profile of the step with each end of the comparison.
#
#   OUT=/tmp/out SHAPE=llama-3.2-1b bash tools/recipes/decode_kernels_h200.sh   # repo root
#
# TOKENIZER_FROM: a folder with SmolLM2's tokenizer files (prompts are random ids anyway).
set -u
OUT=${OUT:?set OUT to a folder for the results}
SHAPE=${SHAPE:-llama-3.2-1b}
MODEL=${MODEL:-/root/$SHAPE}
TOKENIZER_FROM=${TOKENIZER_FROM:-.gpu_tok}
IN_LEN=${IN_LEN:-32}
OUT_LEN=${OUT_LEN:-128}
BATCHES=${BATCHES:-1,8}
ROUNDS=${ROUNDS:-2}
VARIANTS=${VARIANTS:-"three:FUSED_DECODE=0;one:FUSED_DECODE=1"}
PROFILES=${PROFILES:-"FUSED_DECODE=0;FUSED_DECODE=1"}
TESTS=${TESTS:-1}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
git log -1 --format='commit %h %s' 2>/dev/null | tee "$OUT/run.log"
nvidia-smi -L | tee -a "$OUT/run.log"
[ -d "$MODEL" ] || python3 tools/make_random_model.py --shape "$SHAPE" --out "$MODEL" \
    --tokenizer-from "$TOKENIZER_FROM" --device cuda 2>&1 | tail -2 | tee -a "$OUT/run.log"
if [ "$TESTS" = 1 ]; then
  python3 -m pytest -q -x tests/test_fused_decode.py tests/test_argmax.py tests/test_gemv.py 2>&1 \
      | tail -25 | tee -a "$OUT/run.log"
fi
python3 tools/bench_latency.py --model "$MODEL" --skip-hf --skip-eager --input-len "$IN_LEN" \
    --output-len "$OUT_LEN" --batch-sizes "$BATCHES" --step-tokens 64 --variants "$VARIANTS" \
    --rounds "$ROUNDS" --output-json "$OUT/variants_$SHAPE.json" > "$OUT/bench_$SHAPE.log" 2>&1
grep -v -E "^\[|it/s|Warning" "$OUT/bench_$SHAPE.log" | tee -a "$OUT/run.log"
IFS=';' read -ra profs <<< "$PROFILES"
for prof in "${profs[@]}"; do
  envs=$(echo "$prof" | tr ',' '\n' | sed 's/^/MINISGL_/' | tr '\n' ' ')
  echo "== profile $envs" | tee -a "$OUT/run.log"
  env $envs python3 tools/profile_step.py --model "$MODEL" --input-len "$IN_LEN" --steps 32 \
      2>&1 | grep -v -E "^\[|it/s" | tail -40 | tee -a "$OUT/run.log"
done
