#!/bin/bash
# Issue 16: the ODE points still missing on the retrained unconditional checkpoint, and the SDE default's W on the
# conditional one (seed spread at W = 2; W = 1.5 and 2.5 beside it)
cd /work/main
F=.venv/bin/fastddpm
B="$F bench samplers /tmp/s9/uncond --out /tmp/s9/bench-samplers --precision fp32 --compile off --no-ddpm"
echo "== $(date -u +%FT%TZ) unipc 10"; $B --samplers unipc --steps 10 --spread-points none
echo "== $(date -u +%FT%TZ) dpmpp-2m 20"; $B --samplers dpmpp-2m --steps 20 --spread-points none
echo "== $(date -u +%FT%TZ) cond sde-20 W=2 seeds"
$F bench samplers /tmp/s9/q/bf16-s1 --out /tmp/s10/cond-sde --precision fp32 --compile off --no-ddpm --guidance 2 \
   --samplers dpmpp-2m-sde --steps 20 --spread-points dpmpp-2m-sde-20
echo "== $(date -u +%FT%TZ) cond sde-20 W=1.5,2.5"
$F eval --checkpoint /tmp/s9/q/bf16-s1 --num-samples 2000 --guidance 1.5,2.5 --precision fp32 --compile off \
   --no-progress --sampler dpmpp-2m-sde --steps 20 --out /tmp/s10/cond-w
echo "== $(date -u +%FT%TZ) ddim 100"; $B --samplers ddim --steps 100 --spread-points none
echo "== done $(date -u +%FT%TZ)"
