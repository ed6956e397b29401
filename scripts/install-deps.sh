#!/usr/bin/env bash
# Installs the Debian packages msa builds and tests with. Safe to run repeatedly.
set -euo pipefail
packages=(cmake g++ ninja-build make pkg-config libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev
          libdlpack-dev libomp-dev clang python3 python3-pip python3-venv python3-dev python3-numpy)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
