#!/usr/bin/env bash
# Builds and installs the Python package into a virtual environment and runs its tests.
#   MSA_PY_VENV      environment folder (default .venv-ci, reused when present)
#   MSA_PY_TORCH     0 skips installing PyTorch (the torch tests then skip with a reason); it is
#                    also skipped, with a note, where the disk has less than ~10 GB free for it
#   MSA_ENABLE_CUDA  AUTO/ON/OFF for the extension build; default OFF unless a GPU is visible
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MSA_PY_VENV:-.venv-ci}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
# --no-cache-dir: pip's wheel cache would keep a second copy of every download (~4 GB for torch).
pip_install=("$py" -m pip install -q --disable-pip-version-check --no-cache-dir)
"${pip_install[@]}" nanobind scikit-build-core numpy pytest ml_dtypes ninja
torch_wanted=${MSA_PY_TORCH:-1}
if [ "$torch_wanted" != 0 ] && ! "$py" -c "import torch" 2>/dev/null; then
  # Plain PyPI has no CPU-only wheel of torch for Linux x86-64: this is the CUDA build with its
  # CUDA libraries (~6 GB installed, more while unpacking; it runs on the CPU where there is no
  # GPU). Where the disk cannot hold it, say so and let the torch tests skip with their reason
  # rather than fail half-way through the install.
  need_kib=$((10 * 1024 * 1024))
  free_kib=$(df -Pk "$venv" | awk 'NR == 2 { print $4 }')
  if [ "${free_kib:-0}" -lt "$need_kib" ]; then
    echo "note: PyTorch not installed: $((free_kib / 1024)) MiB free where $venv lives," \
         "installing it needs about $((need_kib / 1024)) MiB; the torch and transformers tests skip"
    torch_wanted=0
  fi
fi
if [ "$torch_wanted" != 0 ]; then
  "${pip_install[@]}" torch
  # Pinned: the MiniMax-M3 model code the integration hooks into (tests/python/test_transformers.py).
  "${pip_install[@]}" transformers==5.17.0
fi
if [ -z "${MSA_ENABLE_CUDA:-}" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then MSA_ENABLE_CUDA=AUTO; else MSA_ENABLE_CUDA=OFF; fi
fi
export MSA_ENABLE_CUDA
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH=/usr/local/cuda/bin:$PATH; fi
"${pip_install[@]}" --no-build-isolation .
"$py" -m pytest -q -rs -p no:cacheprovider tests/python "$@"
