"""GRPOTrainer on colocated vLLM under 2 real processes (torchrun, gloo): one in-process engine per rank."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.optional_backend, pytest.mark.multiprocess]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_two_process_grpo_on_colocated_vllm(tmp_path, layout):
    pytest.importorskip("vllm")
    # two engines in one machine: each sizes its KV cache as a share of host memory, so keep it small
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_VERL_TEST_VLLM_MEM="0.15")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if layout == "ddp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port())]
    else:  # a sharded actor: every rank gathers the shards one tensor at a time into its own engine
        env["ACCELERATE_USE_CPU"] = "1"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / f"{layout}_cpu.yaml"), "--main_process_port", str(_free_port())]
    cmd += ["-m", "tests.distributed.grpo_vllm_dp", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = f"\n--- stdout tail ---\n{proc.stdout[-2000:]}\n--- stderr tail ---\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}" + tail
    files = [tmp_path / f"rank{k}.json" for k in (0, 1)]
    assert all(f.exists() for f in files), f"missing result files: {[f.name for f in files if not f.exists()]}" + tail
    r0, r1 = (json.loads(f.read_text()) for f in files)
    for k, r in enumerate((r0, r1)):
        where = f"rank {k}: "
        assert r["rank"] == k and r["world"] == 2, where + f"rank/world {r['rank']}/{r['world']}"
        assert "MULTI_CPU" in r["distributed_type"], where + r["distributed_type"]
        assert r["backend"] == layout, where + r["backend"]
        assert r["engine"] == "VLLMEngine" and r["is_vllm_engine"], where + f"engine is {r['engine']}"
        assert r["num_logs"] == 3 and r["global_step"] == 3, where + f"{r['num_logs']} logs, step {r['global_step']}"
        # synced before each of the 3 rollouts and when train() ends; the sync by hand afterwards has nothing to push
        assert r["weight_version_after_train"] == 4, where + f"weight_version {r['weight_version_after_train']}"
        assert r["weight_version_final"] == r["output_weight_version"] == 4, where + str(r["weight_version_final"])
        # train()'s last sync reached this rank's engine: right after train() it already scores as the final policy
        assert r["after_train_greedy_logp_gap"] < 1e-4, where + f"gap {r['after_train_greedy_logp_gap']} after train()"
        assert r["changed"] == r["num_params"], where + f"{r['changed']}/{r['num_params']} parameters trained"
        assert r["max_logp_gap"] < 0.05, where + f"sampling logp gap {r['max_logp_gap']}"
        # the in-place sync reached this rank's engine: vLLM's greedy output is HF's on the final policy
        assert r["vllm_greedy"] == r["hf_greedy"], where + f"vLLM {r['vllm_greedy']} != HF {r['hf_greedy']}"
        assert r["max_greedy_logp_gap"] < 1e-4, where + f"greedy logp gap {r['max_greedy_logp_gap']} after the sync"
    # DDP kept the replicas identical (checksums gathered over the process group and written per rank)
    assert r0["checksums"] == r1["checksums"], f"{r0['checksums']} vs {r1['checksums']}"
    assert r0["checksum"] == pytest.approx(r1["checksum"], rel=1e-12), f"{r0['checksum']} vs {r1['checksum']}"
    assert r0["vllm_greedy"] == r1["vllm_greedy"], "same final weights, different vLLM greedy output"
