#!/bin/bash
# The doctor on a bf16 accelerate loop, on a CPU without native bf16 (no avx512_bf16 / amx_bf16): its verdict, the
# fix in the script's terms, and that fix tried (3 rounds alternating with the unchanged script).
# Usage, from the repository root: bash benchmarks/cpu/2026-11-26-doctor-emulated-bf16/run.sh
set -eu
HERE=benchmarks/cpu/2026-11-26-doctor-emulated-bf16
grep -qw avx512_bf16 /proc/cpuinfo && { echo "this CPU has avx512_bf16: bf16 is native here, not the case measured"; exit 2; }
.venv/bin/fastddpm doctor run --try 2 --report-dir "$HERE/report" "$HERE/train_acc.py" --mixed_precision bf16 \
  2>&1 | tee "$HERE/doctor.log"
