#!/bin/bash
# SDE-DPM-Solver++(2M) on the conditional checkpoint (bf16-s1, 100k images) at W = 1 and 3, beside its UniPC-20 row
cd /work/main; export PYTHONPATH=/tmp/s9/snap/src FASTDDPM_COMMIT=c249876
F=.venv/bin/fastddpm
for k in 20 50 10; do echo "== $(date -u +%FT%TZ) sde $k"
  $F eval --checkpoint /tmp/s9/q/bf16-s1 --num-samples 2000 --guidance 1,3 --precision fp32 --compile off --no-progress --sampler dpmpp-2m-sde --steps $k; done
echo "== done $(date -u +%FT%TZ)"
