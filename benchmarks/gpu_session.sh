#!/usr/bin/env bash
# What a GPU session measures, in parts sized for device calls of 10 minutes at most.
#
#   bash benchmarks/gpu_session.sh PART [PART ...]      (parts run in the order given)
#
# part               estimate on one H100, and what it runs ((r): resumable, see below)
#   tests             3-5 min      pytest -m cuda (graph capture vs eager, no host syncs, FSDP, eval, doctor)
#   throughput        3-5 min (r)  bench throughput, seed-1layer at batch 64, 192, 512, 1024
#   throughput-2layer 4-6 min (r)  bench throughput, seed-2layer at the same batch sizes
#   throughput-cifar10 6-10 min (r) bench throughput, ddpm-cifar10 (35.7M, 3x32x32) at 128 and 512: plain, with
#                                  gradient checkpointing (peak memory saved vs step time), channels_last (two calls)
#   ladder            3-5 min (r)  bench ladder rungs 0-5 (PNG files ... compile) and the MLP ladder
#   ladder-fast       4-6 min (r)  bench ladder rungs 6-10 (resident ... auto batch, auto layouts), same ladder.json
#   doctor            4-6 min      planted faults on the GPU; watch overhead; a full `doctor train` profile
#   doctor-overhead   2-4 min      the watch overhead and the full profile alone (what `doctor` runs after the
#                                  planted faults)
#   doctor-try        5-7 min      doctor run --try 3 on the seed-style script: its top fixes measured on the GPU
#   doctor-fast       3-5 min      doctor train on the fast path (bf16, compiled, CUDA graphs): seed-1layer at
#                                  1024, ddpm-cifar10 at 128; top kernels, MFU, % of roofline and the side that binds
#   candidates        5-7 min (r)  bench throughput, compiled: seed-1layer at 1024 with its defaults since 2026-11-28
#                                  (channels_last, Inductor's layout forced, heads padded to 8) against channels_last
#                                  alone (its default before); ddpm-cifar10 at 512 with the layout forced and without
#   doctor-fast-cl    2-3 min      doctor train on the fast path with channels_last: ddpm-cifar10 at 128, seed-1layer
#                                  at 1024 (what binds once the conversions are gone; measured 2026-11-27)
#   attention         1-2 min      benchmarks/sdpa_shapes.py: each attention shape of seed-1layer (batch 1024) and
#                                  ddpm-cifar10 (128), forward + backward on every SDPA backend and zero-padded to
#                                  head dimensions 8, 16, 32 (the same function)
#   vs-diffusers      2-3 min      benchmarks/vs_diffusers.py: ddpm-cifar10's network at 128, fastddpm's step against
#                                  diffusers' train_unconditional.py step (bf16 both), alternating; diffusers
#                                  travels as wheels in .whl where the machine lacks it (RESULTS.md, how to run)
#   candidates-ma     5-9 min (r)  bench throughput, seed-1layer at 1024 with its defaults, compiled with and without
#                                  Inductor's max-autotune (its kernel search alone ran past 263 s on an H200)
#   ddp               5-7 min      DDP and FSDP at world size 1 vs the plain path (2 repeats)
#   quality-reference 3-5 min      the seed's recipe once (seed-1layer, 40 epochs): its final FID is the target
#   eval              1-2 min      fastddpm eval of that reference run (only in the same call, after it)
#   samplers          3-5 min      bench samplers on that reference run: FID vs NFE, 5,000 samples a point, DDPM-1000
#   samplers-sde      1-2 min      SDE-DPM-Solver++(2M) alone on that run, 10, 20 (3 seeds), 50 steps: the default
#   quality-fast      3-4 min      the fast recipe's wall time to the target (needs quality-reference's file)
#   quality-options   3-5 min      min-snr-5, v-prediction, cosine on the fast recipe (needs quality-fast's file)
#   quality-options-2 3-5 min      no-ema-warmup, no-lr-warmup, lr-x2, likewise
#   quality-objectives 2-4 min     EDM and flow matching on the fast recipe, likewise (DDPM is the fast run itself)
#   summarize         seconds      benchmarks/summarize_gpu.py RESULTS: the RESULTS.md tables (also runs here)
# How these are estimated, and the call sequence: benchmarks/RESULTS.md, "GPU session: how to run it".
#
# One folder, RESULTS (default benchmarks/gpu/<UTC date>; GPU_RESULTS pins it), gets everything as it is
# measured. The call has a budget (BUDGET_S, default 540 s of the device tool's 600 s): a part starts only when
# the time left covers its estimate, and runs under a limit of the time left, so the call ends (and packs)
# before the tool would kill it. Parts marked (r) rewrite their files after every variant / rung and, run
# again into the same folder, skip what is already measured there: a part cut short resumes in the next call.
# The last line printed is the next call's command: the parts not started, cut short or failed.
#
# With the device tool ($OUT set), RESULTS is packed into $OUT/gpu-results.tar.gz after every part (traces,
# checkpoints and weights left out). Here, after each call, in the repository root:
#   tar -xzf <files_at>/gpu-results.tar.gz
# The folder is untracked and not ignored, so the next call's working tree carries it back to the device: that
# is how quality-fast finds the reference's quality.json and how throughput / ladder resume across calls.
#
# Before the first call (.data/ is git-ignored and travels with `carry`):
#   mkdir -p .data && cp -r /usr/share/datasets/fashion-mnist .data/
# Device tool call: command "COMMIT=<git rev-parse HEAD, here> bash benchmarks/gpu_session.sh PARTS",
# carry [".data"], timeout_s 600. (The device's copy of the tree may lack .git: COMMIT names the code.)
# On the device machine torch + CUDA, pillow, tqdm, safetensors, pyyaml, matplotlib and pytest are preinstalled,
# so the package runs from src/ without installing.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export FASTDDPM_FMNIST_DIR=${FASTDDPM_FMNIST_DIR:-$PWD/.data/fashion-mnist}
export FASTDDPM_CACHE=${FASTDDPM_CACHE:-/tmp/fastddpm-cache}
# the named source "fashion-mnist" (the MLP ladder's train and test splits) reads the carried copy from the cache:
# the device cannot download it
if [ -d "$FASTDDPM_FMNIST_DIR" ] && [ ! -d "$FASTDDPM_CACHE/downloads/fashion-mnist" ]; then
  mkdir -p "$FASTDDPM_CACHE/downloads" && cp -r "$FASTDDPM_FMNIST_DIR" "$FASTDDPM_CACHE/downloads/fashion-mnist"
fi
PY=${PYTHON:-python3}
DATA=$FASTDDPM_FMNIST_DIR
RES=${GPU_RESULTS:-benchmarks/gpu/$(date -u +%Y-%m-%d)}
QUALITY_DIR=${QUALITY_DIR:-/tmp/fastddpm-quality}  # run directories (checkpoints: large) stay on the machine
BUDGET_S=${BUDGET_S:-540}
START=$(date +%s)
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export FASTDDPM_COMMIT=$COMMIT  # every record names this commit, not the copied tree's .git (it can be stale)
PARTS=("$@")
AGAIN=()
ALL="tests throughput throughput-2layer throughput-cifar10 ladder ladder-fast doctor doctor-overhead doctor-try doctor-fast candidates doctor-fast-cl attention vs-diffusers candidates-ma ddp
     quality-reference eval samplers
     samplers-sde quality-fast
     quality-options quality-options-2 quality-objectives summarize"
if [ ${#PARTS[@]} -eq 0 ]; then
  echo "usage: bash benchmarks/gpu_session.sh PART [PART ...]; parts:" $ALL; exit 2
fi
for part in "${PARTS[@]}"; do
  case " $(echo $ALL) " in *" $part "*) ;; *) echo "unknown part $part; parts:" $ALL; exit 2 ;; esac
done
mkdir -p "$RES/calls" "$RES/logs"

pack() {  # RESULTS -> $OUT/gpu-results.tar.gz (one file: the tool returns at most 8), renamed into place
  [ -n "${OUT:-}" ] || return 0
  tar -czf "$OUT/gpu-results.tar.gz.part" --exclude='*.pt.trace.json' --exclude='*.safetensors' \
    --exclude='*.pt' --exclude='*.npz' "$RES" && mv -f "$OUT/gpu-results.tar.gz.part" "$OUT/gpu-results.tar.gz"
}
trap 'pack; exit 143' TERM INT

# The reference run's EMA weights (24 MB for seed-1layer) outlive the machine: packed into $OUT as parts of 15 MB
# (the tool returns files of 16 MiB at most), here joined into REF_KEPT under the carried .data/, so `eval` and
# `samplers` can run in a later call on a fresh machine:
#   mkdir -p .data/quality-reference && cat <files_at>/reference-ema.part-* > .data/quality-reference/ema.safetensors
REF_KEPT=.data/quality-reference/ema.safetensors
keep_reference() {
  local st="$QUALITY_DIR/quality-reference/reference/ema.safetensors"
  [ -f "$st" ] || { echo "!! no $st to keep"; return 0; }
  mkdir -p "$(dirname "$REF_KEPT")" && cp "$st" "$REF_KEPT"
  [ -n "${OUT:-}" ] && split -b 15M -d "$st" "$OUT/reference-ema.part-"
  echo "kept the reference's EMA weights: $REF_KEPT; here, join \$OUT's reference-ema.part-* into it and carry .data"
}
reference_weights() {  # the reference run on this machine, else the carried copy of its weights
  if [ -d "$QUALITY_DIR/quality-reference/reference" ]; then echo "$QUALITY_DIR/quality-reference/reference"
  elif [ -f "$REF_KEPT" ]; then echo "$REF_KEPT"
  else return 1; fi
}

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# limited NEED_S CMD...: CMD under `timeout` with the time left of this call's budget, if that covers NEED_S
limited() {
  local need=$1 t
  shift
  t=$(left)
  if (( t < need )); then
    echo "!! not started: it needs about ${need} s, ${t} s are left of this call's ${BUDGET_S} s: $*"
    return 125
  fi
  if [ -n "${GPU_SESSION_DRY:-}" ]; then  # print the command instead (the tests parse every part's command)
    printf 'DRY'; printf ' %q' "$@"; echo
    return 0
  fi
  echo "\$ $* (limit ${t} s)"
  timeout --signal=TERM --kill-after=15 "$t" "$@"
  local rc=$?
  if (( rc == 124 || rc == 137 )); then
    echo "!! stopped at its ${t} s limit: what it wrote so far is kept (throughput and ladder resume when run again)"
  fi
  return $rc
}

# The call's record: device, driver, torch, commit, command (every part's table names it).
$PY - "$COMMIT" "${PARTS[@]}" > "$RES/calls/$STAMP.json" <<'EOF'
import json, sys
import torch
from fastddpm.measure import environment_record
env = environment_record("cuda" if torch.cuda.is_available() else "cpu",
                         ["bash", "benchmarks/gpu_session.sh", *sys.argv[2:]])
env["commit_given"] = sys.argv[1]
print(json.dumps(env, indent=2, default=str))
EOF
{ echo "== call $STAMP: parts ${PARTS[*]}; results in $RES; commit $COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,temperature.gpu --format=csv 2>&1
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee -a "$RES/session.log"

resume_quality() {  # the runs an earlier call of this part finished (quality.partial.json) back where it resumes
  if [ -f "$RES/$1/quality.partial.json" ] && [ ! -f "$QUALITY_DIR/$1/quality.partial.json" ]; then
    mkdir -p "$QUALITY_DIR/$1" && cp "$RES/$1/quality.partial.json" "$QUALITY_DIR/$1/"
  fi
  return 0
}

keep_partial() {  # after a quality part, finished or cut short: its finished runs into RESULTS (the next call's)
  rm -f "$RES/$1/quality.partial.json"
  if [ -f "$QUALITY_DIR/$1/quality.partial.json" ]; then
    mkdir -p "$RES/$1" && cp "$QUALITY_DIR/$1/quality.partial.json" "$RES/$1/"
  fi
  return 0
}

copy_quality() {  # the small files of a quality run (not its checkpoints) into RESULTS
  mkdir -p "$RES/$1" && cp "$QUALITY_DIR/$1"/quality.{json,md} "$RES/$1/" && cp "$QUALITY_DIR/$1"/quality.png "$RES/$1/" 2>/dev/null
  return 0
}

for part in "${PARTS[@]}"; do
  log="$RES/logs/$part.log"
  t0=$(date +%s)
  echo "== $part ($(left) s left of this call's budget)" | tee -a "$log"
  case $part in
    tests)
      mkdir -p "$RES/tests"
      limited 240 $PY -m pytest -q -m cuda -p no:cacheprovider --junitxml="$RES/tests/junit.xml" tests ;;
    throughput)
      limited 90 $PY -m fastddpm bench throughput --presets seed-1layer --out "$RES/throughput-seed-1layer" ;;
    throughput-2layer)
      limited 90 $PY -m fastddpm bench throughput --presets seed-2layer --out "$RES/throughput-seed-2layer" ;;
    throughput-cifar10)
      limited 90 $PY -m fastddpm bench throughput --presets ddpm-cifar10 --batch-sizes 128,512 \
        --choices auto-auto,auto-auto-gc,auto-auto-cl --out "$RES/throughput-ddpm-cifar10" ;;
    ladder)
      limited 120 $PY -m fastddpm bench ladder --data "$DATA" --rungs 0,1,2,3,3b,4,5 --out "$RES/ladder" ;;
    ladder-fast)
      # the MLP ladder's rows are reused from `ladder` (measured here only if that call did not get to them)
      limited 120 $PY -m fastddpm bench ladder --data "$DATA" --rungs 6,7,8,9,10 --out "$RES/ladder" ;;
    doctor)
      mkdir -p "$RES/doctor"
      limited 300 $PY -m fastddpm.doctor.planted --device cuda --out "$RES/doctor/planted" 2>&1 |
        tee "$RES/doctor/planted.txt"
      planted=${PIPESTATUS[0]}
      # not yet claimed on a GPU (planted.CPU_ONLY): what the doctor says there is recorded, its exit ignored
      limited 60 $PY -m fastddpm.doctor.planted --device cuda --cases per-sample-loss \
        --out "$RES/doctor/planted-unclaimed" > "$RES/doctor/planted-unclaimed.txt" 2>&1
      limited 200 $PY benchmarks/doctor_overhead.py --device cuda --repeats 5 --data "$DATA" \
        --report-dir "$RES/doctor/fastpath" --out "$RES/doctor/overhead.json"
      overhead=$?
      (( planted != 0 )) && exit "$planted"  # this case runs in the pipeline's subshell: exit ends only the part
      exit "$overhead" ;;
    doctor-overhead)  # the watch overhead and the full profile alone (the `doctor` part's second half)
      mkdir -p "$RES/doctor"
      limited 200 $PY benchmarks/doctor_overhead.py --device cuda --repeats 5 --data "$DATA" \
        --report-dir "$RES/doctor/fastpath" --out "$RES/doctor/overhead.json" ;;
    doctor-try)  # the prediction of each top fix against its measured gain, on the unchanged seed-style script
      png=${TMPDIR:-/tmp}/fastddpm-doctor-try-png
      limited 60 $PY -m fastddpm data export-images "$DATA" "$png" --limit 6000 &&
        limited 400 $PY -m fastddpm doctor run --try 3 --max-seconds 60 --report-dir "$RES/doctor-try" \
          examples/seed_ddpm/train.py --data "$png" --epochs 100 ;;
    doctor-fast)  # the fast path profiled by its own doctor; CIFAR-10's shape from Fashion-MNIST (no download here)
      limited 200 $PY -m fastddpm doctor train --preset seed-1layer --batch-size 1024 --data "$DATA" \
        --max-seconds 60 --report-dir "$RES/doctor-fast/seed-1layer-1024" &&
        limited 240 $PY -m fastddpm doctor train --preset ddpm-cifar10 --batch-size 128 --data "$DATA" --resize 32 \
          --image-mode RGB --max-seconds 60 --report-dir "$RES/doctor-fast/ddpm-cifar10-128" ;;
    candidates)  # the defaults auto took on 2026-11-28, together, against the defaults before them. Each was
      # measured alone against the previous default on an H200 (benchmarks/gpu/2026-11-28/throughput-candidates-lo-*:
      # Inductor's layout forced 1.18x on ddpm-cifar10 and 1.02x on seed-1layer, heads padded to 8 1.05x on
      # seed-1layer); this round times seed-1layer with both (its default now) against channels_last alone (its
      # default before), and ddpm-cifar10 at 512 with the forced layout against the heuristic
      limited 200 $PY -m fastddpm bench throughput --presets seed-1layer --batch-sizes 1024 \
        --choices auto-compile-cl,auto-compile-cl-lo-ap8 --out "$RES/throughput-candidates-auto-seed-1layer"
      first=$?  # a failed row of one model (exit 1) must not cost the other model's timing
      limited 250 $PY -m fastddpm bench throughput --presets ddpm-cifar10 --batch-sizes 512 \
        --choices auto-compile,auto-compile-lo --out "$RES/throughput-candidates-auto-ddpm-cifar10-512" \
        && (exit $first) ;;
    doctor-fast-cl)  # doctor-fast with channels_last: does the conversion go, and what binds then
      limited 150 $PY -m fastddpm doctor train --preset ddpm-cifar10 --batch-size 128 --data "$DATA" --resize 32 \
        --image-mode RGB --channels-last on --max-seconds 60 --report-dir "$RES/doctor-fast-cl/ddpm-cifar10-128" &&
        limited 120 $PY -m fastddpm doctor train --preset seed-1layer --batch-size 1024 --data "$DATA" \
          --channels-last on --max-seconds 60 --report-dir "$RES/doctor-fast-cl/seed-1layer-1024" ;;
    attention)
      mkdir -p "$RES/attention"
      limited 45 $PY benchmarks/sdpa_shapes.py --presets seed-1layer --batch-size 1024 \
        --out "$RES/attention/seed-1layer-1024.json" &&
        limited 45 $PY benchmarks/sdpa_shapes.py --presets ddpm-cifar10 --batch-size 128 \
          --out "$RES/attention/ddpm-cifar10-128.json" ;;
    vs-diffusers)  # diffusers is not on the device machine's image: its wheel (pure Python) travels in .whl
      if ! $PY -c "import diffusers" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
          export PYTHONPATH=$PYTHONPATH:/tmp/site
      fi
      limited 150 $PY benchmarks/vs_diffusers.py --device cuda --batch-sizes 128 --out "$RES/vs-diffusers" ;;
    candidates-ma)  # on top of seed-1layer's defaults since 2026-11-28 (channels_last, the layout forced, heads 8)
      limited 300 $PY -m fastddpm bench throughput --presets seed-1layer --batch-sizes 1024 \
        --choices auto-compile-cl-lo-ap8,auto-compile-cl-lo-ap8-ma --out "$RES/throughput-candidates-ma-seed-1layer" ;;
    ddp)
      mkdir -p "$RES/ddp"
      limited 360 $PY benchmarks/ddp_overhead.py --data "$DATA" --repeats 2 --parallel ddp,fsdp \
        --out "$RES/ddp/ddp_overhead.json" ;;
    quality-reference)
      limited 300 $PY -m fastddpm bench quality --reference-only --data "$DATA" --out "$QUALITY_DIR/quality-reference" &&
        copy_quality quality-reference && keep_reference ;;
    eval)
      if ! ref=$(reference_weights); then
        echo "!! eval needs the reference run's weights: run \"quality-reference eval\" in one call, or carry $REF_KEPT"
        false
      else
        limited 90 $PY -m fastddpm eval --checkpoint "$ref" --num-samples 10000 \
          --sampler ddim --steps 50 --out "$RES/eval" --no-progress
      fi ;;
    samplers)
      if ! ref=$(reference_weights); then
        echo "!! samplers needs the reference run's weights: run \"quality-reference samplers\" in one call, or carry $REF_KEPT"
        false
      else
        limited 270 $PY -m fastddpm bench samplers "$ref" --num-samples 5000 --out "$RES/samplers"
      fi ;;
    samplers-sde)  # into the same folder as `samplers`: one table
      if ! ref=$(reference_weights); then
        echo "!! samplers-sde needs the reference run's weights: run \"quality-reference samplers-sde\" in one call"
        false
      else
        limited 120 $PY -m fastddpm bench samplers "$ref" --num-samples 5000 --samplers dpmpp-2m-sde \
          --steps 10,20,50 --no-ddpm --spread-points dpmpp-2m-sde-20 --out "$RES/samplers"
      fi ;;
    quality-fast)
      if [ -n "${TARGET_FID:-}" ]; then target=(--target-fid "$TARGET_FID")
      else target=(--reference-from "$RES/quality-reference/quality.json"); fi
      limited 240 $PY -m fastddpm bench quality "${target[@]}" --data "$DATA" --out "$QUALITY_DIR/quality-fast" &&
        copy_quality quality-fast ;;
    quality-options|quality-options-2|quality-objectives)
      case $part in
        quality-options) options=min-snr-5,v-prediction,cosine ;;
        quality-options-2) options=no-ema-warmup,no-lr-warmup,lr-x2 ;;
        *) options=edm,flow ;;
      esac
      resume_quality "$part"  # a call cut short trains only the options it had not finished
      limited 240 $PY -m fastddpm bench quality --fast-from "$RES/quality-fast/quality.json" --options "$options" \
        --data "$DATA" --out "$QUALITY_DIR/$part"
      rc=$?
      keep_partial "$part"
      if (( rc == 0 )); then copy_quality "$part"; fi
      (exit $rc) ;;
    summarize)
      $PY benchmarks/summarize_gpu.py "$RES" ;;
  esac 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  (( rc != 0 )) && AGAIN+=("$part")
  printf '{"call": "%s", "part": "%s", "rc": %d, "wall_s": %d, "commit": "%s"}\n' \
    "$STAMP" "$part" "$rc" $(( $(date +%s) - t0 )) "$COMMIT" >> "$RES/calls/parts.jsonl"
  echo "== $part: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$RES/session.log"
  pack
done
echo "results in $RES$([ -n "${OUT:-}" ] && echo "; packed in \$OUT/gpu-results.tar.gz")"
if [ ${#AGAIN[@]} -gt 0 ]; then
  echo "next call (parts not started, cut short or failed): bash benchmarks/gpu_session.sh ${AGAIN[*]}"
else
  echo "every part finished (exit 0)"
fi
