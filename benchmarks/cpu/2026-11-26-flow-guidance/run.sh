#!/bin/bash
# Issue 33: the guidance scale for a conditional flow model. `--guidance` defaults to W = 2, a scale tuned on the
# DDPM (epsilon) model; this scores the conditional flow model of the objectives study (cpu-demo-cond, flow, fp32,
# training seed 2, trained by ../2026-11-25-objectives/seeds.sh with COND=1) at W = 1, 1.5, 2, 2.5, 3 with auto's
# guided sampler (UniPC-10), 2,000 samples, sampling seed 0, scored in the fp32 arm's feature network (the one
# seeds.sh loads into the cache), so W = 2 must repeat seeds.sh's own UniPC-10 point for that run.
# Usage: COMMIT=<sha> bash run.sh RUN_DIR   (RUN_DIR: /tmp/objseeds/cond-fp32/seed2/flow)
set -eu
cd /work/main
HERE=benchmarks/cpu/2026-11-26-flow-guidance
RUN=${1:?the conditional flow run directory}
SNAP=/tmp/objsnap-${COMMIT:?set COMMIT}
[ -d "$SNAP/src" ] || { mkdir -p "$SNAP" && git archive "$COMMIT" src | tar -x -C "$SNAP"; }
export PYTHONPATH=$SNAP/src FASTDDPM_COMMIT=$COMMIT
CACHE=${FASTDDPM_CACHE:-$HOME/.cache/fastddpm}
mkdir -p "$CACHE/features"
cp -n benchmarks/cpu/2026-11-25-objectives/raw-fp32/features/* "$CACHE/features/"
mkdir -p "$HERE/raw"
/usr/bin/time -f "wall %e s" .venv/bin/fastddpm eval --checkpoint "$RUN" --num-samples 2000 --compile off \
  --no-progress --sampler auto --precision fp32 --guidance 1,1.5,2,2.5,3 --out "$HERE/raw" 2>&1 | tee "$HERE/raw/eval.log"
