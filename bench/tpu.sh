#!/usr/bin/env bash
# The accelerator checks and the benchmark on one TPU VM: first the attention kernels' parity with splash
# attention compiled for the chip (python -m bench.kernel_parity: max abs error of the output and the q, k, v
# gradients against the dense kernel, float32 and bfloat16, every mask kind), then the benchmark with bf16
# compute (float32 params, float32 softmax and norm statistics), MFU against the chip's dense bf16 peak,
# and which attention kernel ran with its reason (splash on a TPU), at the accelerator shapes (as bench/gpu.sh).
#
#   bench/tpu.sh                          # v5e: 197 TFLOP/s dense bf16 per chip
#   PEAK_TFLOPS=275 bench/tpu.sh          # v4
#   PEAK_TFLOPS=918 bench/tpu.sh          # v6e (Trillium)
#   SECTIONS=peak,train,infer,length bench/tpu.sh   # add the length sweep
#   bench/tpu.sh --reps 10                # anything else is passed to `python -m bench`
#
# Needs JAX's TPU build on that machine (pip install -e '.[tpu]'). PyTorch is not compared on a TPU.
# Results: the printed tables, runs/bench/kernel_parity_tpu.json and runs/bench/tpu.json.
# Exit 2: no TPU backend; exit 1: a kernel outside its tolerance (the benchmark still runs).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
PEAK=${PEAK_TFLOPS:-197}
SECTIONS=${SECTIONS:-peak,train,infer}

if ! "$PY" -c "import jax, sys; print('jax', jax.__version__, jax.devices()); sys.exit(jax.default_backend() != 'tpu')"; then
  echo "bench/tpu.sh: JAX sees no TPU: install jax[tpu] (pip install -e '.[tpu]') on the TPU VM" >&2
  exit 2
fi

parity=0
"$PY" -m bench.kernel_parity --length 1000 --json runs/bench/kernel_parity_tpu.json || parity=$?
"$PY" -m bench --tpu --dtype bfloat16 --peak-tflops "$PEAK" --only "$SECTIONS" --no-torch-compile \
  --json runs/bench/tpu.json "$@"
exit "$parity"
