#!/usr/bin/env bash
# The GPU cells of benchmarks/matrix.py (a Qwen2.5-0.5B-shaped model, bf16, one CUDA device), hf_verl against
# TRL 1.16, on a machine that can reach no package registry: the wheels it lacks travel in .whl/ (made with
# `pip download --no-deps --python-version 3.12 ... -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1
# multiprocess==0.70.19`, and pyarrow==24.0.0 into .whl/opt for an older pyarrow). Results: $OUT/gpu.json,
# $OUT/log.txt, $OUT/env.txt. Usage: OUT=/tmp/out bash benchmarks/gpu_matrix.sh [seconds] [pairs]
# About 2.5 minutes per GRPO pair and 1 per DPO pair on an H200, after a warm-up run of each side.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_matrix}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
if ! python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/opt/pyarrow-*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, accelerate, datasets, trl, pyarrow
print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__,
      'datasets', datasets.__version__, 'trl', trl.__version__, 'pyarrow', pyarrow.__version__)"
} 2>&1 | tee "$OUT/env.txt"
timeout "${1:-420}" python3 benchmarks/matrix.py --cells gpu-grpo,gpu-dpo --pairs "${2:-3}" --warmup --json "$OUT/gpu.json" 2>&1 \
  | grep -v -E "UserWarning|is_vllm_available|examples/s\]" | tee "$OUT/log.txt"
