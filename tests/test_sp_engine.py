"""The training engine with Ulysses sequence parallelism: two real processes (torchrun, gloo) with sp=2 against one
process, on DDP and on FSDP2 (`tests/distributed/sp_engine.py`): log-probs, entropy and values through the packed,
sequence-sharded path, two SGD steps of an actor and a critic, gradient norms and final weights."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp_engine")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), "-m", "tests.distributed.sp_engine", str(out)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("kind, module, sharded", [("ddp", "DistributedDataParallel", False),
                                                   ("fsdp2", "FSDPLlamaForCausalLM", True)])
def test_sp2_engine_equals_one_process(results, kind, module, sharded):
    for rank, r in enumerate(results):
        got = r[kind]
        assert got["attention"] == "hf_verl_ulysses"
        assert got["layout"] == [module, sharded]
        for key in ("max_diff_logp", "max_diff_entropy", "max_diff_values"):
            assert got[key] < 1e-5, (rank, key, got[key])
        assert got["max_diff_loss"] < 1e-6 and got["max_diff_norm"] < 1e-5
    main = results[0][kind]
    assert main["weights_moved"] > 1e-2  # the steps changed the weights, and equally on both sides
    assert main["max_diff_weights"] < 1e-6 and main["max_diff_critic_weights"] < 1e-6
