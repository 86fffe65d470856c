#!/usr/bin/env bash
# The main job: set up, convert the default target (SmolLM2-135M-Instruct) once, then generate with DFlash next to
# plain greedy and print both speeds, the speedup, tau and whether the outputs are identical.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
.venv/bin/dflash-hf prepare
.venv/bin/dflash-hf generate --compare "$@"
