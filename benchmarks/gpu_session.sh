#!/usr/bin/env bash
# What a GPU session measures, in few device calls (the device tool's budget favours few, full calls; one call
# may run 10 minutes, so split the parts over calls: e.g. "tests throughput", then "ladder").
#
#   bash benchmarks/gpu_session.sh [tests] [throughput] [ladder] [doctor] [quality-reference] [quality-fast]
#                                  [quality-options] [eval] [ddp]               (default: tests throughput)
#
# Time to quality needs the reference first (the seed's recipe, 40 epochs: its own call), then the fast run and
# the options against its target (the next calls, on the same warm machine: the runs live in $QUALITY_DIR; on a
# fresh machine pass the target instead: TARGET_FID=<reference final FID> bash ... quality-fast).
#
# Here, before the first call (once per session; .data/ is git-ignored and travels with `carry`):
#   mkdir -p .data && cp -r /usr/share/datasets/fashion-mnist .data/
# Device tool call: command "bash benchmarks/gpu_session.sh tests throughput", carry [".data"].
# On the device machine torch + CUDA, pillow, tqdm, safetensors, pyyaml, matplotlib and pytest are preinstalled,
# so the package runs from src/ without installing. Results land in $OUT (copied back by the tool); record them
# in benchmarks/RESULTS.md with the device, date, torch version, commit and command (env.txt has them).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export FASTDDPM_FMNIST_DIR=${FASTDDPM_FMNIST_DIR:-$PWD/.data/fashion-mnist}
export FASTDDPM_CACHE=${FASTDDPM_CACHE:-/tmp/fastddpm-cache}
OUT=${OUT:-/tmp/fastddpm-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PARTS=${*:-tests throughput}
QUALITY_DIR=${QUALITY_DIR:-/tmp/fastddpm-quality}  # run directories (checkpoints) stay on the device machine
QUALITY_REF=${QUALITY_REF:-$QUALITY_DIR/reference/quality.json}

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse HEAD 2>/dev/null || echo "commit unknown"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,temperature.gpu --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "parts: $PARTS"
} 2>&1 | tee "$OUT/env.txt"

for part in $PARTS; do
  case $part in
    tests)
      echo "== GPU tests (pytest -m cuda)"
      timeout 240 $PY -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" ;;
    throughput)
      echo "== throughput benchmark"
      timeout 330 $PY -m fastddpm bench throughput --out "$OUT/throughput" 2>&1 | tee "$OUT/throughput.log" ;;
    ladder)
      echo "== ladder (data: the carried Fashion-MNIST files)"
      timeout 560 $PY -m fastddpm bench ladder --data "$FASTDDPM_FMNIST_DIR" --out "$OUT/ladder" 2>&1 |
        tee "$OUT/ladder.log" ;;
    doctor)
      echo "== doctor: planted faults on the GPU, watch overhead, the fast path's own diagnosis"
      timeout 200 $PY -m fastddpm.doctor.planted --device cuda --out "$OUT/doctor_planted" 2>&1 |
        tee "$OUT/doctor_planted.log"
      timeout 200 $PY benchmarks/doctor_overhead.py --device cuda --data "$FASTDDPM_FMNIST_DIR" \
        --out "$OUT/doctor_overhead.json" 2>&1 | tee "$OUT/doctor_overhead.log"
      timeout 150 $PY -m fastddpm doctor train --data "$FASTDDPM_FMNIST_DIR" --report-dir "$OUT/doctor_fastpath" \
        2>&1 | tee "$OUT/doctor_fastpath.log" ;;
    quality-reference)
      echo "== time to quality: the seed's recipe once (seed-1layer, 40 epochs); its final FID is the target"
      timeout 580 $PY -m fastddpm bench quality --reference-only --data "$FASTDDPM_FMNIST_DIR" \
        --out "$QUALITY_DIR/reference" 2>&1 | tee "$OUT/quality_reference.log"
      mkdir -p "$OUT/quality-reference" && cp "$QUALITY_DIR"/reference/quality.{json,md,png} "$OUT/quality-reference/" ;;
    quality-fast|quality-options)
      if [ -n "${TARGET_FID:-}" ]; then target=(--target-fid "$TARGET_FID"); else target=(--reference-from "$QUALITY_REF"); fi
      options=(); [ "$part" = quality-options ] && options=(--options min-snr-5,v-prediction,cosine,no-ema-warmup,lr-x2)
      echo "== time to quality: $part (${target[*]})"
      timeout 580 $PY -m fastddpm bench quality "${target[@]}" "${options[@]}" --data "$FASTDDPM_FMNIST_DIR" \
        --out "$QUALITY_DIR/$part" 2>&1 | tee "$OUT/${part//-/_}.log"
      mkdir -p "$OUT/$part" && cp "$QUALITY_DIR/$part"/quality.{json,md,png} "$OUT/$part/" ;;
    eval)
      echo "== fastddpm eval: 10,000 DDIM-50 samples (bf16, compiled) from the reference run, samples/s and FID"
      timeout 400 $PY -m fastddpm eval --checkpoint "$QUALITY_DIR/reference/reference" --num-samples 10000 \
        --steps 50 --out "$OUT/eval" --no-progress 2>&1 | tee "$OUT/eval.log" ;;
    ddp)
      echo "== DDP and FSDP overhead at world size 1 (and scaling over all GPUs, if several)"
      timeout 580 $PY benchmarks/ddp_overhead.py --data "$FASTDDPM_FMNIST_DIR" --repeats 2 --parallel ddp,fsdp \
        --out "$OUT/ddp_overhead.json" 2>&1 | tee "$OUT/ddp_overhead.log" ;;
    *) echo "unknown part $part (tests, throughput, ladder, doctor, quality-reference, quality-fast, quality-options,"\
            "eval, ddp)"; exit 2 ;;
  esac
done
