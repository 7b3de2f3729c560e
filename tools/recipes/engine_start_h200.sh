#!/usr/bin/env bash
# An engine started from empty caches with its start-up's Triton builds in threads (the
# defaults: the kernel choice's candidates, and every other kernel noted in a dry run of its
# calls and built ahead) against every build one after another (MINISGL_BUILD_THREADS=1), in
# fresh processes with empty Triton and kernel-choice caches each; each prints its engine's
# phases, generates greedily and says what it built after it was ready; the two must give
# the same tokens (docs/benchmarks.md, "Start-up: the graphs' kernels built ahead").
#
#   OUT=/tmp/out bash tools/recipes/engine_start_h200.sh            # repo root, ~2 min
#
# WHEELS: a folder of wheels the GPU machine lacks (pyzmq, setproctitle; default .whl);
# MODEL is made with random weights in SHAPE (qwen3-0.6b) when missing, with the tokenizer of
# TOKENIZER_FROM (.gpu_tok).
set -u
OUT=${OUT:?set OUT to a folder for the results}
SHAPE=${SHAPE:-qwen3-0.6b}
MODEL=${MODEL:-/root/$SHAPE}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
log() { tee -a "$OUT/run.log"; }
nvidia-smi -L 2>/dev/null | log
[ -d "$MODEL" ] || python3 tools/make_random_model.py --shape "$SHAPE" --out "$MODEL" \
    --tokenizer-from "${TOKENIZER_FROM:-.gpu_tok}" --device cuda 2>&1 | tail -1 | log
for threads in 16 1; do
  echo "== fresh engine start, MINISGL_BUILD_THREADS=$threads ($SECONDS s)" | log
  MINISGL_BUILD_THREADS=$threads TRITON_CACHE_DIR=$(mktemp -d) MINISGL_CACHE_DIR=$(mktemp -d) \
      timeout 150 python3 - "$MODEL" "$OUT/tokens_$threads.json" <<'EOF_PY' 2>&1 \
      | grep -E "kernel choice|ahead|engine ready|ready in|builds|Error|error" | log
import json
import logging
import sys
import time

began = time.perf_counter()
logging.basicConfig(level=logging.INFO)
from minisgl.core import SamplingParams  # noqa: E402 - the imports are part of the start
from minisgl.engine.jit_log import jit_log  # noqa: E402
from minisgl.llm import LLM  # noqa: E402

llm = LLM(sys.argv[1])
print(f"LLM ready in {time.perf_counter() - began:.1f} s")
prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
out = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
json.dump([o["token_ids"] for o in out], open(sys.argv[2], "w"))
print("builds after ready:", jit_log().summary())
llm.shutdown()
EOF_PY
done
if cmp -s "$OUT/tokens_16.json" "$OUT/tokens_1.json"; then echo "tokens: equal" | log
else echo "tokens: DIFFER" | log; fi
echo "done at $SECONDS s" | log
