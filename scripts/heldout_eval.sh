#!/usr/bin/env bash
# The held-out samples drafters are chosen on (scripts/heldout_samples.py), one dflash-hf eval each: float32 target,
# full blocks of 16, 128 new tokens, greedy; the samples split over two cores, one thread each (~5 min on a Zen 5 EPYC).
#   bash scripts/heldout_eval.sh DRAFT OUT [--tie-break]      # OUT/<sample>.json, then:
#   python scripts/heldout_samples.py compare BASE_OUT OUT
# TARGET (default: the converted default target) and CORES (default "0 1"; one core runs them in turn) override.
set -euo pipefail
DRAFT=$1 OUT=$2
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
TARGET=${TARGET:-$HOME/.cache/dflash-hf/targets/smollm2-135m-instruct-float32}
read -r -a CORES <<< "${CORES:-0 1}"
rm -rf "$OUT/prompts" && mkdir -p "$OUT/prompts"   # no sample left from an earlier call
"$PY" "$REPO/scripts/heldout_samples.py" prompts "$OUT/prompts" ${3:-} > /dev/null
evaluate() {  # core, then samples
    local core=$1; shift
    for name in "$@"; do
        local prompts=$OUT/prompts/$name.jsonl
        OMP_NUM_THREADS=1 taskset -c "$core" "$PY" -m dflash_hf eval --target "$TARGET" --draft "$DRAFT" \
            --prompts "$prompts" --block-sizes 16 --max-new-tokens 128 \
            --dtype float32 --threads 1 --device cpu --quiet --output "$OUT/$name.json" > "$OUT/$name.log" 2>&1 \
            || { tail -1 "$OUT/$name.log"; exit 1; }
    done
}
mapfile -t QUEUES < <("$PY" "$REPO/scripts/heldout_samples.py" queues "${#CORES[@]}" ${3:-})
pids=()
for i in "${!CORES[@]}"; do
    # shellcheck disable=SC2086  # a queue is a space-separated list of sample names
    evaluate "${CORES[i]}" ${QUEUES[i]} &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done   # a failed eval fails the script
(cd "$OUT" && grep -H 'tau=' ./*.log) | sed -e 's#^\./##' -e 's/\.log:/\t/' -e 's/histogram.*//'
