"""FSDP2, DeepSpeed ZeRO-2/3 and DDP against one process: the same global batch gives the same run.

Each backend runs `tests/distributed/parity.py` under its shipped CPU accelerate config with 2 real
processes on gloo; the baseline is the same script in one process. GRPO, PPO (critic and reference
included), DPO and the role facade's loop (critic and reference) each train 3 steps; the logged losses and the final weights (actor, critic) must
match the baseline, the trainer must report the backend it was asked for, its parameters must really
be sharded (DTensor for FSDP2, partitioned for ZeRO-3), and the sharded weight export must equal the
unsharded initial weights. Tolerance: losses 1e-5 relative or 1e-6 absolute, weights 2e-5 absolute
(fp32, AdamW lr 1e-3; measured: losses within 2e-7, weights within 4e-6).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

BACKENDS = {"ddp": ("ddp", "Parameter"), "fsdp2": ("fsdp2", "DTensor"), "zero2": ("deepspeed ZeRO-2", "Parameter"),
            "zero3": ("deepspeed ZeRO-3", "Parameter")}
ALGOS = ("grpo", "ppo", "dpo", "facade")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               ACCELERATE_USE_CPU="1", DS_ACCELERATOR="cpu", **extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _failure(proc) -> str:
    """What a failed launch said: its error lines first (a rank's traceback can be far from the tail)."""
    text = proc.stdout + proc.stderr
    import tempfile

    with tempfile.NamedTemporaryFile("w", prefix="hf_verl_launch_", suffix=".log", delete=False) as f:
        f.write(text)  # the whole output, for a failure that is not in the tail
    errors = [line for line in text.splitlines() if "Error" in line or "error:" in line or "Traceback" in line]
    return f"full output: {f.name}\n" + "\n".join(errors[:40]) + "\n--- stderr tail ---\n" + proc.stderr[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config: str, algo: str, out: Path, **env):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / config), "--main_process_port", str(_free_port()),
           "-m", "tests.distributed.parity", algo, str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    out = {}
    for algo in ALGOS:
        path = tmp_path_factory.mktemp(f"{algo}-single")
        proc = subprocess.run([sys.executable, "-m", "tests.distributed.parity", algo, str(path)], cwd=ROOT,
                              env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[algo] = path
    return out


def _weights(path: Path, sub: str) -> dict:
    return load_file(str(path / "final" / sub / "model.safetensors"))


@pytest.mark.optional_backend
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("algo", ALGOS)
def test_sharded_run_equals_one_process(baselines, tmp_path, backend, algo):
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    proc = _launch(f"{backend}_cpu.yaml", algo, tmp_path)
    assert proc.returncode == 0, _failure(proc)
    want = json.loads((baselines[algo] / "result.json").read_text())
    got = json.loads((tmp_path / "result.json").read_text())
    label, param_type = BACKENDS[backend]
    assert (got["backend"], got["world"], got["dp_size"]) == (label, 2, 2)
    assert got["param_type"] == param_type and got["zero3_partitioned"] == (backend == "zero3")
    if algo != "facade":  # the trainers also export their sharded weights before training
        assert got["export_names_match"] and got["export_max_error"] == 0.0
    assert_same_run(want, got, baselines[algo], tmp_path, algo)
    initial = _initial_actor()
    trained = _weights(tmp_path, "")
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-4  # the run did train


def assert_same_run(want: dict, got: dict, want_dir: Path, got_dir: Path, algo: str) -> None:
    """Two parity runs agree: their 3 logged losses, extra metrics and final weights (actor, and critic)."""
    assert len(got["losses"]) == 3
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    for key, values in want["extra"].items():
        assert got["extra"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    for sub in ([""] + (["critic"] if algo in ("ppo", "facade") else [])):
        a, b = _weights(want_dir, sub), _weights(got_dir, sub)
        assert set(a) == set(b)
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 2e-5, (sub, worst)


def _initial_actor() -> dict:
    from tests.conftest import build_char_tokenizer
    from tests.distributed.parity import tiny_qwen2

    return tiny_qwen2(build_char_tokenizer()).state_dict()


def test_a_gpu_config_on_a_cpu_machine_fails_fast_naming_the_field(tmp_path):
    """fsdp2.yaml (use_cpu: false) on a machine without CUDA: accelerate starts 2 processes that never join
    a group; the trainer must refuse at once instead of training twice alone."""
    t0 = time.monotonic()
    env = {"PARITY_USE_CPU": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(ROOT / "configs" / "accelerate" / "fsdp2.yaml"), "--num_processes", "2", "--main_process_port",
         str(_free_port()), "-m", "tests.distributed.parity", "grpo", str(tmp_path)],
        cwd=ROOT, env={k: v for k, v in _env(**env).items() if k != "ACCELERATE_USE_CPU"}, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode != 0
    assert "did not join a process group" in proc.stderr and "use_cpu" in proc.stderr
    assert not (tmp_path / "result.json").exists()
    assert time.monotonic() - t0 < 120


@pytest.mark.optional_backend
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_sharded_run_resumes_exactly(tmp_path, backend):
    """Checkpoint at step 2 (whole weights, per-rank optimizer shards), resume in a fresh trainer: steps 3
    and 4 log the uninterrupted run's losses (a fresh optimizer would change step 4's)."""
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    proc = _launch(f"{backend}_cpu.yaml", "resume", tmp_path)
    assert proc.returncode == 0, _failure(proc)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["backend"] == BACKENDS[backend][0]
    assert sorted(got["resumed"]) == ["1", "2", "3", "4"] and got["full"]["3"] != got["full"]["4"]
    for step in ("3", "4"):
        assert got["resumed"][step] == pytest.approx(got["full"][step], rel=1e-6, abs=1e-8)


@pytest.mark.parametrize("backend", ["fsdp2", "zero3"])
def test_a_sharded_actor_syncs_a_shared_server(tmp_path, backend, monkeypatch):
    """One rollout server for both ranks: rank 0 streams the gathered weights, rank 1 walks the same
    buckets; afterwards the server's model is the trained policy, tensor for tensor."""
    import torch

    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.serve.server import RolloutServer
    from tests.conftest import build_char_tokenizer
    from tests.test_serve import TOKEN, _model

    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    tok = build_char_tokenizer()
    server_model = _model(tok, seed=1)  # other weights than the policy's: the syncs must replace them
    server = RolloutServer(TransformersEngine(server_model, tok), tok, "tiny", port=0, token=TOKEN).start()
    try:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / f"{backend}_cpu.yaml"), "--main_process_port", str(_free_port()),
               "-m", "tests.distributed.grpo_server_sharded", str(tmp_path), server.address]
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(HF_VERL_SERVE_TOKEN=TOKEN), capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, _failure(proc)
        got = json.loads((tmp_path / "result.json").read_text())
        assert got["backend"] == BACKENDS[backend][0] and got["steps"] == 3
        assert got["max_logp_gap"] < 1e-3  # the server generated with the trainer's weights each round
        assert server.engine.weight_version == 4  # one sync per round, one after training: from rank 0 only
        final = _weights(tmp_path, "")
        for name, tensor in server_model.state_dict().items():
            torch.testing.assert_close(tensor, final[name], rtol=0, atol=0)
    finally:
        server.shutdown()
