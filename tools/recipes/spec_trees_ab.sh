#!/usr/bin/env bash
# Held-out speculation (tools/bench_speculative.py --sets heldout, suffix drafts, each side
# against speculation off in one engine, warmed, alternating) with several trees of the code
# on one machine: each tree's own copy of the tool in a process of its own, the processes in
# the order given (ABBA, so that a machine that warms up or slows down favours neither).
#
#   OUT=/tmp/out ORDER="new:. old:.ab/old:4 old:.ab/old new:." bash tools/recipes/spec_trees_ab.sh
#
# ORDER: name:tree[:batches] items (batches: BATCHES, "1,4", where not given); a tree is a
# folder holding minisgl/ and tools/ (`git archive COMMIT minisgl tools | tar -x -C DIR`).
# SMOL: SmolLM2's real weights (tools/recipes/smollm2_parts.sh); PAIRS (2); SPEC_ARGS: more
# flags (a CPU dry run: SMOL=models/SmolLM2-135M-Instruct SPEC_ARGS="--smoke --device cpu").
# The JSON and log of each process land in $OUT as N-name.json and N-name.log.
set -u
OUT=${OUT:?set OUT to a folder for the results}
SMOL=${SMOL:-/root/SmolLM2-135M-Instruct}
mkdir -p "$OUT"
i=0
for item in ${ORDER:?set ORDER to name:tree[:batches] items}; do
  IFS=: read -r name tree batches <<< "$item"
  batches=${batches:-${BATCHES:-1,4}}
  i=$((i + 1))
  root=$(cd "$tree" && pwd)
  start=$(date +%s)
  # shellcheck disable=SC2086
  PYTHONPATH="/tmp/site:$root" python3 "$root/tools/bench_speculative.py" --model "$SMOL" \
    --speculative suffix --sets heldout --batches "$batches" --pairs "${PAIRS:-2}" \
    --output-json "$OUT/$i-$name.json" ${SPEC_ARGS:-} > "$OUT/$i-$name.log" 2>&1
  echo "== $i $name: tree $tree, batches $batches, rc $?, $(( $(date +%s) - start )) s"
  grep '^| ' "$OUT/$i-$name.log" | grep -v '^|---' | cut -c1-160
done
