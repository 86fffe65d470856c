#!/usr/bin/env bash
# Sets everything up from scratch and runs the whole test suite (CPU only, offline; a few minutes), then the
# generation, dispatch and drafter tests again on the oldest supported transformers (setup installs the newest).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
.venv/bin/python -m pytest -q "$@"
.venv/bin/python -m pip install -q --no-deps --target .venv/transformers-5.23 transformers==5.23.0
PYTHONPATH=.venv/transformers-5.23 .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_generation.py tests/test_dispatch.py tests/test_modeling.py tests/test_configuration.py tests/test_hub.py
