#!/usr/bin/env bash
# Prepares what the GPU calls carry (docs/gpu.md), here, with PyPI reachable: the wheels the machine lacks
# (transformers and gguf as in .venv, regex for transformers' version check), the prompt files (training prompts of
# the committed corpora, held-out GSM8K 1000+ / HumanEval / MT-Bench), and the target's GGUF split into parts, into
# .gpu/1, .gpu/2, ... (ignored by git), each small enough to travel beside the working tree in one call.
#
#   bash scripts/gpu_pack.sh            # in the checkout the GPU calls are made from: its tree is what travels
#   bash scripts/gpu_pack.sh --restore  # after the GPU calls: track the bulky folders again
#
# The committed corpus and the shipped drafters (~44 MiB) would leave too little room in every call, so they leave
# the tree for the calls: `git rm --cached` plus .git/info/exclude (the files stay; nothing is committed), and the
# last call, the one that runs the work, carries them by name. Commit nothing until --restore: a commit made in
# between would delete them.
#
# Needs `bash scripts/setup.sh` and `dflash-hf prepare` (the datasets in ~/.cache/dflash-hf/datasets) first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
BULKY=(dflash_hf/corpora dflash_hf/drafters)
untrack_bulky() {
  git reset -q -- "${BULKY[@]}"
  for path in "${BULKY[@]}"; do sed -i "\\#^/$path/\$#d" .git/info/exclude 2>/dev/null || true; done
  if [ "${1:-}" = out ]; then
    git rm -r -q --cached "${BULKY[@]}"
    printf '/%s/\n' "${BULKY[@]}" >> .git/info/exclude
  fi
}
if [ "${1:-}" = --restore ]; then
  untrack_bulky
  git status --short
  exit 0
fi
CACHE=.gpu-cache
rm -rf "$CACHE/wheels" "$CACHE/prompts"
mkdir -p "$CACHE/wheels" "$CACHE/prompts"
pinned() { "$PY" -c "from importlib.metadata import version; print('$1==' + version('$1'))"; }
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CACHE/wheels" "$(pinned transformers)" "$(pinned gguf)" "$(pinned regex)"
"$PY" scripts/corpus_prompts.py "$CACHE/prompts"
for f in "$CACHE"/prompts/*.jsonl; do  # gpu_train.sh distills these three further (code.jsonl's prompts are
  case $(basename "$f") in gsm8k.jsonl|sharegpt.jsonl|ifbench.jsonl) ;; *) rm "$f" ;; esac  # sharegpt's)
done
"$PY" - "$CACHE/prompts" <<'PYEOF'
import json, sys
from pathlib import Path
from dflash_hf.assets import load_prompts
out = Path(sys.argv[1])
for name, rows in (("gsm8k", load_prompts("gsm8k")[1000:]), ("humaneval", load_prompts("humaneval")),
                   ("mtbench", load_prompts("mtbench"))):
    (out / f"eval-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"eval-{name}.jsonl: {len(rows)} held-out prompts")
PYEOF
GGUF=$("$PY" -c "from dflash_hf.assets import TARGET_GGUF, wheel_file; print(wheel_file(TARGET_GGUF))")
mkdir -p .git/info
untrack_bulky out
"$PY" scripts/gpu_parts.py pack --payload "$GGUF" --extra wheels="$CACHE/wheels" --extra prompts="$CACHE/prompts" \
  --out .gpu --repo . --last-carries "${BULKY[@]}"
echo "the bulky folders are out of git's index until: bash scripts/gpu_pack.sh --restore"
du -sh .gpu/*
