#!/usr/bin/env bash
# Builds and installs the Python package into a virtual environment and runs its tests.
#   MSA_PY_VENV      environment folder (default .venv-ci, reused when present)
#   MSA_PY_TORCH     0 skips installing PyTorch (the torch tests then skip with a reason)
#   MSA_ENABLE_CUDA  AUTO/ON/OFF for the extension build; default OFF unless a GPU is visible
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MSA_PY_VENV:-.venv-ci}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check nanobind scikit-build-core numpy pytest ml_dtypes ninja
if [ "${MSA_PY_TORCH:-1}" != 0 ]; then
  # Plain PyPI has no CPU-only wheel of torch for Linux x86-64: this is the CUDA build (large
  # download, runs on the CPU where there is no GPU).
  "$py" -m pip install -q --disable-pip-version-check torch
  # Pinned: the MiniMax-M3 model code the integration hooks into (tests/python/test_transformers.py).
  "$py" -m pip install -q --disable-pip-version-check transformers==5.17.0
fi
if [ -z "${MSA_ENABLE_CUDA:-}" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then MSA_ENABLE_CUDA=AUTO; else MSA_ENABLE_CUDA=OFF; fi
fi
export MSA_ENABLE_CUDA
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH=/usr/local/cuda/bin:$PATH; fi
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation .
"$py" -m pytest -q -rs -p no:cacheprovider tests/python "$@"
