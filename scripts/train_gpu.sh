#!/usr/bin/env bash
# Distill + train a DFlash drafter within one wall-clock budget, GPU-ready, in one command.
#
#   scripts/train_gpu.sh TARGET_DIR PROMPTS OUT_DIR BUDGET_SECONDS MASK_TOKEN_ID [more train-all flags...]
#
# Example (SmolLM2-135M-Instruct converted to a local folder, 1 hour, 4 GPUs):
#   NGPUS=4 scripts/train_gpu.sh ~/smollm2 prompts.jsonl runs/smollm2 3600 16 --eval-prompts heldout.jsonl
#
# Rerunning the same command resumes: finished distillation shards are skipped, training resumes from
# OUT_DIR/train/latest. The drafter lands in OUT_DIR/train/final (bf16, z-lab layout, shards <= 15 MB).
# On a machine without CUDA it runs on CPU (DEVICE=cpu), which is only useful as a smoke test.
set -euo pipefail
if [ "$#" -lt 5 ]; then
  sed -n '2,12p' "$0"; exit 2
fi
TARGET=$1; PROMPTS=$2; OUT=$3; BUDGET=$4; MASK=$5; shift 5
PYTHON=${PYTHON:-python}
NGPUS=${NGPUS:-1}
if [ -z "${DEVICE:-}" ]; then
  DEVICE=$("$PYTHON" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
fi
GPU_FLAGS=()
if [ "$DEVICE" = cuda ]; then
  GPU_FLAGS=(--bf16 --target-dtype bfloat16 --distill-batch-size "${GEN_BATCH:-64}" --batch-size "${BATCH:-2}")
fi
LAUNCH=("$PYTHON")
if [ "$NGPUS" -gt 1 ]; then
  LAUNCH=("$PYTHON" -m torch.distributed.run --nproc_per_node "$NGPUS")
fi
exec "${LAUNCH[@]}" -m dflash_hf train-all \
  --target "$TARGET" --prompts "$PROMPTS" --out "$OUT" --budget "$BUDGET" --mask-token-id "$MASK" \
  --device "$DEVICE" --final-max-shard-size 15MB "${GPU_FLAGS[@]}" "$@"
