#!/usr/bin/env bash
# An engine started from empty caches with its start-up's Triton builds in threads (the
# defaults: the kernel choice's candidates, and every other kernel noted in a dry run of its
# calls and built ahead) against every build one after another (MINISGL_BUILD_THREADS=1), in
# fresh processes with empty Triton and kernel-choice caches each; each prints its engine's
# phases, generates greedily and says what it built after it was ready; the two must give
# the same tokens (docs/benchmarks.md, "Start-up: the graphs' kernels built ahead").
#
#   OUT=/tmp/out bash tools/recipes/engine_start_h200.sh            # repo root, ~2 min
#   mkdir -p .ab/old && git archive OLD_COMMIT minisgl | tar -x -C .ab/old   # here, once
#   OUT=/tmp/out RUNS="new:16 old:16 new:16 old:16" bash tools/recipes/engine_start_h200.sh
#
# RUNS: the starts in order, each SOURCE:THREADS[:NAME=VALUE], SOURCE "new" (this tree) or
# the name of a folder under AB (default .ab) that holds another commit's package, NAME=VALUE
# one more setting (MINISGL_BUILD_AHEAD=0, say); default "new:16 new:1".
# CACHE_ROOT: keep each source's Triton and kernel-choice caches under CACHE_ROOT/SOURCE, so
# that a source's first start is fresh and its later ones warm (default: every start fresh).
# Each start says whether its greedy tokens equal the first's (with random weights, a GEMV
# chosen otherwise by a close timing can change them, in any code).
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
RUNS=${RUNS:-new:16 new:1}
i=0
for run in $RUNS; do
  i=$((i + 1)); src=${run%%:*}; rest=${run#*:}; threads=${rest%%:*}; knob=
  [ "$rest" = "$threads" ] || knob=${rest#*:}
  root=$PWD; [ "$src" = new ] || root=$(realpath "${AB:-.ab}/$src")
  triton=$(mktemp -d); choice=$(mktemp -d)
  if [ -n "${CACHE_ROOT:-}" ]; then
    triton=$CACHE_ROOT/$src/triton; choice=$CACHE_ROOT/$src/minisgl; mkdir -p "$triton" "$choice"
  fi
  echo "== engine start $i: $src, MINISGL_BUILD_THREADS=$threads $knob ($SECONDS s)" | log
  (cd "$root" && env ${knob:+"$knob"} PYTHONPATH=/tmp/site:$root MINISGL_BUILD_THREADS=$threads \
      TRITON_CACHE_DIR=$triton MINISGL_CACHE_DIR=$choice \
      timeout 150 python3 - "$MODEL" "$OUT/tokens_$i.json" <<'EOF_PY' 2>&1) \
      | grep -E "minisgl from|kernel choice|ahead|engine ready|ready in|builds|Error|error" | log
import json
import logging
import sys
import time

began = time.perf_counter()
logging.basicConfig(level=logging.INFO)
from minisgl.core import SamplingParams  # noqa: E402 - the imports are part of the start
from minisgl.engine.jit_log import jit_log  # noqa: E402
from minisgl.llm import LLM  # noqa: E402

print("minisgl from", sys.modules["minisgl"].__file__)
llm = LLM(sys.argv[1])
print(f"LLM ready in {time.perf_counter() - began:.1f} s")
prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
out = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
json.dump([o["token_ids"] for o in out], open(sys.argv[2], "w"))
print("builds after ready:", jit_log().summary())
llm.shutdown()
EOF_PY
  if cmp -s "$OUT/tokens_1.json" "$OUT/tokens_$i.json"; then echo "tokens $i: as start 1's" | log
  else echo "tokens $i: DIFFER from start 1's" | log; fi
done
echo "done at $SECONDS s" | log
