#!/usr/bin/env bash
# The start-up figures of docs/benchmarks.md ("Start-up"): `python -m minisgl` with its
# defaults, to /health, twice on one machine. Run it on a machine that no call has warmed:
# run 1 is then a fresh machine (empty Triton cache, no kernel-choice times in
# ~/.cache/minisgl), run 2 the same machine with warm caches. Each run prints the timeline
# of tools/bench_startup.py: every process's imports, the tokenizer's load, the engine's
# phases, the workers ready, the HTTP server listening.
#
#   OUT=$OUT WHEEL_DIRS=".whl .gpu_serve/whl" bash tools/recipes/startup_h200.sh   # from the repository root
#   THREADS_AB=1 OUT=$OUT WHEEL_DIRS=.whl bash tools/recipes/startup_h200.sh         # and threads A/B
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
# what the scheduler imports before it builds the engine.
for module in minisgl.server.launch minisgl.tokenizer.worker minisgl.scheduler.io; do
    $PY -c "import time; t = time.perf_counter(); import $module; print('import $module: %.2f s' % (time.perf_counter() - t))"
done
# With THREADS_AB=1: more fresh starts, each from empty caches of its own (Triton's and the
# kernel choice's), alternating the kernel choice's builds one after another
# (MINISGL_BUILD_THREADS=1) and in threads (the default), twice each.
if [ "${THREADS_AB:-0}" = 1 ]; then
    for threads in 1 16 1 16; do
        echo "== fresh start, MINISGL_BUILD_THREADS=$threads"
        TRITON_CACHE_DIR=$(mktemp -d) MINISGL_CACHE_DIR=$(mktemp -d) MINISGL_BUILD_THREADS=$threads \
            $PY tools/bench_startup.py --model "$MODEL" --runs 1 \
            | grep -E "answered|kernel choice took|Triton at start-up|engine ready"
    done
fi
