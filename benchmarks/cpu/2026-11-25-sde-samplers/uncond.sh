#!/bin/bash
# Issue 16 follow-up: SDE-DPM-Solver++(2M) on an unconditional cpu-demo like the #16 table's (fp32, 100k images)
cd /work/main; export PYTHONPATH=/tmp/s9/snap/src
F=.venv/bin/fastddpm
echo "== $(date -u +%FT%TZ) train uncond"
/usr/bin/time -f "wall %e s" $F train --data fashion-mnist --preset cpu-demo --precision fp32 --no-progress --out /tmp/s9/uncond
echo "== $(date -u +%FT%TZ) bench samplers"
$F bench samplers /tmp/s9/uncond --out /tmp/s9/bench-samplers --precision fp32 --compile off --no-ddpm \
   --samplers ddim,unipc --steps 5,20 --spread-points none
$F bench samplers /tmp/s9/uncond --out /tmp/s9/bench-samplers --precision fp32 --compile off --no-ddpm \
   --samplers dpmpp-2m-sde --steps 10,20,50,100 --spread-points dpmpp-2m-sde-20,dpmpp-2m-sde-50
echo "== done $(date -u +%FT%TZ)"
