"""GRPOTrainer under 2 real processes (torchrun, gloo): rewards gathered before group normalisation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_process_data_parallel(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           "-m", "tests.distributed.grpo_dp", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert "MULTI_CPU" in r0["distributed_type"]
    for r in (r0, r1):
        # the rank's advantages are its slice of the advantages over the gathered group
        assert r["advantages"] == pytest.approx(r["expected"], abs=1e-5)
        assert r["changed"] == r["num_params"]  # every parameter trained
    assert r0["all_rewards"] == r1["all_rewards"]
    assert any(abs(a) > 0.1 for a in r0["advantages"] + r1["advantages"])  # a non-degenerate group
    assert r0["checksum"] == pytest.approx(r1["checksum"], rel=1e-9)  # DDP kept replicas equal
    assert r0["logged_reward"] == pytest.approx(r1["logged_reward"])  # metrics reduced over ranks
    assert all(abs(x) < 1e6 for x in r0["losses"])
