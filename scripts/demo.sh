#!/usr/bin/env bash
# The main job: set up, convert the default target (SmolLM2-135M-Instruct) once, then generate with DFlash next to
# plain greedy and print both speeds, the speedup, tau and whether the outputs are identical. Without a PROMPT it runs
# the first held-out prompt of each bench set (GSM8K from 1000, HumanEval, MT-Bench: math, code, chat) and sums up.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
.venv/bin/dflash-hf prepare
case "${1:-}" in "" | -*) held_out=(--held-out) ;; *) held_out=() ;; esac
.venv/bin/dflash-hf generate --compare --max-new-tokens 128 "${held_out[@]}" "$@"
