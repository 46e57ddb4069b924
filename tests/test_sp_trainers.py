"""Ulysses sequence parallelism end to end: GRPO, PPO (actor and critic), DPO and the facade loop with
`sequence_parallel_size=2` over 2 real processes (one data-parallel rank whose sequences are split in two) give one
process's three losses and final weights (`tests/distributed/parity.py` with PARITY_SP=2), on DDP, FSDP2 and ZeRO-2."""

import json

import pytest

from tests.test_parallel_backends import _failure, _launch, assert_same_run, baselines  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


CASES = [(backend, algo) for backend in ("ddp", "fsdp2") for algo in ("grpo", "ppo", "dpo", "facade")]
CASES += [("zero2", "grpo"), ("zero2", "dpo")]  # DeepSpeed: its data-parallel group is the world, as DDP's


@pytest.mark.parametrize("backend, algo", CASES)
def test_sp2_run_equals_one_process(baselines, tmp_path, backend, algo):  # noqa: F811
    proc = _launch(f"{backend}_cpu.yaml", algo, tmp_path, PARITY_SP="2")
    assert proc.returncode == 0, _failure(proc)
    want = json.loads((baselines[algo] / "result.json").read_text())
    got = json.loads((tmp_path / "result.json").read_text())
    assert (got["world"], got["dp_size"], got["sp"]) == (2, 1, 2)
    assert got["attention"] == "hf_verl_ulysses"
    assert_same_run(want, got, baselines[algo], tmp_path, algo)
