#!/usr/bin/env bash
# The accelerator checks and the benchmark on one NVIDIA GPU: first the attention kernels' parity, compiled
# for the GPU (python -m bench.kernel_parity: JAX's Pallas GPU kernel and cuDNN against the dense kernel,
# max abs error of the output and the q, k, v gradients, float32 and bfloat16, every mask kind each takes),
# then the benchmark: bf16 compute (float32 params, float32 softmax and norm statistics),
# MFU against the chip's dense bf16 peak, and which attention implementation ran (cuDNN flash
# attention when mask and dtype allow, else XLA, with the reason), at D=2048, L=2048 (N=8, H=16,
# F=8192, K=4). One short call: about 5 minutes on an H100/H200 (most of it compiling).
#
#   bench/gpu.sh                          # H100/H200 SXM: 989 TFLOP/s dense bf16
#   PEAK_TFLOPS=312 bench/gpu.sh          # A100
#   SECTIONS=peak,train,infer,length bench/gpu.sh   # add the length sweep (L = 512 ... 8192)
#   bench/gpu.sh --reps 10                # anything else is passed to `python -m bench`
#
# Needs a CUDA build of JAX on that machine (pip install -e '.[cuda12]'). PyTorch is compared only
# if its build has CUDA. Results: the printed tables, runs/bench/kernel_parity_gpu.json and
# runs/bench/gpu.json. Exit 2: no GPU backend; exit 1: a kernel outside its tolerance (the benchmark still runs).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
PEAK=${PEAK_TFLOPS:-989}
SECTIONS=${SECTIONS:-peak,train,infer}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true
if ! "$PY" -c "import jax, sys; print('jax', jax.__version__, jax.devices()); sys.exit(jax.default_backend() != 'gpu')"; then
  echo "bench/gpu.sh: JAX sees no GPU: install jax[cuda12] (pip install -e '.[cuda12]') on the GPU machine" >&2
  exit 2
fi

# Let XLA take most of the GPU's memory up front (no growth stalls inside timed steps).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
parity=0
"$PY" -m bench.kernel_parity --length 1000 --json runs/bench/kernel_parity_gpu.json || parity=$?
"$PY" -m bench --gpu --dtype bfloat16 --peak-tflops "$PEAK" --only "$SECTIONS" --no-torch-compile \
  --json runs/bench/gpu.json "$@"
exit "$parity"
