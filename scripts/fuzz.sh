#!/usr/bin/env bash
# Randomized losslessness cases (tests/fuzz.py): `scripts/fuzz.sh N [--start S]` runs cases S..S+N-1 and prints a
# one-line reproducer per failure; `scripts/fuzz.sh --case SEED` replays one case with its parameters.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=.venv/bin/python
[ -x "$PYTHON" ] || PYTHON=python
exec "$PYTHON" tests/fuzz.py "$@"
