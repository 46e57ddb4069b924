"""The shipped CPU accelerate configs as a user runs them: `accelerate launch --config_file
configs/accelerate/<x>_cpu.yaml`, with no extra environment variable (no ACCELERATE_USE_CPU, no DS_ACCELERATOR) and
no `use_cpu` in the training config, on this machine without GPUs.

Each launch runs `tests/distributed/parity.py`'s GRPO (or DPO) over 2 real processes on gloo and must train on the
backend its config names, with 2 data-parallel ranks, and give the single-process run's losses and final weights
(`assert_same_run`, tests/test_parallel_backends.py). `sp2_cpu.yaml` asks for sequence parallelism through
accelerate's `parallelism_config` sp_size only (`tests/distributed/launch_sp.py` sets no `sequence_parallel_size`):
the run must be hf_verl's Ulysses with sp=2 (one data-parallel rank); so must accelerate's own documented shape
for it (DeepSpeed with an ALST `parallelism_config`). A GPU config on this machine keeps its error
(`test_a_gpu_config_on_a_cpu_machine_fails_fast_naming_the_field` in tests/test_parallel_backends.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_parallel_backends import _failure, _free_port, assert_same_run, baselines  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# what a user's shell would not have: every variable that could stand in for the config's own fields
NOT_SET = ("ACCELERATE_USE_CPU", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_PARALLELISM_CONFIG",
           "HF_VERL_LAUNCH_SP_SIZE")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in NOT_SET and not k.startswith("PARALLELISM_CONFIG_")}
    # PARITY_USE_CPU=0: the training configs leave use_cpu unset, so only the accelerate config can ask for the CPU
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PARITY_USE_CPU="0")
    return env


def _launch(config: str, module: str, algo: str, out: Path) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/<config>` (relative, as the docs write it) or a path."""
    path = config if os.path.isabs(config) else f"configs/accelerate/{config}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", path,
           "--main_process_port", str(_free_port()), "-m", module, algo, str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("config, label, param_type", [
    ("ddp_cpu.yaml", "ddp", "Parameter"),
    ("fsdp2_cpu.yaml", "fsdp2", "DTensor"),
    pytest.param("zero2_cpu.yaml", "deepspeed ZeRO-2", "Parameter", marks=pytest.mark.optional_backend),
    pytest.param("zero3_cpu.yaml", "deepspeed ZeRO-3", "Parameter", marks=pytest.mark.optional_backend),
])
def test_a_cpu_config_trains_as_shipped(baselines, tmp_path, config, label, param_type):  # noqa: F811
    if config.startswith("zero"):
        pytest.importorskip("deepspeed")
    proc = _launch(config, "tests.distributed.parity", "grpo", tmp_path)
    assert proc.returncode == 0, _failure(proc)
    got = json.loads((tmp_path / "result.json").read_text())
    assert (got["backend"], got["world"], got["dp_size"], got["sp"]) == (label, 2, 2, 1)
    assert got["param_type"] == param_type and got["zero3_partitioned"] == (config == "zero3_cpu.yaml")
    want = json.loads((baselines["grpo"] / "result.json").read_text())
    assert_same_run(want, got, baselines["grpo"], tmp_path, "grpo")


@pytest.mark.parametrize("algo", ["grpo", "dpo"])
def test_the_sp2_config_trains_with_ulysses_sp2(baselines, tmp_path, algo):  # noqa: F811
    proc = _launch("sp2_cpu.yaml", "tests.distributed.launch_sp", algo, tmp_path)
    assert proc.returncode == 0, _failure(proc)
    got = json.loads((tmp_path / "result.json").read_text())
    assert (got["backend"], got["world"], got["dp_size"], got["sp"]) == ("fsdp2", 2, 1, 2)
    assert got["attention"] == "hf_verl_ulysses"
    want = json.loads((baselines[algo] / "result.json").read_text())
    assert_same_run(want, got, baselines[algo], tmp_path, algo)


# accelerate's own documented shape for its sequence parallelism: DeepSpeed with an ALST parallelism_config
ACCELERATE_SP_SECTION = """parallelism_config:
  parallelism_config_dp_replicate_size: 1
  parallelism_config_dp_shard_size: 1
  parallelism_config_sp_size: 2
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_seq_length_is_variable: true
  parallelism_config_sp_attn_implementation: sdpa
"""


@pytest.mark.optional_backend
def test_accelerates_own_deepspeed_sp_config_runs_as_ulysses(baselines, tmp_path):  # noqa: F811
    pytest.importorskip("deepspeed")
    config = tmp_path / "zero2_sp2_cpu.yaml"
    config.write_text((ROOT / "configs" / "accelerate" / "zero2_cpu.yaml").read_text() + ACCELERATE_SP_SECTION)
    proc = _launch(str(config), "tests.distributed.launch_sp", "grpo", tmp_path)
    assert proc.returncode == 0, _failure(proc)
    got = json.loads((tmp_path / "result.json").read_text())
    assert (got["backend"], got["world"], got["dp_size"], got["sp"]) == ("deepspeed ZeRO-2", 2, 1, 2)
    assert got["attention"] == "hf_verl_ulysses"
    want = json.loads((baselines["grpo"] / "result.json").read_text())
    assert_same_run(want, got, baselines["grpo"], tmp_path, "grpo")
