"""Per-role placement in the facade: declarations checked at construction, `placement()` one line per role."""

import pytest
import torch

from tests.conftest import build_char_tokenizer
from tests.test_facade import count_a, tiny_llama

CONFIG = dict(group_size=2, max_new_tokens=2, seed=0, use_async_rollout=False)


def _trainer(**kwargs):
    from hf_verl import Trainer

    tok = build_char_tokenizer()
    kwargs.setdefault("reward_model", count_a)
    return Trainer(actor_model=tiny_llama(tok), tokenizer=tok, config=CONFIG, **kwargs)


def test_default_placement_is_everything_colocated_one_line_per_role(caplog):
    import logging

    tok = build_char_tokenizer()
    trainer = _trainer(reference_model=tiny_llama(tok, seed=2),
                       reward_model=[count_a, "http://127.0.0.1:9/v1/classify"])
    with caplog.at_level(logging.INFO, logger="hf_verl.facade.trainer"):
        lines = trainer.placement()
    roles = [line.split(": backend=")[0] for line in lines]
    assert roles == ["actor", "reference", "reward[count_a]", "reward[127.0.0.1:9]", "generator"]
    assert lines[0].startswith("actor: backend=plain where=rank 0 (colocated) layout=one process memory=")
    assert lines[1].startswith("reference: backend=plain where=rank 0 (colocated) ")
    assert lines[2] == "reward[count_a]: backend=callable where=rank 0 layout=python memory=n/a"
    assert "where=http://127.0.0.1:9/v1/classify layout=remote" in lines[3]
    assert lines[4].startswith("generator: backend=TransformersEngine where=rank 0 layout=colocated")
    assert sum("placement: " in r.getMessage() for r in caplog.records) == len(lines)


def test_memory_estimate_is_the_planners_estimate_of_the_role_on_its_layout():
    """memory_estimate asks the planner for the role alone (trained actor, frozen reference) on the role's layout
    with the facade's config, and says why where it cannot estimate; it used to pass the layout as the config and
    swallow the TypeError, so every line said n/a."""
    from hf_verl.facade.placement import memory_estimate
    from hf_verl.planner import estimate_memory

    tok = build_char_tokenizer()
    trainer = _trainer(reference_model=tiny_llama(tok, seed=2))
    peaks = {}
    for role in ("actor", "reference"):
        engine, layout = trainer.roles.engine(role), trainer.roles.layout(role)
        est = estimate_memory(engine.model, trainer.config, layout, device=layout.dims.device_type, role=role)
        peaks[role] = est.peak_bytes
        assert memory_estimate(engine, layout, trainer.config, role) == f"{est.peak_bytes / 2**30:.2f} GiB"
        assert memory_estimate(engine.model, layout, trainer.config, role) == f"{est.peak_bytes / 2**30:.2f} GiB"
    assert peaks["reference"] < peaks["actor"]  # frozen: no gradients, no optimizer states
    layout = trainer.roles.layout("actor")
    assert memory_estimate(trainer.model, layout) == "n/a (no trainer config to size the step)"
    assert memory_estimate(None, layout, trainer.config) == "n/a (no local model)"
    assert memory_estimate(torch.nn.Linear(2, 2), layout, trainer.config).startswith("n/a (a Linear, not a transformers")
    with pytest.raises(ValueError, match="role must be one of"):
        memory_estimate(trainer.model, layout, trainer.config, "value")


def test_placement_shows_the_planners_memory_estimate_for_the_actor():
    from hf_verl.planner import estimate_memory

    trainer = _trainer()
    line = trainer.placement()[0]
    layout = trainer.roles.layout("actor")
    est = estimate_memory(trainer.model, trainer.config, layout, device=layout.dims.device_type, role="actor")
    assert line == ("actor: backend=plain where=rank 0 (colocated) layout=one process "
                    f"memory={est.peak_bytes / 2**30:.2f} GiB")


def test_a_generator_url_becomes_a_remote_engine():
    from hf_verl.rollout.remote import RemoteEngine

    trainer = _trainer(placement={"generator": "http://127.0.0.1:9"})
    assert isinstance(trainer.engine, RemoteEngine) and trainer.engine.base_url == "http://127.0.0.1:9"
    assert trainer.placement()[-1].startswith("generator: backend=RemoteEngine where=http://127.0.0.1:9 layout=remote")


def test_a_reference_on_its_own_layout_is_reported_so():
    tok = build_char_tokenizer()
    trainer = _trainer(reference_model=tiny_llama(tok, seed=2), placement={"reference": "ddp"})
    assert "(own layout)" in trainer.placement()[1]


@pytest.mark.parametrize("placement, message", [
    ({"critic": "fsdp2"}, r"placement\['critic'\] = 'fsdp2' but no critic model was given: pass critic_model="),
    ({"reference": "fsdp2", "_ref": True}, r"shards over processes but this launch has one: launch 2 or more"),
    ({"reference": "megatron", "_ref": True}, r"set config backend='megatron'"),
    ({"reference": "tp4", "_ref": True}, r"choose 'colocated' or a server URL \(http://host:port/v1\) or one of"),
    ({"generator": "localhost:8000"}, r"use 'colocated' or the URL of a /v1/completions server"),
    ({"actor": "ddp"}, r"the actor runs on the launch's layout"),
    ({"reward": "http://x"}, r"a reward model is placed by what reward_model= is"),
    ({"value": "ddp"}, r"unknown role 'value'"),
    ({"reference": "http://127.0.0.1:9/v1", "generator": "http://127.0.0.1:9"},
     r"is the generator's server, which takes the actor's weights after every step"),
])
def test_a_role_that_cannot_run_where_declared_fails_at_construction(placement, message):
    tok = build_char_tokenizer()
    extra = {"reference_model": tiny_llama(tok, seed=2)} if placement.pop("_ref", False) else {}
    with pytest.raises(ValueError, match=message):
        _trainer(placement=placement, **extra)


def test_a_generator_url_and_an_engine_together_are_refused():
    from hf_verl.rollout.hf_engine import TransformersEngine

    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="placement\\['generator'\\] is a URL but a rollout engine was given"):
        _trainer(placement={"generator": "http://127.0.0.1:9"},
                 rollout_engine=TransformersEngine(tiny_llama(tok), tok))


# ---------------------------------------------------------------------------------------------------------------
# per-role backends on 2 real gloo processes: the same run as one process
# name: (the launch's accelerate config = the actor's backend, the other roles' placement)
PLACEMENTS = {"ddp-actor-fsdp2-critic-fsdp2-reference": ("ddp", {"critic": "fsdp2", "reference": "fsdp2"}),
              "ddp-actor-fsdp2-critic-zero3-reference": ("ddp", {"critic": "fsdp2", "reference": "zero3"}),
              "fsdp2-actor-zero2-critic-ddp-reference": ("fsdp2", {"critic": "zero2", "reference": "ddp"})}
# backend: (engine label, parameter type, ZeRO-3 partitioned, data-parallel axis)
ROLE_BACKENDS = {"ddp": ("ddp", "Parameter", False, "dp_replicate"), "fsdp2": ("fsdp2", "DTensor", False, "dp_shard"),
                 "zero2": ("deepspeed ZeRO-2", "Parameter", False, "dp_shard"),
                 "zero3": ("deepspeed ZeRO-3", "Parameter", True, "dp_shard")}


@pytest.fixture(scope="module")
def placement_baseline(tmp_path_factory):
    import subprocess
    import sys

    from tests.test_parallel_backends import ROOT, _env

    out = tmp_path_factory.mktemp("placement-single")
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.placement_parity", "{}", str(out)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_roles_on_their_own_backends_over_two_processes_equal_one_process(placement_baseline, tmp_path, name):
    """A launch of 2 gloo processes (the actor on its backend); the critic and the reference on layouts of their own
    over the same processes: the step losses, the reference's log-probs and the final actor and critic weights
    equal the one-process run of the same global batch (tolerances of tests/test_parallel_backends.py)."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.test_parallel_backends import ROOT, _env, _failure, _free_port

    launch, placement = PLACEMENTS[name]
    if any(b.startswith("zero") for b in placement.values()):
        pytest.importorskip("deepspeed")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / f"{launch}_cpu.yaml"), "--main_process_port", str(_free_port()),
           "-m", "tests.distributed.placement_parity", json.dumps(placement), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, _failure(proc)
    want = json.loads((placement_baseline / "result.json").read_text())
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["world"] == 2
    for role, backend in {"actor": launch, **placement}.items():
        label, param_type, partitioned, axis = ROLE_BACKENDS[backend]
        assert got["roles"][role] == {"backend": label, "param_type": param_type, "zero3_partitioned": partitioned}
        line = next(line for line in got["placement"] if line.startswith(f"{role}: "))
        where = "colocated" if role == "actor" else "own layout"
        assert line.startswith(f"{role}: backend={label} where=ranks 0-1 ({where}) layout={axis}=2 "), line
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    assert got["values"] == pytest.approx(want["values"], rel=1e-5, abs=1e-6)
    mask = torch.tensor(want["ref_mask"]).bool()
    assert torch.equal(torch.tensor(got["ref_mask"]).bool(), mask)
    torch.testing.assert_close(torch.tensor(got["ref_logprobs"])[mask], torch.tensor(want["ref_logprobs"])[mask],
                               rtol=1e-5, atol=1e-5)
    for sub in ("", "critic"):
        a = load_file(str(placement_baseline / "final" / sub / "model.safetensors"))
        b = load_file(str(tmp_path / "final" / sub / "model.safetensors"))
        assert set(a) == set(b)
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 2e-5, (sub or "actor", worst)


# ---------------------------------------------------------------------------------------------------------------
# the TRL-style trainers: a reward model behind a URL is a `reward_funcs` / `reward_model` string
@pytest.fixture(scope="module")
def reward_server():
    from hf_verl.serve.classify import ClassifyServer
    from tests.test_reward_server import _reward_model

    tok = build_char_tokenizer()
    model = _reward_model(tok, seed=3)
    server = ClassifyServer(model, tok, "tiny-rm", port=0, batch_size=4).start()
    yield server, tok, model
    server.shutdown()


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.slow
def test_grpo_reward_funcs_take_a_reward_server_url_equal_to_the_local_reward_model(reward_server, tmp_path):
    """`GRPOTrainer(reward_funcs=[count_a, "http://127.0.0.1:PORT"])` scores through the real `/classify` server:
    the same run as with the reward model object itself (rewards and losses to 1e-5)."""
    from datasets import Dataset

    from hf_verl import GRPOTrainer
    from hf_verl.rewards.remote import RemoteRewardModel
    from tests.test_grpo_trainer import _args, _model
    from tests.test_grpo_trainer import count_a as grpo_count_a

    server, tok, model = reward_server
    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2})
    runs = {}
    for name, source in (("local", model), ("url", server.address)):
        trainer = GRPOTrainer(model=_model(tok), reward_funcs=[grpo_count_a, source], train_dataset=ds,
                              processing_class=tok, reward_processing_classes=[None, tok],
                              args=_args(tmp_path / name, max_steps=2, seed=5))
        if name == "url":
            assert isinstance(trainer.reward_funcs[1], RemoteRewardModel)
            assert trainer.reward_funcs[1].url == f"{server.address}/classify"
        trainer.train()
        runs[name] = trainer
    assert len(_logged(runs["url"], "reward")) == 2
    for key in ("reward", "loss"):
        assert _logged(runs["url"], key) == pytest.approx(_logged(runs["local"], key), abs=1e-5), key
    netloc = server.address.removeprefix("http://")
    assert _logged(runs["url"], f"rewards/{netloc}/mean")


@pytest.mark.slow
def test_ppo_reward_model_takes_a_reward_server_url_equal_to_the_local_reward_model(reward_server, tmp_path):
    from datasets import Dataset

    from hf_verl import PPOTrainer
    from tests.test_ppo_trainer import _args, _critic, _policy

    server, tok, model = reward_server
    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2})
    runs = {}
    for name, source in (("local", model), ("url", server.address)):
        trainer = PPOTrainer(args=_args(tmp_path / name, max_steps=2, seed=5), processing_class=tok,
                             model=_policy(tok), reward_model=source, value_model=_critic(tok), train_dataset=ds,
                             reward_processing_classes=[tok])
        trainer.train()
        runs[name] = trainer
    assert len(_logged(runs["url"], "loss")) == 2
    for key in ("reward", "loss", "loss/value_avg"):
        assert _logged(runs["url"], key) == pytest.approx(_logged(runs["local"], key), abs=1e-5), key


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_served_reference_over_two_processes_equals_the_local_one_in_one_process(placement_baseline, tmp_path):
    """`placement={"reference": URL}` in a DDP launch of 2 gloo processes, with a critic on FSDP2: each rank reads its
    rows' reference log-probs from one `hf-verl serve` of the baseline's reference model; the run equals the
    one-process run with that reference local."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.serve.server import RolloutServer
    from tests.distributed.placement_parity import reference_model
    from tests.test_parallel_backends import ROOT, _env, _failure, _free_port

    tok = build_char_tokenizer()
    server = RolloutServer(TransformersEngine(reference_model(tok).eval(), tok), tok, "ref", port=0).start()
    url = f"{server.address}/v1"
    try:
        placement = {"critic": "fsdp2", "reference": url}
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / "ddp_cpu.yaml"), "--main_process_port", str(_free_port()),
               "-m", "tests.distributed.placement_parity", json.dumps(placement), str(tmp_path)]
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    finally:
        server.shutdown()
    assert proc.returncode == 0, _failure(proc)
    want = json.loads((placement_baseline / "result.json").read_text())
    got = json.loads((tmp_path / "result.json").read_text())
    assert "reference" not in got["roles"] and got["world"] == 2
    line = next(line for line in got["placement"] if line.startswith("reference: "))
    assert line == f"reference: backend=server where={url}/completions layout=remote memory=n/a (remote)"
    mask = torch.tensor(want["ref_mask"]).bool()
    assert torch.equal(torch.tensor(got["ref_mask"]).bool(), mask)
    torch.testing.assert_close(torch.tensor(got["ref_logprobs"])[mask], torch.tensor(want["ref_logprobs"])[mask],
                               rtol=0, atol=1e-5)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    assert got["values"] == pytest.approx(want["values"], rel=1e-5, abs=1e-6)
    for sub in ("", "critic"):
        a = load_file(str(placement_baseline / "final" / sub / "model.safetensors"))
        b = load_file(str(tmp_path / "final" / sub / "model.safetensors"))
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 2e-5, (sub or "actor", worst)


# ---------------------------------------------------------------------------------------------------------------
# the trainer configs' placement: the facade's values, the same role builder
TRAINER_PLACEMENTS = {"ppo": {"critic": "fsdp2", "reference": "fsdp2"}, "grpo": {"reference": "zero3"},
                      "dpo": {"reference": "fsdp2"}}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("algo", list(TRAINER_PLACEMENTS))
def test_trainer_config_placement_over_two_processes_equals_one_process(tmp_path_factory, algo):
    """PPOConfig / GRPOConfig / DPOConfig(placement=...) in a DDP launch of 2 gloo processes: the critic and the
    reference run on their own backends (the labels say so), and the 3 losses and final weights equal the
    one-process run of the same global batch with every role colocated."""
    import json
    import subprocess
    import sys

    from tests.test_parallel_backends import ROOT, _env, _failure, _launch, assert_same_run

    placement = TRAINER_PLACEMENTS[algo]
    if any(b.startswith("zero") for b in placement.values()):
        pytest.importorskip("deepspeed")
    single, double = tmp_path_factory.mktemp(f"{algo}-one"), tmp_path_factory.mktemp(f"{algo}-placed")
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.parity", algo, str(single)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _launch("ddp_cpu.yaml", algo, double, PARITY_PLACEMENT=json.dumps(placement))
    assert proc.returncode == 0, _failure(proc)
    want = json.loads((single / "result.json").read_text())
    got = json.loads((double / "result.json").read_text())
    labels = {"fsdp2": "fsdp2", "zero3": "deepspeed ZeRO-3"}
    assert got["backend"] == "ddp" and got["world"] == 2
    assert got["roles"] == {role: labels[b] for role, b in placement.items()}
    assert_same_run(want, got, single, double, algo)


def test_trainer_configs_check_placement_for_the_roles_they_have(tmp_path):
    from hf_verl import DPOConfig, GRPOConfig, PPOConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(ValueError, match=r"GRPOConfig.placement\['critic'\]: this trainer has no critic role"):
        GRPOConfig(placement={"critic": "fsdp2"}, **common)
    with pytest.raises(ValueError, match=r"DPOConfig.placement\['generator'\]: this trainer has no generator"):
        DPOConfig(placement={"generator": "http://127.0.0.1:8000"}, **common)
    with pytest.raises(ValueError, match=r"PPOConfig.placement\['critic'\] = 'fsdp2' shards over processes but "
                                         "this launch has one"):
        PPOConfig(placement={"critic": "fsdp2"}, **common)
    with pytest.raises(ValueError, match="placement has unknown role 'actr'"):
        GRPOConfig(placement={"actr": "ddp"}, **common)
    assert GRPOConfig(placement='{"generator": "http://127.0.0.1:9"}', **common).placement == {
        "generator": "http://127.0.0.1:9"}  # the command line's JSON


def test_a_trainers_reference_and_generator_urls_become_remote_roles(tmp_path):
    from datasets import Dataset

    from hf_verl import GRPOConfig, GRPOTrainer
    from hf_verl.engine.remote_reference import RemoteReference
    from hf_verl.rollout.remote import RemoteEngine
    from tests.test_grpo_trainer import _args, _model, count_a

    tok = build_char_tokenizer()
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=count_a, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": ["abc"] * 8}),
                          args=_args(tmp_path, beta=0.1, placement={"reference": "http://127.0.0.1:9/v1",
                                                                    "generator": "http://127.0.0.1:10"}))
    assert isinstance(trainer.reference, RemoteReference) and trainer.ref_model is None
    assert isinstance(trainer.engine, RemoteEngine) and trainer.engine.base_url == "http://127.0.0.1:10"


def test_dpo_refuses_a_served_reference(tmp_path):
    from hf_verl import DPOConfig, DPOTrainer
    from tests.test_dpo_trainer import _data, _model

    tok = build_char_tokenizer()
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], placement={"reference": "http://127.0.0.1:9"})
    with pytest.raises(ValueError, match="scores rollout completions only, not DPO's chosen / rejected pairs"):
        DPOTrainer(model=_model(tok), args=args, train_dataset=_data(), processing_class=tok)
