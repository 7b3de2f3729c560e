#!/usr/bin/env bash
# What a verify step costs on one H200, and whether speculation pays on prompts nobody tuned
# on (docs/ch26_speculative.md, "Batches larger than one"), in three stages, each one call:
#
#   OUT=/tmp/out STAGES=curve-smol,curve-8b bash tools/recipes/speculative_h200.sh   # ~6 min
#   OUT=/tmp/out STAGES=heldout bash tools/recipes/speculative_h200.sh               # ~5 min
#   OUT=/tmp/out STAGES=gemv-rows bash tools/recipes/speculative_h200.sh             # ~4 min
#
# curve-smol, curve-8b: tools/bench_verify_cost.py on SmolLM2-135M-Instruct (real weights)
#        and on random weights in Qwen3-8B's shape (made first, on the GPU): forced drafts of
#        k = 1, 2, 4, 8, 16 random tokens a request at batch 1, 2, 4 and 8, verify steps
#        against decode steps in alternating runs, a verify among decode steps (the pipeline
#        it drains and refills) beside the engine's own estimate, the host's timeline of each
#        step and the kernel table; and verifies launched ahead of the one before them, their
#        drafts the plain run's own tokens.
# heldout: tools/bench_speculative.py --sets heldout at batch 1, 4 and 8, n-gram and suffix
#        drafts, each against speculation off in one engine, warmed, runs alternating; with
#        the default --speculative-max-bs (8), so the measured costs decide at batch 4 and 8;
#        then suffix drafts again with verifies launched ahead off (MINISGL_SPECULATIVE_AHEAD).
#        HELDOUT_RUNS ("ngram:on suffix:on suffix:off", mode:ahead[:behind], behind off unless
#        given: MINISGL_SPECULATIVE_BEHIND) and HELDOUT_BATCHES (1,4,8) pick others or fewer.
# behind: a verify among decode steps, the pipeline drained before it against the verify
#        launched behind the plain step in flight (MINISGL_SPECULATIVE_BEHIND off / on), at
#        8 drafts, batch 1 and 4, fresh engines alternated (bench_verify_cost.py --variants).
#
# gemv-rows: verifies of 4 and 8 drafts at batch 1 and 4 with the GEMV allowed up to 16 rows
#        (MINISGL_GEMV_MAX_ROWS=16: chapter 20's GEMV or the tensor cores' kernels/gemv_mma.py
#        where the start-up measurement chose them, their norms and SiLU fused) against the
#        default (1: the library's matmuls and separate norms), alternated twice; then the
#        decode step at batch 1-16 both ways (tools/bench_latency.py --variants, ABAB).
# SMOL: a folder with SmolLM2's real weights (tools/recipes/smollm2_parts.sh brings them in
# two calls: the GGUF in two halves, joined there and converted); without it the SmolLM2
# runs are skipped and said so. TOKENIZER_FROM: tokenizer files for the random 8B model
# (SMOL's, else .gpu_tok). COST_ARGS, SPEC_ARGS: more flags for the two tools (a CPU dry
# run: SMOL=models/tiny-llama BIG=models/tiny-qwen3 COST_ARGS="--steps 4 --rounds 1"
# SPEC_ARGS=--smoke). Everything lands in $OUT/run.log, the tables' JSON beside it.
set -u
OUT=${OUT:?set OUT to a folder for the results}
STAGES=${STAGES:-curve-smol,curve-8b,heldout}
SMOL=${SMOL:-/root/SmolLM2-135M-Instruct}
BIG=${BIG:-/root/qwen3-8b}
TOK=${TOKENIZER_FROM:-$SMOL}
[ -f "$TOK/tokenizer.json" ] || TOK=.gpu_tok
KS=${KS:-1,2,4,8,16}
BATCHES=${BATCHES:-1,2,4,8}
PAIRS=${PAIRS:-3}
COST_ARGS=${COST_ARGS:-}
SPEC_ARGS=${SPEC_ARGS:-}
# The GPU machine lacks pyzmq and setproctitle (minisgl.llm imports them): carry their wheels
# in .whl, as tools/recipes/new_models_h200.sh does.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT"
log() { tee -a "$OUT/run.log"; }
git log -1 --format='commit: %h %s' 2>/dev/null | log
nvidia-smi -L 2>/dev/null | log
date -u '+%F %T UTC' | log
smol() {
  if [ -f "$SMOL/config.json" ]; then return 0; fi
  echo "no SmolLM2 weights at $SMOL: its runs are skipped" | log
  return 1
}
cost() {  # model, name
  echo "== verify cost: $2" | log
  # shellcheck disable=SC2086
  timeout 250 python3 tools/bench_verify_cost.py --model "$1" --ks "$KS" --batches "$BATCHES" \
      --profile --output-json "$OUT/verify_cost_$2.json" $COST_ARGS 2>&1 \
      | grep -v -E "^\[|it/s|USDT" | log
}
if [[ $STAGES == *curve-smol* ]] && smol; then
  cost "$SMOL" smollm2
fi
if [[ $STAGES == *curve-8b* ]]; then
  [ -d "$BIG" ] || timeout 150 python3 tools/make_random_model.py --shape qwen3-8b --out "$BIG" \
      --tokenizer-from "$TOK" --device cuda 2>&1 | tail -1 | log
  cost "$BIG" qwen3_8b
fi
if [[ $STAGES == *behind* ]] && smol; then
  echo "== a verify among decode steps: drained first against launched behind" | log
  # shellcheck disable=SC2086
  timeout 300 python3 tools/bench_verify_cost.py --model "$SMOL" --ks 8 --batches 1,4 \
      --input-len 128 --rounds 2 --variants "drain:SPECULATIVE_BEHIND=off;behind:SPECULATIVE_BEHIND=on" \
      --output-json "$OUT/behind.json" $COST_ARGS 2>&1 | grep -v -E "^\[|it/s|USDT" | log
fi
if [[ $STAGES == *heldout* ]] && smol; then
  for run in ${HELDOUT_RUNS:-ngram:on suffix:on suffix:off}; do
    IFS=: read -r mode ahead behind <<< "$run"
    behind=${behind:-off}
    echo "== held-out sets, $mode against off, verifies ahead $ahead, behind $behind" | log
    # shellcheck disable=SC2086
    MINISGL_SPECULATIVE_AHEAD=$ahead MINISGL_SPECULATIVE_BEHIND=$behind timeout 270 python3 \
        tools/bench_speculative.py --model "$SMOL" --speculative "$mode" --sets heldout \
        --batches "${HELDOUT_BATCHES:-1,4,8}" --pairs "$PAIRS" \
        --output-json "$OUT/heldout_${mode}_${ahead}_$behind.json" $SPEC_ARGS 2>&1 \
        | grep -E "^\||alternating|Error|error" | log
  done
fi
if [[ $STAGES == *gemv-rows* ]] && smol; then
  for rows in 1 16 1 16; do
    echo "== verifies of 4 and 8 drafts, MINISGL_GEMV_MAX_ROWS=$rows" | log
    # shellcheck disable=SC2086
    MINISGL_GEMV_MAX_ROWS=$rows timeout 200 python3 tools/bench_verify_cost.py --model "$SMOL" \
        --ks 4,8 --batches 1,4 --input-len 128 --rounds 2 \
        --output-json "$OUT/gemv_rows_${rows}_$SECONDS.json" $COST_ARGS 2>&1 | grep -v -E "^\[|it/s|USDT" | log
  done
  echo "== decode steps at batch 1-16, MINISGL_GEMV_MAX_ROWS 1 against 16" | log
  timeout 300 python3 tools/bench_latency.py --model "$SMOL" --skip-hf --skip-eager \
      --batch-sizes 1,2,4,8,16 --input-len 32 --output-len 64 --step-tokens 32 \
      --variants "r1:GEMV_MAX_ROWS=1;r16:GEMV_MAX_ROWS=16" --rounds 2 2>&1 \
      | grep -v -E "^\[|it/s|USDT" | log
fi
