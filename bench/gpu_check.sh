#!/usr/bin/env bash
# 3 MAGRPO iterations on CUDA with random-initialised models of SmolLM2-135M's and Qwen3-1.7B's
# shapes; prints tokens/s and seconds per iteration. Needs a GPU, PyTorch and transformers
# (peft optional); no network, no model files. Bounded to 5 minutes.
#   bash bench/gpu_check.sh            # PYTHON=/path/to/python to pick the interpreter
#   bash bench/gpu_check.sh --device cpu --tiny   # the same code on the CPU with a tiny model
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec timeout 300 "$PY" bench/gpu_check.py "$@"
