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
# runs/bench/gpu.json, and the record bench/records/<gpu>-<date>[-n].md (RECORD=... names another): the machine,
# the versions, the commit and everything both commands printed. Exit 2: no GPU backend; exit 1: a kernel
# outside its tolerance (the benchmark still runs).
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

GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
SLUG=$(echo "${GPU:-gpu}" | tr 'A-Z' 'a-z' | sed -E 's/^nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
if [ -z "${RECORD:-}" ]; then  # the first of <gpu>-<date>.md, -2.md, -3.md, ... not yet taken
  RECORD=bench/records/${SLUG}-$(date +%F).md; n=1
  while [ -e "$RECORD" ]; do n=$((n + 1)); RECORD=bench/records/${SLUG}-$(date +%F)-$n.md; done
fi
REV=$(git rev-parse --short HEAD 2>/dev/null || echo 'a copy of the tree')
if ! git diff --quiet HEAD 2>/dev/null; then REV="$REV with uncommitted changes"; fi
mkdir -p "$(dirname "$RECORD")"
# A JAX outside the project's pinned range still runs, but its figures are not the project's: say so.
OFFPIN=$("$PY" -c "
import importlib.metadata as md, jax
from packaging.requirements import Requirement
pins = [Requirement(r) for r in (md.requires('jaxblock') or [])]
off = [str(r) for r in pins if r.name == 'jax' and not r.specifier.contains(jax.__version__)]
print(f'jax {jax.__version__} is outside the project\'s {off[0]} (pip install -e .[cuda12])' if off else '')
" 2>/dev/null || true)
if [ -n "$OFFPIN" ]; then echo "bench/gpu.sh: warning: $OFFPIN" >&2; fi
{
  echo "# ${GPU:-GPU}, measured $(date +%F) on $REV"
  echo
  echo "Machine: $(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null | head -1)."
  echo "Versions: $("$PY" -c "import sys, jax, jaxlib, flax, optax; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__)")."
  echo "Written by \`bench/gpu.sh $*\` (PEAK_TFLOPS=$PEAK, SECTIONS=$SECTIONS): python -m bench.kernel_parity, then python -m bench."
  if [ -n "$OFFPIN" ]; then echo "Warning: $OFFPIN."; fi
  echo
  echo '```'
} > "$RECORD"

# Let XLA take most of the GPU's memory up front (no growth stalls inside timed steps).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
parity=0
"$PY" -m bench.kernel_parity --length 1000 --json runs/bench/kernel_parity_gpu.json 2>&1 | tee -a "$RECORD" \
  || parity=$?
bench=0
"$PY" -m bench --gpu --dtype bfloat16 --peak-tflops "$PEAK" --only "$SECTIONS" --no-torch-compile \
  --json runs/bench/gpu.json "$@" 2>&1 | tee -a "$RECORD" || bench=$?
echo '```' >> "$RECORD"
echo "bench/gpu.sh: wrote $RECORD (kernel parity exit $parity, bench exit $bench)"
if [ "$bench" -ne 0 ]; then exit "$bench"; fi
exit "$parity"
