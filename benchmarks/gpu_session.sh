#!/usr/bin/env bash
# Everything a GPU session measures, in one device call (the device tool's budget favours few, full calls).
#
# Here, before the call (once per session; .data/ is git-ignored and travels with `carry`):
#   mkdir -p .data && cp -r /usr/share/datasets/fashion-mnist .data/
# The call (device tool): command "bash benchmarks/gpu_session.sh", carry [".data"].
# On the device machine: torch + CUDA, pillow, tqdm, safetensors, pyyaml and pytest are preinstalled, so
# the package runs from src/ without installing. Results land in $OUT (copied back by the tool).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export FASTDDPM_FMNIST_DIR=${FASTDDPM_FMNIST_DIR:-$PWD/.data/fashion-mnist}
export FASTDDPM_CACHE=${FASTDDPM_CACHE:-/tmp/fastddpm-cache}
OUT=${OUT:-/tmp/fastddpm-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse HEAD 2>/dev/null || echo "commit unknown"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,temperature.gpu --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"

echo "== GPU tests (pytest -m cuda)"
timeout 240 $PY -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"

echo "== throughput benchmark"
timeout 300 $PY -m fastddpm bench throughput --out "$OUT/throughput" 2>&1 | tee "$OUT/throughput.log"
