#!/usr/bin/env bash
# Set up (venv, CPU torch where there is no GPU, pytest, the Fashion-MNIST files), then run the test suite.
# Extra arguments go to pytest (after ours, so `-n 0` runs it in this one process).
#
# Without a GPU the suite runs in one pytest-xdist worker per CPU (at most 8), each with one torch thread: on a
# 2-core CPU that took 15:03 against 17:41 for one process with two threads (2026-11-29, the same tests), since a
# tiny model's ops are too small to share between threads. The thread count is set for the environment, so the
# processes the tests start (resumes compared bit for bit, torchrun ranks) run as the worker that compares them
# does. Each worker builds the session fixtures its own tests use (xdist's --dist loadgroup, which would keep a
# fixture's tests together, renames the tests' node ids, which pytest 9's nodes ignore). With an NVIDIA GPU the
# suite runs in one process (its timed GPU tests would share the device); FASTDDPM_TEST_WORKERS sets the count.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup.sh
if [ -z "${FASTDDPM_TEST_WORKERS:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    FASTDDPM_TEST_WORKERS=1
  else
    FASTDDPM_TEST_WORKERS=$(( $(nproc) < 8 ? $(nproc) : 8 ))
  fi
fi
if [ "$FASTDDPM_TEST_WORKERS" -gt 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  exec .venv/bin/python -m pytest -q -n "$FASTDDPM_TEST_WORKERS" "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
