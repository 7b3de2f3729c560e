#!/usr/bin/env bash
# The start-up figures of docs/benchmarks.md ("Start-up"): `python -m minisgl` with its
# defaults, to /health, twice on one machine. Run it on a machine that no call has warmed:
# run 1 is then a fresh machine (empty Triton cache, no kernel-choice times in
# ~/.cache/minisgl), run 2 the same machine with warm caches. Each run prints the timeline
# of tools/bench_startup.py: every process's imports, the tokenizer's load, the engine's
# phases, the workers ready, the HTTP server listening.
#
#   OUT=$OUT WHEEL_DIRS=".whl .gpu_serve/whl" bash tools/recipes/startup_h200.sh   # from the repository root
#   BUILD_AB=1 OUT=$OUT WHEEL_DIRS=".whl .gpu_serve/whl" bash tools/recipes/startup_h200.sh  # and builds A/B
#
# WHEEL_DIRS: folders of wheels (fastapi, uvicorn, pyzmq, ...; docs/GPU notes) installed
# first into /root/site; MODEL is made with random weights in Qwen3-0.6B's shape when
# missing, with the tokenizer of TOKENIZER_FROM. Everything lands in $OUT/startup.log.
set -u
OUT=${OUT:?set OUT to a folder for the results}
PY=${PY:-python3}
MODEL=${MODEL:-/root/q06}
TOKENIZER_FROM=${TOKENIZER_FROM:-.gpu_tok}
WHEEL_DIRS=${WHEEL_DIRS:-}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/startup.log") 2>&1

if [ -n "$WHEEL_DIRS" ]; then
    wheels=$(for d in $WHEEL_DIRS; do ls "$d"/*.whl; done)
    # shellcheck disable=SC2086
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /root/site $wheels >/dev/null 2>&1 || echo "pip install failed"
    export PYTHONPATH=/root/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if [ ! -d "$MODEL" ]; then
    timeout 120 $PY tools/make_random_model.py --shape qwen3-0.6b --out "$MODEL" \
        --tokenizer-from "$TOKENIZER_FROM" 2>&1 | tail -2
fi
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ls ~/.triton/cache 2>/dev/null | wc -l | xargs echo "Triton cache entries before run 1:"
ls ~/.cache/minisgl/kernel_choice 2>/dev/null | wc -l | xargs echo "kernel-choice files before run 1:"
$PY tools/bench_startup.py --model "$MODEL" --runs 2
# Then each process's imports alone, warm: the launcher's and the tokenizer worker's, and
# what the scheduler imports before it builds the engine; and the scheduler's fifteen
# costliest imports (-X importtime, microseconds, self and with what they import).
for module in minisgl.server.launch minisgl.tokenizer.worker minisgl.scheduler.io; do
    $PY -c "import time; t = time.perf_counter(); import $module; print('import $module: %.2f s' % (time.perf_counter() - t))"
done
$PY -X importtime -c "import minisgl.scheduler.io" 2>&1 | sort -t'|' -k2 -n | tail -15
# With BUILD_AB=1 (or THREADS_AB=1): more fresh starts, each from empty caches of its own
# (Triton's and the kernel choice's), alternating three ways to build the start-up's Triton
# kernels, twice each: one after another (MINISGL_BUILD_THREADS=1); the kernel choice's
# candidates in threads and every other kernel as a call meets it (MINISGL_BUILD_AHEAD=0);
# those too in threads, noted in dry runs of the calls (the defaults).
if [ "${BUILD_AB:-${THREADS_AB:-0}}" = 1 ]; then
    for i in 1 2; do
        for knobs in MINISGL_BUILD_THREADS=1 MINISGL_BUILD_AHEAD=0 MINISGL_BUILD_AHEAD=1; do
            echo "== fresh start, $knobs ($i)"
            env "$knobs" TRITON_CACHE_DIR="$(mktemp -d)" MINISGL_CACHE_DIR="$(mktemp -d)" \
                $PY tools/bench_startup.py --model "$MODEL" --runs 1 \
                | grep -E "answered|kernel choice took|kernels ahead|captured|Triton at start-up|engine ready"
        done
    done
    # The kernels built ahead are the ones the capture would have built: greedy tokens of an
    # engine started each way from empty caches, and no build after it is ready.
    for ahead in 1 0; do
        MINISGL_BUILD_AHEAD=$ahead TRITON_CACHE_DIR="$(mktemp -d)" MINISGL_CACHE_DIR="$(mktemp -d)" \
            $PY - "$MODEL" "$OUT/tokens_ahead$ahead.json" <<'EOF_PY' 2>&1 | grep -E "tokens|kernels ahead|Error"
import json
import logging
import sys

logging.basicConfig(level=logging.INFO)
from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine.jit_log import jit_log  # noqa: E402
from minisgl.llm import LLM  # noqa: E402

llm = LLM(sys.argv[1])
prompts = ["The capital of France is", "def fib(n):", "Once upon a time"] * 3
params = SamplingParams(max_tokens=24, ignore_eos=True)
tokens = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
json.dump(tokens, open(sys.argv[2], "w"))
print("tokens", tokens[0][:8], "builds after ready:", jit_log().summary())
llm.shutdown()
EOF_PY
    done
    cmp -s "$OUT/tokens_ahead1.json" "$OUT/tokens_ahead0.json" && echo "tokens: equal" || echo "tokens: DIFFER"
fi
