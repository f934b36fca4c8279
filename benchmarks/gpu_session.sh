#!/usr/bin/env bash
# What a GPU session measures, in few device calls (the device tool's budget favours few, full calls; one call
# may run 10 minutes, so split the parts over calls: e.g. "tests throughput", then "ladder").
#
#   bash benchmarks/gpu_session.sh [tests] [throughput] [ladder] [doctor]      (default: tests throughput)
#
# Here, before the first call (once per session; .data/ is git-ignored and travels with `carry`):
#   mkdir -p .data && cp -r /usr/share/datasets/fashion-mnist .data/
# Device tool call: command "bash benchmarks/gpu_session.sh tests throughput", carry [".data"].
# On the device machine torch + CUDA, pillow, tqdm, safetensors, pyyaml, matplotlib and pytest are preinstalled,
# so the package runs from src/ without installing. Results land in $OUT (copied back by the tool); record them
# in benchmarks/RESULTS.md with the device, date, torch version, commit and command (env.txt has them).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export FASTDDPM_FMNIST_DIR=${FASTDDPM_FMNIST_DIR:-$PWD/.data/fashion-mnist}
export FASTDDPM_CACHE=${FASTDDPM_CACHE:-/tmp/fastddpm-cache}
OUT=${OUT:-/tmp/fastddpm-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PARTS=${*:-tests throughput}

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse HEAD 2>/dev/null || echo "commit unknown"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,temperature.gpu --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "parts: $PARTS"
} 2>&1 | tee "$OUT/env.txt"

for part in $PARTS; do
  case $part in
    tests)
      echo "== GPU tests (pytest -m cuda)"
      timeout 240 $PY -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" ;;
    throughput)
      echo "== throughput benchmark"
      timeout 330 $PY -m fastddpm bench throughput --out "$OUT/throughput" 2>&1 | tee "$OUT/throughput.log" ;;
    ladder)
      echo "== ladder (data: the carried Fashion-MNIST files)"
      timeout 560 $PY -m fastddpm bench ladder --data "$FASTDDPM_FMNIST_DIR" --out "$OUT/ladder" 2>&1 |
        tee "$OUT/ladder.log" ;;
    doctor)
      echo "== doctor: planted faults on the GPU, watch overhead, the fast path's own diagnosis"
      timeout 200 $PY -m fastddpm.doctor.planted --device cuda --out "$OUT/doctor_planted" 2>&1 |
        tee "$OUT/doctor_planted.log"
      timeout 200 $PY benchmarks/doctor_overhead.py --device cuda --data "$FASTDDPM_FMNIST_DIR" \
        --out "$OUT/doctor_overhead.json" 2>&1 | tee "$OUT/doctor_overhead.log"
      timeout 150 $PY -m fastddpm doctor train --data "$FASTDDPM_FMNIST_DIR" --report-dir "$OUT/doctor_fastpath" \
        2>&1 | tee "$OUT/doctor_fastpath.log" ;;
    *) echo "unknown part $part (tests, throughput, ladder, doctor)"; exit 2 ;;
  esac
done
