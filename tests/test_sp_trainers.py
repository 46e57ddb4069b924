"""Ulysses sequence parallelism end to end: GRPO, PPO (actor and critic), DPO and the facade loop with
`sequence_parallel_size=2` over 2 real processes (one data-parallel rank whose sequences are split in two) give one
process's three losses and final weights (`tests/distributed/parity.py` with PARITY_SP=2), on DDP and FSDP2."""

import json

import pytest

from tests.test_parallel_backends import _failure, _launch, _weights, baselines  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dpo", "facade"])
@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_sp2_run_equals_one_process(baselines, tmp_path, backend, algo):  # noqa: F811
    proc = _launch(f"{backend}_cpu.yaml", algo, tmp_path, PARITY_SP="2")
    assert proc.returncode == 0, _failure(proc)
    want = json.loads((baselines[algo] / "result.json").read_text())
    got = json.loads((tmp_path / "result.json").read_text())
    assert (got["world"], got["dp_size"], got["sp"]) == (2, 1, 2)
    assert got["attention"] == "hf_verl_ulysses"
    assert len(got["losses"]) == 3
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    for key, values in want["extra"].items():
        assert got["extra"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    for sub in ([""] + (["critic"] if algo in ("ppo", "facade") else [])):
        a, b = _weights(baselines[algo], sub), _weights(tmp_path, sub)
        assert set(a) == set(b)
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 2e-5, (sub, worst)
