#!/usr/bin/env bash
# The models of 2026 on one H200, in one call: random weights in the published shapes of
# Qwen3.5 (0.8B, 9B) and Gemma 4 (E4B, 31B with fewer layers), bf16, the engine's defaults.
#
#   OUT=/tmp/out bash tools/recipes/new_models_h200.sh                      # every stage
#   OUT=/tmp/out STAGES=latency SHAPES=qwen3.5-0.8b bash tools/recipes/new_models_h200.sh
#
# latency: batch-1 ms/token (32 in, 128 out) and the steps at batch 8/64/256.
# offline: nano-vllm's workload (256 sequences, 100-1024 in and out), with where its steps went.
# prefill: one prompt of 32K tokens, the linear layers' recurrence in one pass and in two.
# kernels: the linear layers' torch path against our Triton kernels (tools/bench_gated_delta.py),
#          where that tool is present.
# checks:  speculation on the 0.8B shape with drafts from a plain run's output, verify graphs
#          replayed on the GPU: in float32 the tokens must equal the plain run's
#          (tools/check_hybrid_speculation.py); in bf16, how many do.
# verify:  a verify step against a decode step on the Qwen3.5 shapes (tools/bench_verify_cost.py,
#          drafts of 1, 4 and 8 at batch 1 and 8) with its host timeline.
# gemma4rope: Gemma 4's head norms and rotary in torch against one kernel a tensor
#          (MINISGL_GEMMA4_ROPE), alternating, at batch 1-256 (not in the default stages).
# gemma4attn: the split-KV decode's launches swept at Gemma-4-E4B's heads (8 query, 2 KV):
#          sliding layers (256 wide, a 512-token window) and global ones (512 wide), at
#          batch 128 and 256 (tools/sweep_attention.py --kernel split; not a default stage).
# gdregs:  the linear layers' fused decode kernel with its registers capped at 128 a thread
#          (MINISGL_GATED_DELTA_REGISTERS, the default: two programs an SM) against the
#          compiler's choice: the kernel alone at batch 1-256, then the 0.8B's steps and
#          nano-vllm's workload, alternating (not a default stage).
# GEMMA4_31B_LAYERS: 31B's 60 layers are 62 GB, too much for the machine's disk beside the
# others; it is measured with this many layers (every layer its real shape) and the time per
# token scaled by 60 / layers, which the log says.
# TOKENIZER_FROM: a folder with SmolLM2's tokenizer files (prompts are random ids anyway).
set -u
OUT=${OUT:?set OUT to a folder for the results}
TOK=${TOKENIZER_FROM:-.gpu_tok}
STAGES=${STAGES:-checks,latency,offline,prefill,kernels,verify}
SHAPES=${SHAPES:-qwen3.5-0.8b,qwen3.5-9b,gemma4-e4b,gemma4-31b}
L31=${GEMMA4_31B_LAYERS:-16}
# The GPU machine lacks pyzmq and setproctitle (and fla-core, which the kernels stage
# compares with): carry their wheels in .whl (`pip download` for cp312 manylinux).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT"
log() { tee -a "$OUT/run.log"; }
git log -1 --format='commit: %h %s' 2>/dev/null | log
nvidia-smi -L | log
for shape in ${SHAPES//,/ }; do
  layers=()
  [ "$shape" = gemma4-31b ] && layers=(--num-layers "$L31") && echo "gemma4-31b: $L31 of 60 layers" | log
  [ -d "/root/$shape" ] || python3 tools/make_random_model.py --shape "$shape" "${layers[@]}" \
      --out "/root/$shape" --tokenizer-from "$TOK" --device cuda 2>&1 | tail -1 | log
done
if [[ $STAGES == *checks* && ,$SHAPES, == *,qwen3.5-0.8b,* ]]; then
  for dtype in float32 bfloat16; do
    echo "== checks: hybrid speculation, $dtype" | log
    timeout 300 python3 tools/check_hybrid_speculation.py --model /root/qwen3.5-0.8b \
        --dtype "$dtype" 2>&1 | grep -vE "INFO|WARN" | tail -4 | log
  done
fi
if [[ $STAGES == *latency* ]]; then
  for shape in ${SHAPES//,/ }; do
    echo "== latency $shape" | log
    timeout 400 python3 tools/bench_latency.py --model "/root/$shape" --skip-hf --skip-eager \
        --batch-sizes 1,8,64,256 --input-len 32 --output-len 128 2>&1 \
        | grep -E "^\| |ms/token|batch 1|Error|error" | log
  done
fi
if [[ $STAGES == *offline* ]]; then
  for shape in qwen3.5-0.8b gemma4-e4b; do
    [[ ,$SHAPES, == *,$shape,* ]] || continue
    echo "== offline $shape" | log
    timeout 400 python3 tools/bench_offline.py --model "/root/$shape" --num-seqs 256 --min-input 100 \
        --max-input 1024 --min-output 100 --max-output 1024 --skip-hf --steps 2>&1 \
        | grep -E "^\||last step|Triton in|Error|error" | log
  done
fi
if [[ $STAGES == *prefill* ]]; then
  for shape in qwen3.5-0.8b; do
    [[ ,$SHAPES, == *,$shape,* ]] || continue
    for rule in one-pass two-pass; do  # the linear layers' prefill recurrence, both ways
      echo "== prefill $shape 32K, MINISGL_GATED_DELTA_PREFILL=$rule" | log
      MINISGL_GATED_DELTA_PREFILL=$rule timeout 300 python3 tools/bench_prefill.py \
          --model "/root/$shape" --modes off --lengths 32768 --peak-tokens 32768 --repeat 3 \
          --warmup 1 2>&1 | tail -8 | log
    done
  done
fi
if [[ $STAGES == *kernels* && -f tools/bench_gated_delta.py ]]; then
  echo "== gated delta kernels" | log
  timeout 400 python3 tools/bench_gated_delta.py --prefill 1x4096,8x512,1x32768 2>&1 \
      | tail -48 | log
fi
if [[ $STAGES == *verify* ]]; then
  for shape in qwen3.5-0.8b qwen3.5-9b; do
    [[ ,$SHAPES, == *,$shape,* ]] || continue
    echo "== verify cost $shape" | log
    timeout 400 python3 tools/bench_verify_cost.py --model "/root/$shape" --ks 1,4,8 \
        --batches 1,8 --rounds 1 --input-len 128 2>&1 | grep -E "^\||Error|error" | log
  done
fi
if [[ $STAGES == *gemma4rope* ]]; then
  for shape in gemma4-e4b gemma4-31b; do
    [[ ,$SHAPES, == *,$shape,* ]] || continue
    echo "== gemma4 head kernel $shape" | log
    timeout 400 python3 tools/bench_latency.py --model "/root/$shape" --skip-hf --skip-eager \
        --batch-sizes 1,8,64,256 --input-len 32 --output-len 64 --rounds 2 \
        --variants "torch:GEMMA4_ROPE=torch;triton:GEMMA4_ROPE=triton" 2>&1 \
        | grep -E "^\| |Error|error" | log
  done
fi
if [[ $STAGES == *gemma4attn* ]]; then
  for spec in "256 512" "512 0"; do
    set -- $spec
    window=(); [ "$2" != 0 ] && window=(--window "$2")
    echo "== split-KV decode launches, head_dim $1, window $2" | log
    timeout 300 python3 tools/sweep_attention.py --kernel split --q-heads 8 --kv-heads 2 \
        --head-dim "$1" "${window[@]}" --kv-dtypes bfloat16 --decode 128x1024,256x1024 \
        --extend-lens "" 2>&1 | grep -E "^\||==|best|failed" | log
  done
fi
if [[ $STAGES == *gdregs* ]]; then
  echo "== gated delta decode, registers capped" | log
  timeout 300 python3 tools/bench_gated_delta.py --models 0.8b,9b --decode 1,8,64,256 \
      --prefill "" --fused-registers 0 --rounds 5 2>&1 | grep -E "^\||rror" | log
  if [[ ,$SHAPES, == *,qwen3.5-0.8b,* ]]; then
    echo "== qwen3.5-0.8b steps, registers capped" | log
    timeout 400 python3 tools/bench_latency.py --model /root/qwen3.5-0.8b --skip-hf --skip-eager \
        --batch-sizes 1,8,64,256 --input-len 32 --output-len 64 --rounds 2 \
        --variants "plain:GATED_DELTA_REGISTERS=0;capped:GATED_DELTA_REGISTERS=128" 2>&1 \
        | grep -E "^\| |Error|error" | log
    for round in 1 2; do
      for cap in 0 128; do
        echo "== offline qwen3.5-0.8b, MINISGL_GATED_DELTA_REGISTERS=$cap, round $round" | log
        MINISGL_GATED_DELTA_REGISTERS=$cap timeout 300 python3 tools/bench_offline.py \
            --model /root/qwen3.5-0.8b --num-seqs 256 --min-input 100 --max-input 1024 \
            --min-output 100 --max-output 1024 --skip-hf 2>&1 | grep -E "^\\||rror" | log
      done
    done
  fi
fi
