#!/usr/bin/env bash
# Set up (venv, CPU torch where there is no GPU, pytest, the Fashion-MNIST files), then run the test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
