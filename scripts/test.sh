#!/usr/bin/env bash
# Install hf_verl with every CPU backend into .venv (CPU torch first) and run the tests.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
python -m pytest -q "$@"
