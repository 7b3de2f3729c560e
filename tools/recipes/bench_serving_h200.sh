#!/usr/bin/env bash
# The online serving comparison of docs/benchmarks.md ("Serving (online)", H200): minisgl,
# then `transformers serve --continuous-batching --compile`, on one GPU one after the other,
# each swept over Poisson request rates with tools/bench_serving.py until it saturates.
#
# For each rate the prompts and the arrival times are the same for both servers (one seed
# per rate), and so is the number of requests: RATE * WINDOW seconds of arrivals, at least
# MIN_PROMPTS and at most MAX_PROMPTS. A server's sweep stops after the first rate where a
# request failed or TTFT p99 passed STOP_MS, or when its time budget is spent; if its
# lowest rate already missed the SLO, LOW_RATE (if set) is tried as well. Both servers are
# started from $SRC, the tree under test (`python -m` imports from the working directory).
#
#   OUT=/tmp/out bash tools/recipes/bench_serving_h200.sh      # from the repository root
#   SRC=/root/src OUT=$OUT WHEEL_DIRS=".whl .gpu_serve/whl" bash tools/recipes/bench_serving_h200.sh
#
# Everything lands in $OUT (7 files): run.log, bench.log (every run's table), points.jsonl
# (one JSON per run), compare.txt (the sweeps side by side, sustainable rates), the plot
# serving_h200.png, and the two servers' logs. Settings come from the environment (below);
# the defaults are the H200 run's. WHEEL_DIRS: folders of wheels installed first into
# /root/site (a machine without a package index); MODEL is made with random weights in
# Qwen3-0.6B's shape when missing, with the tokenizer of TOKENIZER_FROM.
set -u
T0=$(date +%s)
OUT=${OUT:?set OUT to a folder for the results}
SRC=${SRC:-$PWD}                    # the minisgl tree that runs (e.g. a `git archive` of HEAD)
PY=${PY:-python3}
MODEL=${MODEL:-/root/q06}
TOKENIZER_FROM=${TOKENIZER_FROM:-.gpu_tok}
WHEEL_DIRS=${WHEEL_DIRS:-}
FICACHE=${FICACHE:-.gpu/ficache.tgz}  # FlashInfer's JIT-built kernels, when carried
MS_ARGS=${MS_ARGS:-}                # extra `python -m minisgl` flags
HF_ARGS=${HF_ARGS:---dtype bfloat16 --device cuda}
MS_RATES=${MS_RATES:-8,16,24,32,48,64,96,128,192}
HF_RATES=${HF_RATES:-0.25,0.5,1,2,4}  # it missed the SLO at 0.5, 1 and 2 (docs/benchmarks.md)
LOW_RATE=${LOW_RATE-}                 # empty: none
ALL_RATES=${ALL_RATES:-0.25,0.5,1,2,4,6,8,12,16,24,32,48,64,96,128,192}  # seed = 100 + index
WINDOW=${WINDOW:-10}
MIN_PROMPTS=${MIN_PROMPTS:-16}
MAX_PROMPTS=${MAX_PROMPTS:-640}
IN_LEN=${IN_LEN:-512}
OUT_LEN=${OUT_LEN:-256}
RATIO=${RATIO:-0.5}
SLO_MS=${SLO_MS:-2000}
STOP_MS=${STOP_MS:-6000}
REQ_TIMEOUT=${REQ_TIMEOUT:-90}
WARM_PROMPTS=${WARM_PROMPTS:-32}
DEADLINE=${DEADLINE:-530}           # seconds after the start: nothing new begins past it
MS_START=${MS_START:-150}
HF_START=${HF_START:-150}
MS_BUDGET=${MS_BUDGET:-150}
HF_BUDGET=${HF_BUDGET:-200}
MS_PORT=${MS_PORT:-1919}
HF_PORT=${HF_PORT:-8000}
SERVERS=${SERVERS:-minisgl hf}        # which to run, in this order
# minisgl start-ups tried in turn until one serves: "ENV=VALUE ...::--flag ...", ';' between
MS_ATTEMPTS=${MS_ATTEMPTS:-::}
HF_LABEL="transformers serve --continuous-batching --compile"
MODEL=$(realpath -m "$MODEL")       # the servers start from $SRC, so no relative path
WORK=$(mktemp -d)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1

say() { echo "[$(($(date +%s) - T0)) s] $*"; }
left() { echo $((DEADLINE - ($(date +%s) - T0))); }

SERVER_PID=""
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill -TERM -- -"$SERVER_PID" 2>/dev/null
    for _ in $(seq 40); do kill -0 -- -"$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- -"$SERVER_PID" 2>/dev/null
    SERVER_PID=""
    sleep 2
    command -v nvidia-smi >/dev/null && say "GPU memory used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
}
trap stop_server EXIT

# ---- the machine ------------------------------------------------------------------------
if [ -n "$WHEEL_DIRS" ]; then
    wheels=$(for d in $WHEEL_DIRS; do ls "$d"/*.whl; done)
    # shellcheck disable=SC2086
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /root/site $wheels >/dev/null 2>&1 || say "pip install failed"
    export PYTHONPATH=/root/site:$SRC
else
    export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -f "$FICACHE" ] && [ ! -d /root/ficache ]; then
    tar xzf "$FICACHE" -C /root && export FLASHINFER_WORKSPACE_BASE=/root/ficache
elif [ -d /root/ficache ]; then
    export FLASHINFER_WORKSPACE_BASE=/root/ficache
fi
if [ ! -d "$MODEL" ]; then
    timeout 120 $PY "$SRC/tools/make_random_model.py" --shape qwen3-0.6b --out "$MODEL" \
        --tokenizer-from "$TOKENIZER_FROM" 2>&1 | tail -2
fi
say "commit $(cat "$SRC/COMMIT" 2>/dev/null || git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
# From $SRC, as the servers: `python -m` puts the working directory first on sys.path, so
# a server started elsewhere would import whatever minisgl that directory holds.
(cd "$SRC" && $PY -) <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ["minisgl", "torch", "transformers", "flashinfer", "fastapi", "uvicorn", "pydantic", "starlette",
             "openai", "httpx", "accelerate", "tokenizers", "zmq"]:
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}  ({m.__file__})")
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {e}")
EOF

# ---- helpers ----------------------------------------------------------------------------
wait_ready() {  # $1 port, $2 seconds: until /health answers 200 (or the server died)
    local end=$(($(date +%s) + $2))
    while [ "$(date +%s)" -lt "$end" ]; do
        if [ -n "$SERVER_PID" ] && ! kill -0 "$SERVER_PID" 2>/dev/null; then return 1; fi
        $PY -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" \
            2>/dev/null && return 0
        sleep 1
    done
    return 1
}

gpu_watch() {  # every 5 s while a server starts: who holds how much GPU memory
    command -v nvidia-smi >/dev/null || return 0
    while sleep 5; do
        say "GPU: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader);" \
            "$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
    done
}

seed_of() {  # the rate's place in ALL_RATES: the same prompts for every server at a rate
    $PY -c "r=[float(x) for x in '$ALL_RATES'.split(',')]; print(100 + r.index(float('$1')))"
}

prompts_of() {
    $PY -c "print(min($MAX_PROMPTS, max($MIN_PROMPTS, round(float('$1') * $WINDOW))))"
}

# bench LABEL BACKEND PORT RATE -> $WORK/LABEL_RATE.json; prints "ok", "slo", "stop" or "none"
bench() {
    local label=$1 backend=$2 port=$3 rate=$4 tag
    tag=$(echo "$label" | cut -d' ' -f1 | tr -c 'a-z0-9\n' '_')
    local json=$WORK/${tag}_$rate.json n seed t
    n=$(prompts_of "$rate"); seed=$(seed_of "$rate"); t=$(left)
    [ "$t" -gt 20 ] || { echo none; return; }
    {
        say "$label: rate $rate, $n prompts, seed $seed"
        TIMEFORMAT="client: %R s wall, %U s user, %S s sys"
        time timeout "$t" $PY "$SRC/tools/bench_serving.py" --base-url "http://127.0.0.1:$port" \
            --backend "$backend" --model "$MODEL" --tokenizer "$MODEL" --num-prompts "$n" \
            --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --random-range-ratio "$RATIO" \
            --ignore-eos --request-rate "$rate" --request-timeout "$REQ_TIMEOUT" --seed "$seed" \
            --slo-ttft-ms "$SLO_MS" --label "$label" --output-json "$json" --disable-tqdm
    } >>"$OUT/bench.log" 2>&1
    [ -f "$json" ] || { echo none; return; }
    $PY -c "import json; print(json.dumps(json.load(open('$json'))))" >>"$OUT/points.jsonl"
    $PY - "$json" "$SLO_MS" "$STOP_MS" <<'EOF'
import json, sys
r, slo, stop = json.load(open(sys.argv[1])), float(sys.argv[2]), float(sys.argv[3])
p99 = r["ttft_ms"]["p99"]
print(f"  rate {r['request_rate']}: {r['completed']} done, {r['failed']} failed, "
      f"{r['request_throughput']:.2f} req/s, TTFT p99 {p99:.0f} ms, TPOT p50 {r['tpot_ms']['p50']:.1f} ms",
      file=sys.stderr)
print("stop" if r["failed"] or not p99 < stop else ("ok" if p99 < slo else "slo"))
EOF
}

# sweep LABEL BACKEND PORT RATES BUDGET
sweep() {
    local label=$1 backend=$2 port=$3 rates=$4 budget=$5 start first=1 verdict firstv=""
    start=$(date +%s)
    for rate in ${rates//,/ }; do
        if [ $(($(date +%s) - start)) -ge "$budget" ]; then say "$label: budget spent"; break; fi
        verdict=$(bench "$label" "$backend" "$port" "$rate")
        say "$label: rate $rate -> $verdict"
        [ -n "$firstv" ] || firstv=$verdict
        case $verdict in stop | none) break ;; esac
    done
    if [ -n "$LOW_RATE" ] && { [ "$firstv" = slo ] || [ "$firstv" = stop ]; }; then
        verdict=$(bench "$label" "$backend" "$port" "$LOW_RATE")
        say "$label: rate $LOW_RATE -> $verdict"
    fi
}

warm() {  # $1 backend, $2 port: a burst of long prompts, short answers, not measured
    timeout 120 $PY "$SRC/tools/bench_serving.py" --base-url "http://127.0.0.1:$2" --backend "$1" \
        --model "$MODEL" --tokenizer "$MODEL" --num-prompts "$WARM_PROMPTS" --random-input-len "$IN_LEN" \
        --random-output-len 16 --ignore-eos --seed 7 --disable-tqdm --label warm 2>&1 | grep -E "completed|failed|error"
}

# ---- minisgl ----------------------------------------------------------------------------
run_minisgl() {
    local attempt envs flags label
    IFS=';' read -r -a attempts <<<"$MS_ATTEMPTS"
    for attempt in "${attempts[@]}"; do
        [ "$(left)" -gt 90 ] || { say "minisgl: no time left for another start"; break; }
        envs=${attempt%%::*}; flags=${attempt#*::}
        label="minisgl${flags:+ $flags}"
        say "minisgl: starting (env: ${envs:-none}; flags: ${MS_ARGS:-none}${flags:+ $flags})"
        # shellcheck disable=SC2086
        (cd "$SRC" && exec setsid env $envs $PY -m minisgl --model "$MODEL" --port "$MS_PORT" \
            $MS_ARGS $flags) >>"$OUT/minisgl.log" 2>&1 &
        SERVER_PID=$!
        gpu_watch &
        local watcher=$!
        if wait_ready "$MS_PORT" "$MS_START"; then
            kill "$watcher" 2>/dev/null
            say "minisgl: ready"
            warm openai "$MS_PORT"
            say "minisgl: warmed up"
            sweep "$label" openai "$MS_PORT" "$MS_RATES" "$MS_BUDGET"
            stop_server
            return
        fi
        kill "$watcher" 2>/dev/null
        say "minisgl: not ready (env: ${envs:-none}; flags: ${flags:-none})"
        ps -eo pid,ppid,etimes,rss,args | grep -E "python|minisgl" | grep -v grep | cut -c1-160
        stop_server
    done
}

# ---- transformers serve -----------------------------------------------------------------
run_hf() {
    [ "$(left)" -gt 60 ] || return 0
    say "transformers serve: starting"
    # shellcheck disable=SC2086
    (cd "$SRC" && exec setsid $PY -m transformers.cli.transformers serve "$MODEL" \
        --continuous-batching --compile --host 127.0.0.1 --port "$HF_PORT" $HF_ARGS) >"$OUT/hf.log" 2>&1 &
    SERVER_PID=$!
    if wait_ready "$HF_PORT" "$HF_START"; then
        say "transformers serve: ready"
        warm transformers "$HF_PORT"
        say "transformers serve: warmed up"
        sweep "$HF_LABEL" transformers "$HF_PORT" "$HF_RATES" "$HF_BUDGET"
    else
        say "transformers serve: not ready after $HF_START s"; tail -30 "$OUT/hf.log"
    fi
    stop_server
}

for server in $SERVERS; do "run_$server"; done

# ---- side by side -----------------------------------------------------------------------
files=$(ls "$WORK"/*.json 2>/dev/null)
if [ -n "$files" ]; then
    # shellcheck disable=SC2086
    timeout 60 $PY "$SRC/tools/bench_serving.py" --compare $files --tokenizer "$MODEL" --slo-ttft-ms "$SLO_MS" \
        --plot "$OUT/serving_h200.png" 2>&1 | tee "$OUT/compare.txt"
fi
say "done"
