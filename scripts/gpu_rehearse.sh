#!/usr/bin/env bash
# The GPU plan of docs/gpu.md rehearsed on this CPU: a clean clone of the committed state, each call simulated
# (a fresh $OUT, only .gpu/K carried into the clone), the same wheel install, staging, joining and conversion of
# the GGUF, then scripts/gpu_train.sh and scripts/gpu_speed.sh with tiny budgets on CPU; what each call leaves in
# $OUT is checked against the return rules (8 files, 16 MiB each, two folders down, plain names).
#
#   bash scripts/gpu_pack.sh && git commit ... && bash scripts/gpu_rehearse.sh     # ~15 minutes on one busy core
set -euo pipefail
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
R=${REHEARSAL:-/tmp/dflash-rehearse}
export PYTHON=${PYTHON:-$SRC/.venv/bin/python}
[ -d "$SRC/.gpu/1" ] || { echo "no .gpu/1: run scripts/gpu_pack.sh first" >&2; exit 1; }
rm -rf "$R"
mkdir -p "$R"
git clone -q "$SRC" "$R/repo"
export DFLASH_GPU_STAGE=$R/stage OMP_NUM_THREADS=1 DFLASH_GPU_WHEEL_PYTHON=3.12
# tiny budgets on one CPU core
export DEVICE=cpu TOTAL_SECONDS=${TOTAL_SECONDS:-720} DISTILL_SECONDS=20 DISTILL_EXTRA=2 DISTILL_TOKENS=8 \
  DISTILL_BATCH=2 EVAL_SECONDS=180 EVAL_LIMIT=1 EVAL_TOKENS=8 BATCH=1 ANCHORS=8 EPOCHS=1 EXPORT_EVERY=10 ATTN=sdpa
call() {  # call K SCRIPT: carry .gpu/K only, as the run tool does, into a fresh $OUT
  rm -rf "$R/repo/.gpu" "$R/out-$1"
  mkdir -p "$R/repo/.gpu"
  cp -r "$SRC/.gpu/$1" "$R/repo/.gpu/$1"
  echo "=== call $1: bash $2 (carry .gpu/$1)"
  (cd "$R/repo" && OUT="$R/out-$1" taskset -c 0 bash "$2")
  "$PYTHON" "$R/repo/scripts/gpu_parts.py" check-out "$R/out-$1"
  ls -la "$R/out-$1"
}
n=$(ls -d "$SRC"/.gpu/[0-9]* | wc -l)
for k in $(seq 1 "$n"); do
  call "$k" scripts/gpu_train.sh
done
test -f "$R/out-$n/drafter/config.json" && test -f "$R/out-$n/result.json"
if [ -f "$R/repo/scripts/gpu_speed.sh" ]; then
  rm -rf "$R/repo/.gpu"
  export SPEED_SECONDS=${SPEED_SECONDS:-120} SPEED_TOKENS=16 SPEED_PROMPTS=1 SPEED_QWEN3=tiny
  echo "=== call: bash scripts/gpu_speed.sh (nothing carried)"
  (cd "$R/repo" && OUT="$R/out-speed" taskset -c 0 bash scripts/gpu_speed.sh)
  "$PYTHON" "$R/repo/scripts/gpu_parts.py" check-out "$R/out-speed"
fi
echo "rehearsal passed: $R"
