#!/bin/bash
# The evaluation half of run.sh, cut to the points that fit the session: FID (fastddpm features, 2,000 samples,
# sampling in the CPU's bf16 via --precision auto, eager) at SDE-DPM-Solver++(2M) 10 and 20, UniPC 10, Heun 5 and 10
# (9 and 19 calls) and Euler 10 and 20, sampling seed 0. Usage: COMMIT=<sha> bash eval.sh OUTDIR
set -u
cd /work/main
SNAP=/tmp/objsnap-${COMMIT:?set COMMIT}
export PYTHONPATH=$SNAP/src FASTDDPM_COMMIT=$COMMIT
F=.venv/bin/fastddpm
OUT=${1:-/tmp/obj}
for point in dpmpp-2m-sde:20 euler:20 heun:10 dpmpp-2m-sde:10 euler:10 heun:5 unipc:10; do
  for name in ddpm-eps-cosine ddpm-eps-linear ddpm-v-cosine edm flow; do
    s=${point%%:*}; k=${point##*:}
    grep -q "^done:" "$OUT/$name.train.log" 2>/dev/null || continue  # trained to the end only
    ls "$OUT/$name/eval-$s-$k"/eval_*.json >/dev/null 2>&1 && continue
    echo "== $(date -u +%FT%TZ) eval $name $s $k"
    $F eval --checkpoint "$OUT/$name" --num-samples 2000 --compile off --no-progress \
      --sampler "$s" --steps "$k" --out "$OUT/$name/eval-$s-$k" 2>&1 | tail -1
  done
done
echo "== done $(date -u +%FT%TZ)"
