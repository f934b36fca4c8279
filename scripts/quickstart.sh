#!/usr/bin/env bash
# The main job: set up, then train a diffusion model on Fashion-MNIST, writing checkpoints and sample grids.
#   On a machine without a GPU: the cpu-demo-cond preset, by flow matching (set-up included: about 9.5 minutes on a
#   2-core EPYC with native bf16, 6 on 2 Zen 5 cores for the DDPM it replaced, which costs the same per image; about
#   23 minutes on a 2-core AVX2-only EPYC, in fp32): a class-conditional demo whose final grid has one row per class.
#   With a GPU: the seed's full recipe (seed-1layer: 6.1M-parameter U-Net, batch 192, 40 epochs).
# Extra arguments go to `fastddpm train` (e.g. --preset tiny, --max-images 50000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-runs/quickstart}
exec .venv/bin/fastddpm train --data fashion-mnist --out "$OUT" --resume latest "$@"
