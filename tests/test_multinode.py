"""Past one machine: two nodes launched as a cluster launches them give the one-node run.

Each "node" is a launcher of its own (one process each, `--node_rank` / `--machine_rank` 0 and 1) with the
rendezvous on 127.0.0.1, as docs/parallel.md's SLURM script starts one launcher per node: GRPO through `torchrun
--nnodes 2`, DPO through `accelerate launch --num_machines 2` with the shipped DDP config. Both train
`tests/distributed/parity.py`'s 3 steps on the same global batch as one process (the default shuffled sampler);
the logged losses, the extra metrics and the final weights must match it (the tolerance of
tests/test_parallel_backends.py), and the run must report 2 data-parallel ranks.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_parallel_backends import _env, _failure, _free_port, _initial_actor, _weights, assert_same_run

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _one_process(algo: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.parity", algo, str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def _two_nodes(launcher: list[str], algo: str, out: Path) -> None:
    """Start `launcher` once per node (`{node}` and `{port}` in its arguments filled in), wait for both, and
    check that both ended well."""
    port = str(_free_port())
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", *[a.format(node=node, port=port) for a in launcher],
               "-m", "tests.distributed.parity", algo, str(out)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for node, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        assert proc.returncode == 0, f"node {node}: " + _failure(done)


TORCHRUN = ["torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", "{node}",
            "--master_addr", "127.0.0.1", "--master_port", "{port}"]
ACCELERATE = ["accelerate.commands.launch", "--config_file", str(ROOT / "configs" / "accelerate" / "ddp_cpu.yaml"),
              "--num_machines", "2", "--num_processes", "2", "--machine_rank", "{node}",
              "--main_process_ip", "127.0.0.1", "--main_process_port", "{port}"]


@pytest.mark.parametrize("algo, launcher", [("grpo", TORCHRUN), ("dpo", ACCELERATE)], ids=["grpo-torchrun",
                                                                                        "dpo-accelerate"])
def test_two_nodes_give_the_one_node_run(tmp_path, algo, launcher):
    want = _one_process(algo, tmp_path / "one")
    _two_nodes(launcher, algo, tmp_path / "two")
    got = json.loads((tmp_path / "two" / "result.json").read_text())
    assert (got["backend"], got["world"], got["dp_size"]) == ("ddp", 2, 2)
    assert_same_run(want, got, tmp_path / "one", tmp_path / "two", algo)
    trained, initial = _weights(tmp_path / "two", ""), _initial_actor()
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-4  # the run did train
