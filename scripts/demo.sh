#!/usr/bin/env bash
# Install hf_verl (same environment as the tests) and run the embedded demo: a tiny Llama learns
# to reverse strings with GRPO, offline, on a CPU. Extra arguments go to `hf-verl demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/install.sh
hf-verl demo "$@"
