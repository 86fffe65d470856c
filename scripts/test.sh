#!/usr/bin/env bash
# Sets everything up from scratch and runs the whole test suite (CPU only, offline; a few minutes).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
.venv/bin/python -m pytest -q "$@"
