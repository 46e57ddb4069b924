"""ParallelDims, the backend a launch asks for, DeepSpeed configs and the engine's forward primitives
(single process; the multi-process behaviour is tests/test_parallel_backends.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.step import LogProbs
from hf_verl.parallel.backend import BackendSpec, requested_backend, resolve_backend
from hf_verl.parallel.dims import ParallelDims
from tests.conftest import build_char_tokenizer

LAUNCH_ENV = ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_OFFLOAD_PARAMS",
              "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_CONFIG_FILE",
              "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")


@pytest.fixture
def launch_env(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---------------------------------------------------------------------- ParallelDims
def test_data_parallel_rank_follows_the_mesh_order():
    # pp x dp_replicate x dp_shard x sp x tp = 1 x 2 x 2 x 1 x 2: tensor-parallel neighbours share a dp rank
    ranks = [ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=8, rank=r) for r in range(8)]
    assert [d.dp_rank for d in ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {d.dp_size for d in ranks} == {4} and [d.coordinates["tp"] for d in ranks] == [0, 1] * 4
    assert ranks[5].coordinates == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "sp": 0, "tp": 1}
    assert ranks[0].enabled == ["dp_replicate", "dp_shard", "tp"] and ranks[0].is_main and not ranks[1].is_main


def test_layouts_that_do_not_fit_the_world_are_refused_naming_the_numbers():
    with pytest.raises(ValueError, match=r"dp_shard=2 x sp=1 x tp=2 = 4 processes does not match the 2 launched"):
        ParallelDims(dp_shard=2, tp=2, world_size=2)
    with pytest.raises(ValueError, match="ParallelDims.sp must be an int >= 1"):
        ParallelDims(sp=0)
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        ParallelDims(dp_shard=2, world_size=2, rank=2)
    with pytest.raises(ValueError, match=r"3 processes cannot be split .* 2 x 1 x 1 = 2; launch a multiple of 2"):
        ParallelDims.data_parallel(3, 0, shard=True, tp=2)
    dims = ParallelDims.data_parallel(4, 3, shard=True, sp=2)
    assert (dims.dp_shard, dims.dp_replicate, dims.dp_rank, dims.sp_rank) == (2, 1, 1, 1)


def test_a_single_process_needs_no_process_group():
    dims = ParallelDims()
    assert dims.dp_group is None and dims.dp_size == 1 and not dims.is_distributed
    from hf_verl.parallel import comm

    x = torch.arange(6.0).view(2, 3)
    assert comm.gather_rows(dims, x) is x and comm.reduce(dims, x, "mean") is x
    assert torch.equal(comm.local_rows(dims, x, 2), x)
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        ParallelDims(dp_shard=2, world_size=2).mesh  # noqa: B018


# ---------------------------------------------------------------------- the backend a launch asks for
def test_backend_from_the_accelerate_launch_environment(launch_env, tmp_path):
    assert requested_backend(1).kind == "plain" and requested_backend(2).kind == "ddp"
    launch_env.setenv("ACCELERATE_USE_FSDP", "true")
    launch_env.setenv("FSDP_VERSION", "2")
    launch_env.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    spec = requested_backend(2)
    assert (spec.kind, spec.reshard_after_forward, spec.partitions_parameters, spec.shards) == ("fsdp2", False, True, True)
    launch_env.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match=r"FSDP version 1 \(`fsdp_config.fsdp_version`\).*set `fsdp_version: 2`"):
        requested_backend(2)
    launch_env.delenv("ACCELERATE_USE_FSDP")
    launch_env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    launch_env.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    spec = requested_backend(2)
    assert (spec.label, spec.partitions_parameters) == ("deepspeed ZeRO-2", False)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}))
    launch_env.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(config))
    spec = requested_backend(2)
    assert (spec.label, spec.config_file, spec.partitions_parameters) == ("deepspeed ZeRO-3", str(config), True)


def test_what_the_machine_cannot_give_fails_at_once(launch_env):
    launch_env.setenv("ACCELERATE_USE_FSDP", "true")
    launch_env.setenv("FSDP_VERSION", "2")
    with pytest.raises(RuntimeError, match=r"2 processes were launched .* did not join a process group.*use_cpu"):
        resolve_backend(2, process_group_ready=False)
    assert resolve_backend(1, process_group_ready=False).kind == "plain"  # nothing to shard over
    assert resolve_backend(2, process_group_ready=True).kind == "fsdp2"


def test_a_cpu_launch_without_a_process_group_says_what_to_build(launch_env):
    """A launch whose config asks for the CPU but whose processes never joined a group (an `Accelerator()` built
    before hf_verl read the launch): the error no longer asks for the `use_cpu: true` the config already has."""
    from hf_verl.parallel.backend import join_launch_process_group

    launch_env.setenv("ACCELERATE_USE_FSDP", "true")
    launch_env.setenv("FSDP_VERSION", "2")
    launch_env.setenv("ACCELERATE_USE_CPU", "true")
    with pytest.raises(RuntimeError, match=r"with `use_cpu: true`, but they did not join a process group: .*"
                                           r"Build it as `Accelerator\(cpu=True\)`, or lay the roles out first"):
        resolve_backend(2, process_group_ready=False)
    launch_env.delenv("WORLD_SIZE", raising=False)
    assert not join_launch_process_group()  # a single process has no launch group to join


@pytest.fixture
def restored_environ():
    """os.environ as it was before the test (the launch takeover writes variables of its own)."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def test_accelerate_parallelism_config_sp_size_is_hf_verls_sequence_parallelism():
    from hf_verl.parallel.backend import TAKEN_SP_SIZE, check_accelerate_parallelism, resolve_sequence_parallel_size

    on = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}
    assert check_accelerate_parallelism({}) == 1  # no parallelism_config
    dp_only = {**on, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_SP_SIZE": "1"}
    assert check_accelerate_parallelism(dp_only) == 1 and dp_only["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    env = {**on, "PARALLELISM_CONFIG_SP_SIZE": "2", "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
    assert check_accelerate_parallelism(env) == 2
    # taken over: accelerate's own parallelism_config (DeepSpeed-ALST) is off, the degree kept for later calls
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false" and env[TAKEN_SP_SIZE] == "2"
    assert check_accelerate_parallelism(env) == 2
    assert [resolve_sequence_parallel_size(n, dict(env)) for n in (1, 2)] == [2, 2]
    assert resolve_sequence_parallel_size(4, {}) == 4
    with pytest.raises(ValueError, match=r"sequence_parallel_size=4 in the training config, but .* sp_size=2"):
        resolve_sequence_parallel_size(4, dict(env))
    with pytest.raises(ValueError, match=r"cp_size=4.*no hf_verl engine runs that yet.*parallelism_config_sp_size"):
        check_accelerate_parallelism({**on, "PARALLELISM_CONFIG_CP_SIZE": "4"})
    with pytest.raises(ValueError, match=r"tp_size=2.*backend='megatron' with tensor_model_parallel_size.*megatron_tp2.yaml"):
        check_accelerate_parallelism({**on, "PARALLELISM_CONFIG_TP_SIZE": "2"})
    with pytest.raises(ValueError, match=r"sp_size='two'; it must be an int >= 1"):
        check_accelerate_parallelism({**on, "PARALLELISM_CONFIG_SP_SIZE": "two"})


def test_the_launch_sp_size_reaches_the_trainer_configs_and_the_facade(restored_environ):
    """One process asked for sp_size=2: the configs (sequence_parallel_size left at 1) and the facade's layout take
    the launch's degree and refuse it for what it is (2 does not divide 1 process); a different degree in the config
    is refused as a conflict."""
    from hf_verl import GRPOConfig, Trainer

    restored_environ.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_SP_SIZE="2")
    with pytest.raises(ValueError, match="sequence_parallel_size=2 does not divide the 1 launched processes"):
        GRPOConfig(output_dir="unused", use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="sequence_parallel_size=4 in the training config, but .* sp_size=2"):
        GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], sequence_parallel_size=4)
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"1 processes cannot be split .* 1 x 1 x 2 = 2"):
        _ = Trainer(actor_model=tiny, reward_model=lambda completions, **kw: [0.0] * len(completions),
                    tokenizer=build_char_tokenizer()).dims


def test_the_launch_config_is_read_from_the_accelerate_launch_command_line(restored_environ):
    from hf_verl.parallel.backend import _launch_arguments, adopt_launch_cpu, launch_asks_for_cpu, launch_config_file

    tail = ["--config_file", "c.yaml", "train.py", "--config_file", "not-accelerates.yaml"]
    assert _launch_arguments(["/venv/bin/python", "/venv/bin/accelerate", "launch", *tail]) == tail
    assert _launch_arguments(["python", "-m", "accelerate.commands.launch", *tail]) == tail
    assert _launch_arguments(["/venv/bin/accelerate-launch", *tail]) == tail
    assert _launch_arguments(["torchrun", "--nproc_per_node", "2", "train.py"]) is None
    from accelerate.commands.launch import launch_command_parser

    # the launcher's own parser tells its options from the script's
    assert launch_command_parser().parse_known_args(tail)[0].config_file == "c.yaml"
    for name in ("ACCELERATE_USE_CPU", "LOCAL_RANK", "ACCELERATE_MIXED_PRECISION"):
        restored_environ.pop(name, None)
    assert launch_config_file() is None and not launch_asks_for_cpu()  # not a process of accelerate's launcher
    assert not adopt_launch_cpu() and "ACCELERATE_USE_CPU" not in restored_environ
    restored_environ["ACCELERATE_USE_CPU"] = "True"  # accelerate's single-process launcher exports it
    assert launch_asks_for_cpu() and not adopt_launch_cpu()  # already said: nothing to adopt


@pytest.mark.slow  # a fresh interpreter
def test_a_deepspeed_launch_with_a_broken_deepspeed_names_the_import_error(tmp_path):
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("raise ImportError('no CUDA toolkit')\n")
    code = ("import os; os.environ.update(ACCELERATE_USE_DEEPSPEED='true', ACCELERATE_DEEPSPEED_ZERO_STAGE='3')\n"
            "from hf_verl.parallel.backend import resolve_backend\n"
            "try:\n    resolve_backend(2, True)\nexcept ImportError as e:\n    print('ERR', e)\n")
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{__import__('os').getcwd()}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "ERR" in out.stdout and "no CUDA toolkit" in out.stdout and "hf_verl[deepspeed]" in out.stdout


@pytest.mark.slow  # a fresh interpreter: a DeepSpeed TrainingArguments sets process-wide accelerate state
@pytest.mark.optional_backend
def test_a_zero3_config_says_how_models_load(tmp_path):
    """The INFO line of a ZeRO-3 launch says what happens: over 2+ data-parallel ranks a model given by path loads
    sharded (each rank its own partitions) and an object is partitioned by the engine; on one rank, whole. It used
    to say "models load whole" beside the sharded loader's own lines."""
    pytest.importorskip("deepspeed")
    code = (
        "import logging, os, sys\n"
        "os.environ.update(ACCELERATE_USE_DEEPSPEED='true', ACCELERATE_DEEPSPEED_ZERO_STAGE='3')\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='LOG %(name)s: %(message)s')\n"
        "from hf_verl.trainers.dpo_config import DPOConfig\n"
        "from hf_verl.trainers.parallel_args import ParallelArguments\n"
        f"DPOConfig(output_dir={str(tmp_path)!r}, use_cpu=True, report_to=[])\n"
        "ParallelArguments.data_parallel_size = property(lambda self: 2)  # the line of a 2-rank launch\n"
        f"DPOConfig(output_dir={str(tmp_path)!r}, use_cpu=True, report_to=[])\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split(": ", 1)[1] for line in out.stdout.splitlines()
             if line.startswith("LOG hf_verl.trainers.parallel_args: DeepSpeed ZeRO-3")]
    assert lines == [
        "DeepSpeed ZeRO-3 launch with one data-parallel rank: nothing to partition over, models load whole",
        "DeepSpeed ZeRO-3 launch: a model given by id or path loads sharded, each rank reading only its own "
        "partitions (or whole, with a line saying why); a model given as an object is partitioned by hf_verl's engine"]
    assert "models load whole and hf_verl's engine partitions them" not in out.stdout + out.stderr


def test_deepspeed_config_fills_auto_values_and_refuses_its_own_optimizer(tmp_path):
    from hf_verl.parallel.deepspeed import deepspeed_config

    spec = BackendSpec("deepspeed", zero_stage=3, offload_params=True)
    config = deepspeed_config(spec, micro_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0)
    assert config["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"}}
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["gradient_clipping"]) == (4, 2, 1.0)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True},
                                "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}))
    spec = BackendSpec("deepspeed", zero_stage=2, config_file=str(path))
    config = deepspeed_config(spec, micro_batch_size=8, gradient_accumulation_steps=1, max_grad_norm=0.5)
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True} and config["gradient_clipping"] == 0.5
    path.write_text(json.dumps({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ValueError, match="has an 'optimizer' section"):
        deepspeed_config(spec, micro_batch_size=8, gradient_accumulation_steps=1, max_grad_norm=0.5)


# ---------------------------------------------------------------------- the engine's forward primitives
def rollout_batch() -> RolloutBatch:
    return RolloutBatch.from_lists([[1, 2, 3], [4, 5]], [[6, 7], [8]], pad_token_id=0)


def _engine(model, **kw):
    from hf_verl.engine.accelerate_engine import AccelerateEngine

    return AccelerateEngine(model, role=kw.pop("role", "actor"), dims=ParallelDims(), backend=BackendSpec(), **kw)


def _batch(tok):
    from hf_verl.data.batch import RolloutBatch

    prompts = [tok("abc")["input_ids"], tok("hello")["input_ids"]]
    completions = [tok("xy")["input_ids"], tok("zzzz")["input_ids"]]
    return RolloutBatch.from_lists(prompts, completions, tok.pad_token_id)


def test_logprobs_and_values_equal_the_models_own_outputs():
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tok = build_char_tokenizer()
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id, num_labels=1)
    torch.manual_seed(0)
    lm, critic = Qwen2ForCausalLM(cfg).eval(), Qwen2ForSequenceClassification(cfg).eval()
    batch = _batch(tok)
    P, C = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    mask = batch.attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = lm(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions).logits.float()
        want = torch.log_softmax(logits[:, P - 1 : P + C - 1] / 0.7, -1).gather(
            -1, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * batch.completion_mask
        hidden = critic.model(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions).last_hidden_state
        want_values = critic.score(hidden[:, P - 1 : P + C - 1]).squeeze(-1) * batch.completion_mask
        got, entropy = _engine(lm).logprobs(batch, temperature=0.7, chunk_size=3, with_entropy=True)
        values = _engine(critic, role="critic").values(batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-6)
    assert (got[batch.completion_mask == 0] == 0).all() and entropy.shape == got.shape
    assert (entropy[batch.completion_mask.bool()] > 0).all()


def test_engine_export_save_and_frozen_roles():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok)))
    engine = _engine(model)
    exported = {n: t for bucket in engine.export_weights(4096) for n, t in bucket}
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in exported.items())
    assert engine.full_state_dict().keys() == model.state_dict().keys()
    with pytest.raises(RuntimeError, match="no optimizer: call configure_optimizer"):
        engine.optimizer_step()
    with pytest.raises(ValueError, match="no PEFT adapters to disable"):
        with engine.adapters_disabled():
            pass
    frozen = _engine(Qwen2ForCausalLM(model.config), role="reference", trainable=False)
    assert not any(p.requires_grad for p in frozen.model.parameters()) and not frozen.module.training
    with pytest.raises(ValueError, match="the reference engine is frozen"):
        frozen.forward_backward([rollout_batch()], lambda out, mb: (out.logp.sum(), {}), forward=LogProbs())
