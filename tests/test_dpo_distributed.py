"""DPOTrainer data parallel on gloo: 2 processes x batch 2 == 1 process x batch 4."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, tmp):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(tmp.glob("result*.json"))]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_process_dpo_matches_one_process(tmp_path):
    (one := tmp_path / "one").mkdir()
    (two := tmp_path / "two").mkdir()
    (single,) = _run([sys.executable, "-m", "tests.distributed.dpo_dp", str(one), "4", "1"], one)
    r0, r1 = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   "29534", "-m", "tests.distributed.dpo_dp", str(two), "2", "1"], two)
    assert single["world"] == 1 and r0["world"] == r1["world"] == 2
    assert r0["checksum"] == pytest.approx(r1["checksum"], rel=1e-9)  # replicas stay equal
    assert r0["checksum"] == pytest.approx(single["checksum"], rel=1e-5)  # DP == one process
    assert r0["losses"] == pytest.approx(single["losses"], rel=1e-4)
    assert single["margins"][-1] > 0
