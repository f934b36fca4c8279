#!/bin/bash
# Issue 33, first pass on this CPU (AMD EPYC Zen 5, 2 cores, avx512_bf16): the unconditional cpu-demo (0.6M U-Net,
# 150k images, bf16 auto, the quickstart's budget) trained once per objective, then FID (fastddpm features, 2,000
# samples, fp32 sampling, eager) with each objective's candidate samplers at ~10 and ~20 network calls.
# Training seed 0 only (the spread over training seeds is not measured here); sampling seed 0.
# Usage: COMMIT=<sha> bash run.sh OUTDIR   (raw logs and eval JSON under OUTDIR)
set -u
cd /work/main
# the code measured: a snapshot of the commit, so that edits to the working tree during the run do not leak in
SNAP=/tmp/objsnap-${COMMIT:?set COMMIT}
[ -d "$SNAP/src" ] || { mkdir -p "$SNAP" && git archive "$COMMIT" src | tar -x -C "$SNAP"; }
export PYTHONPATH=$SNAP/src FASTDDPM_COMMIT=$COMMIT
F=.venv/bin/fastddpm
OUT=${1:-/tmp/obj}
mkdir -p "$OUT"
# each objective in full: the presets' own objective moved (cpu-demo trains flow since 8ad213f), so an objective
# left to the preset would train something else at a later commit
declare -A OPTS=(
  [ddpm-eps-cosine]="--objective ddpm --schedule cosine"
  [ddpm-eps-linear]="--objective ddpm --schedule linear"
  [ddpm-v-cosine]="--objective ddpm --schedule cosine --prediction v"
  [edm]="--objective edm"
  [flow]="--objective flow"
)
for name in ddpm-eps-cosine ddpm-eps-linear ddpm-v-cosine edm flow; do
  if [ ! -f "$OUT/$name/ema.safetensors" ]; then
    echo "== $(date -u +%FT%TZ) train $name"
    /usr/bin/time -f "wall %e s" $F train --data fashion-mnist --preset cpu-demo ${OPTS[$name]} --no-progress \
      --sample-every-images 1000000 --out "$OUT/$name" > "$OUT/$name.train.log" 2>&1
    tail -2 "$OUT/$name.train.log"
  fi
done
for name in ddpm-eps-cosine ddpm-eps-linear ddpm-v-cosine edm flow; do
  for point in dpmpp-2m-sde:10 dpmpp-2m-sde:20 unipc:10 unipc:20 heun:5 heun:10 euler:10 euler:20; do
    s=${point%%:*}; k=${point##*:}
    echo "== $(date -u +%FT%TZ) eval $name $s $k"
    $F eval --checkpoint "$OUT/$name" --num-samples 2000 --precision fp32 --compile off --no-progress \
      --sampler "$s" --steps "$k" --out "$OUT/$name/eval-$s-$k" 2>&1 | tail -1
  done
done
echo "== done $(date -u +%FT%TZ)"
