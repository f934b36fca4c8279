#!/bin/bash
cd /work/main; export PYTHONPATH=/tmp/s9/snap/src FASTDDPM_COMMIT=c249876
F=.venv/bin/fastddpm
while pgrep -f /tmp/s9/q/cond_sde.sh >/dev/null; do sleep 5; done
echo "== $(date -u +%FT%TZ) sde 20 W=2"
$F eval --checkpoint /tmp/s9/q/bf16-s1 --num-samples 2000 --guidance 2 --precision fp32 --compile off --no-progress --sampler dpmpp-2m-sde --steps 20 --out /tmp/s9/q/bf16-s1/eval-w2
echo "== $(date -u +%FT%TZ) unipc 20 W=2"
$F eval --checkpoint /tmp/s9/q/bf16-s1 --num-samples 2000 --guidance 2 --precision fp32 --compile off --no-progress --sampler unipc --steps 20 --out /tmp/s9/q/bf16-s1/eval-w2
echo "== done $(date -u +%FT%TZ)"
