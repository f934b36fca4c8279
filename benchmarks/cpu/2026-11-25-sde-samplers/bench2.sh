#!/bin/bash
# Issue 18 on this CPU (AMD EPYC Zen 5, 2 cores, avx512_bf16): side by side, compile A/B, seed-1layer, the CPU ladder
cd /work/main; export PYTHONPATH=/tmp/s9/snap/src FASTDDPM_COMMIT=c249876
F=.venv/bin/fastddpm
echo "== $(date -u +%FT%TZ) choices"; $F bench throughput --device cpu --out /tmp/s9/tp4
for k in 1 2; do echo "== $(date -u +%FT%TZ) compile A/B $k"
  $F bench throughput --device cpu --presets cpu-demo --batch-sizes 64 --choices bf16-eager,bf16-compile,fp32-eager --out /tmp/s9/ab$k; done
echo "== $(date -u +%FT%TZ) seed-1layer"
$F bench throughput --device cpu --presets seed-1layer --batch-sizes 64 --choices fp32-eager,bf16-eager,bf16-compile --warmup-steps 3 --steps 10 --repeats 3 --out /tmp/s9/tp-seed1
echo "== $(date -u +%FT%TZ) ladder"
timeout 1500 $F bench ladder --preset cpu-demo --skip-mlp --steps 30 --repeats 3 --out /tmp/s9/ladder
echo "== done $(date -u +%FT%TZ)"
