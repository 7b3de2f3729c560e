#!/usr/bin/env bash
# A verify batch's attention, split over the keys (kernels/verify_attention.py) against the
# extend kernel, in one call (docs/benchmarks.md, "A verify's attention split over the keys"):
#
#   OUT=/tmp/out VERIFY_SHAPES= bash tools/recipes/verify_attention_h200.sh   # stage 1, ~5 min
#   OUT=/tmp/out SWEEP=0 bash tools/recipes/verify_attention_h200.sh          # stage 2, ~6 min
#
# 1. The kernels alone (tools/sweep_attention.py --verify), the heads of SmolLM2-135M (9/3 of
#    64), Qwen3-0.6B (16/8 of 128) and Qwen3-8B (32/8 of 128): 8 drafts a request (9 new
#    tokens) after contexts of 128, 512, 2,048 and 8,192 tokens at batch 1, 4 and 8, each
#    setting of the split kernel (new tokens a program: the run's 9 rounded up to 16, as the
#    engine takes them, or 8 or 4; keys a range at least) under a few launches, against the
#    extend kernel as the engine launches it; and the layer from qkv both ways (qk_rope_store
#    then the extend kernel, the engine's default, against verify_attention_qkv's one launch).
# 2. The verify step (tools/bench_verify_cost.py --variants): MINISGL_VERIFY_ATTN=extend
#    against split (VARIANTS), a fresh engine each in turn in one process (so both meet the
#    same host), ROUNDS (3) rounds, on the VERIFY_SHAPES (random weights, made on the GPU;
#    SmolLM2-135M's and Qwen3-8B's) after prompts of VERIFY_LENS tokens (128 and 2,048).
#
# TOKENIZER_FROM: a folder with SmolLM2's tokenizer files (prompts are random ids anyway).
set -u
OUT=${OUT:?set OUT to a folder for the results}
VERIFY_LENS=${VERIFY_LENS:-128 2048}
VERIFY_SHAPES=${VERIFY_SHAPES-smollm2-135m qwen3-8b}
SWEEP=${SWEEP:-1}
ROUNDS=${ROUNDS:-3}
VARIANTS=${VARIANTS:-extend:VERIFY_ATTN=extend;split:VERIFY_ATTN=split}
TOK=${TOKENIZER_FROM:-.gpu_tok}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"
log() { tee -a "$OUT/run.log"; }
git log -1 --format='commit %h %s' 2>/dev/null | log
nvidia-smi -L 2>/dev/null | log
if [ "$SWEEP" = 1 ]; then
  shapes=(9x3x64:smollm2 16x8x128:qwen3-0.6b 32x8x128:qwen3-8b)
  batches="1x137x9,1x521x9,1x2057x9,1x8201x9,4x521x9,4x2057x9,8x521x9,8x2057x9"
  for s in "${shapes[@]}"; do
    IFS=x read -r h kv d <<< "${s%%:*}"
    echo "== the kernels alone, ${s#*:}'s heads ($SECONDS s)" | log
    timeout 300 python3 tools/sweep_attention.py --q-heads "$h" --kv-heads "$kv" --head-dim "$d" \
        --kv-dtypes bfloat16 --decode "" --extend-lens "" --verify "$batches" \
        --verify-block-tokens 0,8,4 --block-n 32,64 --warps 2,4 --stages 0 --output-json "$OUT/sweep_${s#*:}.json" 2>&1 |
      grep -E "^==|^extend|^from qkv|^best|failed" | log
  done
fi
for shape in $VERIFY_SHAPES; do
  [ -d "/root/$shape" ] || python3 tools/make_random_model.py --shape "$shape" \
      --out "/root/$shape" --tokenizer-from "$TOK" --device cuda 2>&1 | tail -1 | log
  for len in $VERIFY_LENS; do
    echo "== verify steps, $shape, $len prompt tokens, $VARIANTS ($SECONDS s)" | log
    timeout 400 python3 tools/bench_verify_cost.py --model "/root/$shape" --ks 8 --batches 1,4 \
        --input-len "$len" --rounds "$ROUNDS" --variants "$VARIANTS" \
        --output-json "$OUT/verify_${shape}_$len.json" 2>&1 | grep -E "^\||^round|rror" | log
  done
done
echo "done at $SECONDS s" | log
