#!/usr/bin/env bash
# Issue 16's GPU run in one prepared command: continue the shipped SmolLM2 drafter on the committed corpus (plus
# answers the target distills on the GPU first), features recomputed online by the target, bf16, FlexAttention,
# the paper's schedule (AdamW 6e-4, warm-up 4 %, cosine, gamma 7, 512 anchors, 6 epochs) fitted into the time
# left; the drafter goes to $OUT/drafter every minute (a killed run still returns its last one), then tau at B = 16
# on held-out GSM8K / HumanEval / MT-Bench prompts if time is left.
#
#   bash scripts/gpu_train.sh          # every call of the plan in docs/gpu.md: carry .gpu/1, then .gpu/2, ...
#
# The calls before the last only stage their part (and install the wheels in the first) and end at once.
# $OUT gets at most 8 files: drafter/{config.json, model.safetensors.index.json, 2 shards}, log.jsonl,
# curves.png, result.json (summary, tau, timings, versions), run.log.
#
# Settings (environment, defaults for the H200): TOTAL_SECONDS=480 (the whole call, from the start of this script),
# DISTILL_SECONDS=90 (0: no new answers), EVAL_SECONDS=75 (kept for the evaluation; it is skipped when less is
# left), BATCH=16, ANCHORS=512, EPOCHS=6, LR=6e-4, GAMMA=7, TRAIN_VOCAB=8192, ATTN=flex_attention (sdpa if
# FlexAttention fails), DEVICE=cuda, DISTILL_BATCH=96, DISTILL_TOKENS=384, DISTILL_EXTRA (prompts past the committed
# ones; default all the time allows), EXPORT_EVERY=60, EVAL_LIMIT=10, EVAL_TOKENS=128, EVAL_BLOCK=16, MASK=16,
# INIT_FROM (the shipped drafter), CORPUS (the committed corpus folder), PROMPTS ($STAGE/1/prompts), plus those of
# scripts/gpu_common.sh; DEVICE=cpu runs the target in float32 (the rehearsals: scripts/gpu_rehearse.sh,
# tests/test_gpu_scripts.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1

TOTAL_SECONDS=${TOTAL_SECONDS:-480}
DISTILL_SECONDS=${DISTILL_SECONDS:-90}
EVAL_SECONDS=${EVAL_SECONDS:-75}
BATCH=${BATCH:-16}
ANCHORS=${ANCHORS:-512}
EPOCHS=${EPOCHS:-6}
LR=${LR:-6e-4}
GAMMA=${GAMMA:-7}
TRAIN_VOCAB=${TRAIN_VOCAB:-8192}  # the shipped drafter's draft vocabulary size (0: the full vocabulary)
ATTN=${ATTN:-flex_attention}
DEVICE=${DEVICE:-cuda}
DISTILL_BATCH=${DISTILL_BATCH:-96}
DISTILL_TOKENS=${DISTILL_TOKENS:-384}
DISTILL_EXTRA=${DISTILL_EXTRA:-}
EXPORT_EVERY=${EXPORT_EVERY:-60}
EVAL_LIMIT=${EVAL_LIMIT:-10}
EVAL_TOKENS=${EVAL_TOKENS:-128}
EVAL_BLOCK=${EVAL_BLOCK:-16}
MASK=${MASK:-16}
INIT_FROM=${INIT_FROM:-$REPO/dflash_hf/drafters/smollm2-135m-instruct}
CORPUS=${CORPUS:-$REPO/dflash_hf/corpora/smollm2-135m-instruct}
PROMPTS=${PROMPTS:-$STAGE/1/prompts}
DTYPE=bfloat16
[ "$DEVICE" = cpu ] && DTYPE=float32  # the CPU rehearsal: emulated bf16 is slow on most CPUs

gpu_prepare
if [ "$GPU_READY" != yes ]; then
  exit 0
fi
for needed in "$INIT_FROM/config.json" "$CORPUS"; do  # carried by name in the last call (gpu_pack.sh)
  [ -e "$needed" ] || { log "$needed is not here: carry dflash_hf/corpora and dflash_hf/drafters"; exit 1; }
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

# ---- data: the committed corpus, continued by the target on the GPU (distill skips the shards that exist)
DATA=$STAGE/data
for corpus in "$CORPUS"/*/; do
  name=$(basename "$corpus")
  mkdir -p "$DATA/$name"
  cp -n "$corpus"/shard-*.safetensors "$DATA/$name/"
done
if [ "$DISTILL_SECONDS" -gt 0 ]; then
  for name in gsm8k sharegpt ifbench; do  # ifbench: a corpus of its own, started here
    if [ -f "$PROMPTS/$name.jsonl" ]; then
      mkdir -p "$DATA/$name"
      limit=()  # DISTILL_EXTRA: at most that many prompts after the committed ones (96 per committed shard)
      if [ -n "$DISTILL_EXTRA" ]; then
        limit=(--limit $(($(find "$DATA/$name" -name 'shard-*.safetensors' | wc -l) * 96 + DISTILL_EXTRA)))
      fi
      log "distilling $name for up to $((DISTILL_SECONDS / 3)) s"
      "$PY" -m dflash_hf distill --target "$TARGET" --prompts "$PROMPTS/$name.jsonl" --out "$DATA/$name" \
        --dtype "$DTYPE" --batch-size "$DISTILL_BATCH" --max-new-tokens "$DISTILL_TOKENS" --shard-size 96 \
        --no-features --time-budget $((DISTILL_SECONDS / 3)) --device "$DEVICE" --seed 0 --quiet "${limit[@]}"
    fi
  done
fi
FOLDERS=()  # train reads several folders as one shuffled mix; a folder distill wrote nothing into is left out
for folder in "$DATA"/*/; do
  if compgen -G "$folder/shard-*.safetensors" >/dev/null; then FOLDERS+=("$folder"); fi
done
log "training data: $(find "$DATA" -name 'shard-*.safetensors' | wc -l) shards in ${#FOLDERS[@]} folders"

# ---- train (FlexAttention first; if that fails, SDPA with the dense block mask and half the batch, for the time left)
time_left() {  # seconds until the evaluation's share of TOTAL_SECONDS (30 s: start, loading, the final save)
  local seconds=$((TOTAL_SECONDS - SECONDS - EVAL_SECONDS - 30))
  echo $((seconds < 5 ? 5 : seconds))
}
train_drafter() {  # train_drafter ATTN SECONDS (--schedule time: the seconds of the whole run, resumes included)
  log "training with $1 for $2 s of schedule"
  "$PY" -m dflash_hf train --target "$TARGET" --data "${FOLDERS[@]}" --output-dir "$STAGE/run" --mask-token-id "$MASK" \
    --init-from "$INIT_FROM" --online-features --target-dtype "$DTYPE" $([ "$DTYPE" = bfloat16 ] && echo --bf16) \
    --attn-implementation "$1" --num-anchors "$ANCHORS" --batch-size "$BATCH" --lr "$LR" --gamma "$GAMMA" \
    --warmup-ratio 0.04 --train-vocab "$TRAIN_VOCAB" \
    --epochs "$EPOCHS" --schedule time --time-budget "$2" --max-length 3072 --save-every 200 \
    --keep-checkpoints 1 --log-every 10 --final-max-shard-size 15MB --export-dir "$OUT" \
    --export-every "$EXPORT_EVERY" --device "$DEVICE" --seed 0 --quiet --resume auto
}
TRAIN_SECONDS=$(time_left)
if ! train_drafter "$ATTN" "$TRAIN_SECONDS"; then
  [ "$ATTN" != sdpa ] || exit 1
  BATCH=$((BATCH > 1 ? BATCH / 2 : 1))  # in case it ran out of memory: SDPA's dense mask needs more
  log "training with $ATTN failed: retrying with sdpa, batch $BATCH"
  if [ -f "$STAGE/run/latest" ]; then  # resumed: the schedule's clock goes on from the checkpoint's time
    train_drafter sdpa "$TRAIN_SECONDS"
  else
    train_drafter sdpa "$(time_left)"
  fi
fi

# ---- evaluate, if time is left
for name in gsm8k humaneval mtbench; do
  if [ $((TOTAL_SECONDS - SECONDS)) -lt $((EVAL_SECONDS / 4)) ]; then
    log "no time left to evaluate on $name"
    continue
  fi
  if [ -f "$PROMPTS/eval-$name.jsonl" ]; then
    "$PY" -m dflash_hf eval --target "$TARGET" --draft "$STAGE/run/final" --prompts "$PROMPTS/eval-$name.jsonl" \
      --limit "$EVAL_LIMIT" --block-sizes "$EVAL_BLOCK" --max-new-tokens "$EVAL_TOKENS" --dtype "$DTYPE" \
      --draft-dtype "$DTYPE" \
      --device "$DEVICE" --quiet --output "$STAGE/eval-$name.json"
  fi
done
"$PY" - "$STAGE" "$OUT" <<'EOF'
import json, sys, platform
from pathlib import Path
import torch, transformers
stage, out = Path(sys.argv[1]), Path(sys.argv[2])
result = {"summary": json.loads((stage / "run" / "summary.json").read_text()),
          "eval": {p.stem[5:]: json.loads(p.read_text()) for p in sorted(stage.glob("eval-*.json"))},
          "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
          "torch": torch.__version__, "transformers": transformers.__version__}
(out / "result.json").write_text(json.dumps(result, indent=2))
(out / "summary.json").unlink(missing_ok=True)  # inside result.json: $OUT returns at most 8 files
print({name: [r["tau"] for r in e["results"]] for name, e in result["eval"].items()})
EOF
log "done"
