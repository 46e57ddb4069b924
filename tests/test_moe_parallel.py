"""Mixture-of-Experts training on the accelerate engines: DDP, FSDP2 and ZeRO-3 over 2 processes equal one process.

Tiny Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral actors (:mod:`tests.moe_models`) with a router aux loss
(`router_aux_loss_coef` 0.05) train 3 steps of GRPO, PPO (dense critic), DPO and the role facade's loop
(:mod:`tests.distributed.moe_parity`). One launch per backend runs four of these, the families rotated so that
every (algorithm, family) pair runs on some backend and every family on every backend; the baseline is the same
runs in one process; a 4-process DDP launch runs GRPO, DPO, PPO and the facade. Logged losses, aux losses and final actor weights must match; the aux loss must be the one
of the global batch (:mod:`hf_verl.engine.router_loss`: each rank's own loss averaged gave aux losses off by up
to 3e-2 and weights by 5e-3). Measured: losses within 3e-6 relative, aux losses within 2e-7, weights within 4e-6.

The fast tests check the sums the global loss is made of against transformers' own `aux_loss`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import build_char_tokenizer
from tests.moe_models import FAMILIES, tiny_moe
from tests.test_parallel_backends import BACKENDS, _env, _failure, _free_port

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ("grpo", "ppo", "dpo", "facade")
LAUNCHES = {"ddp": 0, "fsdp2": 1, "zero3": 2}  # backend -> rotation of the families over the algorithms


def _runs(rotation: int) -> list[str]:
    return [f"{algo}:{FAMILIES[(rotation + i) % len(FAMILIES)]}" for i, algo in enumerate(ALGOS)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-single")
    runs = sorted({run for rotation in LAUNCHES.values() for run in _runs(rotation)})
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.moe_parity", str(out), ",".join(runs)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc)
    return out


def _launch(backend: str, runs: list[str], out: Path, processes: int = 2) -> None:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / f"{backend}_cpu.yaml"), "--num_processes", str(processes),
           "--main_process_port", str(_free_port()), "-m", "tests.distributed.moe_parity", str(out), ",".join(runs)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, _failure(proc)


def _assert_same_runs(baseline: Path, out: Path, runs: list[str], backend: str, world: int = 2) -> None:
    label, param_type = BACKENDS[backend]
    for run in runs:
        name = run.replace(":", "-")
        want = json.loads((baseline / f"{name}.json").read_text())
        got = json.loads((out / f"{name}.json").read_text())
        assert (got["backend"], got["world"], got["param_type"]) == (label, world, param_type), run
        assert got["zero3_partitioned"] == (backend == "zero3") and got["aux_enabled"] and want["aux_enabled"]
        assert got["export_names_match"] and got["export_max_error"] == 0.0, run  # MoE experts exported whole
        assert len(got["losses"]) == len(got["aux"]) == 3, run
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6), run
        assert got["aux"] == pytest.approx(want["aux"], rel=1e-6, abs=1e-6), run  # the global batch's aux loss
        a, b = load_file(str(baseline / f"{name}.safetensors")), load_file(str(out / f"{name}.safetensors"))
        assert set(a) == set(b) and any(".experts." in k for k in a)
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 2e-5, (run, worst)
        initial = tiny_moe(run.split(":")[1], build_char_tokenizer()).state_dict()
        assert max((b[k] - initial[k]).abs().max().item() for k in b) > 1e-4, run  # the run did train


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.optional_backend
@pytest.mark.parametrize("backend", list(LAUNCHES))
def test_moe_runs_on_two_processes_equal_one(baseline, tmp_path, backend):
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    runs = _runs(LAUNCHES[backend])
    _launch(backend, runs, tmp_path)
    _assert_same_runs(baseline, tmp_path, runs, backend)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_runs_on_four_ddp_processes_equal_one(baseline, tmp_path):
    """4 ranks of 2 rows each (a GRPO group of 4 spans 2 ranks): the aux loss is still the global batch's."""
    runs = ["grpo:qwen3_moe", "dpo:mixtral", "ppo:qwen2_moe", "facade:mixtral"]
    _launch("ddp", runs, tmp_path, processes=4)
    _assert_same_runs(baseline, tmp_path, runs, "ddp", world=4)


def _forward(family: str, ids: torch.Tensor, mask: torch.Tensor):
    model = tiny_moe(family, build_char_tokenizer())
    return model, model(input_ids=ids, attention_mask=mask, output_router_logits=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_global_load_balancing_sums_give_the_whole_batch_loss(family):
    """The sums of two halves of a padded batch, added, give transformers' aux loss of the whole batch (what
    the all-reduce does over ranks), while the mean of the halves' own losses does not."""
    from hf_verl.engine.router_loss import expert_counts, load_balancing_sums

    torch.manual_seed(3)
    ids = torch.randint(5, 40, (4, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[3, :5] = 0
    model, whole = _forward(family, ids, mask)
    experts, top_k = expert_counts(model.config)
    halves = [_forward(family, ids[i : i + 2], mask[i : i + 2])[1] for i in (0, 2)]
    sums = [load_balancing_sums(h.router_logits, experts, top_k, mask[i : i + 2]) for h, i in zip(halves, (0, 2))]
    for (counts, probs, rows), half in zip(sums, halves):  # one rank's sums give its own loss
        torch.testing.assert_close(experts * torch.sum(counts / rows * probs / rows), half.aux_loss)
    counts, probs, rows = (sum(parts) for parts in zip(*sums))
    torch.testing.assert_close(experts * torch.sum(counts / rows * probs / rows), whole.aux_loss)
    assert abs((halves[0].aux_loss + halves[1].aux_loss) / 2 - whole.aux_loss) > 1e-4


def test_a_config_without_expert_counts_is_refused():
    from transformers import Qwen2Config

    from hf_verl.engine.router_loss import expert_counts

    with pytest.raises(ValueError, match="router_aux_loss_coef=0"):
        expert_counts(Qwen2Config())
    assert expert_counts(tiny_moe("mixtral", build_char_tokenizer()).config) == (4, 2)
