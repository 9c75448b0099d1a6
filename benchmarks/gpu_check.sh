#!/usr/bin/env bash
# GPU check (issue #39): llama-125m tokens/s and MFU of the train step in a bare loop against the
# real learner actor, replicated vs FSDP over every local GPU (benchmarks/gpu_check.py says how).
#
# Usage (from anywhere, on a machine with an NVIDIA GPU, the repository and pip access to a package
# index; nothing else is downloaded: the corpus is the local Python's standard library):
#
#   benchmarks/gpu_check.sh [gpu_check.py options, e.g. --peak-tflops 989 --batch 16]
#
# 1. Python: $VENV if set, else ./.venv; created with python3.11 and `pip install -e .` if missing.
# 2. JAX on the GPU: if JAX sees no GPU, installs JAX's CUDA plugin for the installed jax version
#    (`pip install "jax[cuda12]==<version>"`, its CUDA libraries as wheels; JAX_CUDA=cuda13 for a
#    CUDA 13 driver), then checks again and stops if there is still none.
# 3. Runs gpu_check.py with the rest of 8 minutes (at least 3) as its budget, under a hard timeout.
#
# Writes benchmarks/results/gpu_check.json (GPU_CHECK_OUT to change it) and prints its path.
# Environment: VENV, JAX_CUDA (cuda12 | cuda13), GPU_CHECK_OUT, GPU_CHECK_TOTAL_S (default 480).
set -euo pipefail
cd "$(dirname "$0")/.."

total_s="${GPU_CHECK_TOTAL_S:-480}"
venv="${VENV:-.venv}"
out="${GPU_CHECK_OUT:-benchmarks/results/gpu_check.json}"
py="$venv/bin/python"

if [ ! -x "$py" ]; then
  echo "gpu_check: creating $venv (python3.11, pip install -e .)"
  python3.11 -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --quiet -e .
fi

has_gpu() {  # JAX loads a GPU backend with at least one device (whatever JAX_PLATFORMS says)
  env -u JAX_PLATFORMS "$py" -c 'import jax; assert jax.devices("gpu")' >/dev/null 2>&1
}

if ! has_gpu; then
  jax_version="$("$py" -c 'import jax; print(jax.__version__)')"
  echo "gpu_check: JAX sees no GPU; installing jax[${JAX_CUDA:-cuda12}]==$jax_version"
  "$py" -m pip install --quiet "jax[${JAX_CUDA:-cuda12}]==$jax_version"
  if ! has_gpu; then
    echo "gpu_check: JAX still sees no GPU; what it says:" >&2
    env -u JAX_PLATFORMS "$py" -c 'import jax; print(jax.devices("gpu"))' >&2 || true
    exit 2
  fi
fi

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi

# what is left of total_s, less 40 s for start-up and shutdown; at least 180 s
budget_s=$((total_s - SECONDS - 40))
if [ "$budget_s" -lt 180 ]; then
  budget_s=180
fi
echo "gpu_check: measuring with a budget of ${budget_s} s"
mkdir -p "$(dirname "$out")"
timeout -k 15 "$((budget_s + 40))" env -u JAX_PLATFORMS \
  "$py" benchmarks/gpu_check.py --budget-s "$budget_s" --out "$out" "$@"

echo "gpu_check: wrote $out (benchmarks/results/ is git-ignored: git add -f $out to commit it)"
