"""Routing replay under Ulysses sequence parallelism: two real processes (torchrun, gloo, sp=2) against one process
(`tests/distributed/moe_replay_sp.py`). The rollout's record is replaced by other experts than the routers would
choose, so equal log-probs, loss and weights after an SGD step prove each rank's shard of the packed tokens was
routed by the record."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
ROOT = Path(__file__).resolve().parents[1]


def test_sp2_replays_the_record_as_one_process_does(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), "-m", "tests.distributed.moe_replay_sp", str(tmp_path)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["max_diff_logp"] < 1e-5 and r["diff_loss"] < 1e-6
        assert r["metrics_one"]["moe/routing_agreement"] < 0.9  # the record is not the routers' own choice
        assert r["metrics_sp2"]["moe/replayed_tokens"] > 0.8
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["max_diff_weights"] < 1e-6 < r0["weights_moved"]
