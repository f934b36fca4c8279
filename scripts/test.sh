#!/usr/bin/env bash
# Set up (venv, CPU torch where there is no GPU, pytest, the Fashion-MNIST files), then run the test suite.
# Extra arguments go to pytest (after ours, so `-n 0` overrides a worker count).
#
# FASTDDPM_TEST_WORKERS=N splits the suite between N pytest-xdist workers, each with one torch thread (set for the
# environment, so the processes the tests start, resumes compared bit for bit and torchrun ranks, run as the worker
# that compares them does). On a 2-core CPU two workers took 13:25 and 12:55 (2026-11-29) where one process with two
# threads takes ~17 minutes, since a tiny model's ops are too small to share between threads; but a doctor test
# that times a single profiled step (test_the_breakdown_adds_up_and_the_optimizer_is_not_charged_the_profilers_stop)
# failed in two of three such runs (one beside other jobs) and in no run in one process, so one process stays the default (CI runs it so).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup.sh
if [ "${FASTDDPM_TEST_WORKERS:-1}" -gt 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  exec .venv/bin/python -m pytest -q -n "$FASTDDPM_TEST_WORKERS" "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
