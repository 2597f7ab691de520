#!/usr/bin/env bash
# The GPU compiler's venv: `python -m train compile --target h100-8` (and lower's cuDNN tracing) on a host
# without a GPU. A venv of its own, because the CUDA plugin, once installed, is started by every JAX import:
#   bench/gpu_compiler_venv.sh [.venv-gpu]        # ~2.5 GB, a minute or two; then
#   .venv-gpu/bin/python -m train compile --config configs/sentiment_pretrained.yaml --target h100-8
# The plugin (XLA's GPU compiler, ~1.1 GB) and cuDNN (~1.1 GB) for its fused attention, without cuDNN's
# dependencies (cuBLAS, NVRTC: another 1 GB a compile does not load).
set -euo pipefail
venv="${1:-.venv-gpu}"
cd "$(dirname "$0")/.."
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -e '.[gpu-compile]'
"$venv/bin/pip" install -q --no-deps 'nvidia-cudnn-cu12>=9.8,<10'
