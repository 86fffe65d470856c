#!/usr/bin/env bash
# Issue 17's GPU measurement in one prepared command (<= 8 minutes; docs/gpu.md): plain greedy, our
# generate(assistant_model=draft), transformers' speculation_type="dflash" and the reference loop, on SmolLM2 with
# the shipped drafter and on a random ~2 B Qwen3 with tau pinned; tokens/s, tau and per-round draft / verify / glue
# (scripts/gpu_speed.py). $OUT gets speed.json, speed.md and speed.log.
#
#   bash scripts/gpu_speed.sh          # after gpu_train.sh in the same lease, or alone: carry .gpu/1, .gpu/2, ...
#
# The shipped drafter travels by name (carry dflash_hf/drafters) in this call too: the machine does not keep a
# folder inside the tree that an earlier call carried (seen on the H200, 2026-12-04).
#
# Settings (environment): SPEED_SECONDS=330 (measuring; the whole call stays under 8 minutes with the target's
# conversion), SPEED_TOKENS=256, SPEED_PROMPTS=2 (per prompt set, and random Qwen3 prompts), SPEED_REPEATS=2,
# SPEED_QWEN3=full (tiny: the CPU rehearsal), SPEED_DRAFT (default: the shipped drafter), DEVICE (cuda when
# there is one), PROMPTS, plus scripts/gpu_common.sh's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/speed.log") 2>&1
PROMPTS=${PROMPTS:-$STAGE/1/prompts}
gpu_prepare
if [ "$GPU_READY" != yes ]; then
  exit 0
fi
if [ -z "${SPEED_DRAFT:-}" ] && [ ! -f "$REPO/dflash_hf/drafters/smollm2-135m-instruct/config.json" ]; then
  log "the shipped drafter is not here: carry dflash_hf/drafters in this call"
  exit 1
fi
DTYPE=bfloat16
[ "${DEVICE:-cuda}" = cpu ] && DTYPE=float32  # the CPU rehearsal
"$PY" "$REPO/scripts/gpu_speed.py" --target "$TARGET" --draft "${SPEED_DRAFT:-default}" \
  --prompts "$PROMPTS/eval-gsm8k.jsonl" "$PROMPTS/eval-mtbench.jsonl" --num-prompts "${SPEED_PROMPTS:-2}" \
  --max-new-tokens "${SPEED_TOKENS:-256}" \
  --repeats "${SPEED_REPEATS:-2}" --dtype "$DTYPE" ${DEVICE:+--device "$DEVICE"} --qwen3 "${SPEED_QWEN3:-full}" \
  --seconds "${SPEED_SECONDS:-330}" --out "$OUT"
log "done"
