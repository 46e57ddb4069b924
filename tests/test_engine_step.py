"""The engine owns the step: forward_backward over a window, optimizer_step, infer, the optimizer spec, the
registry, and the HF trainers handing each accumulation window to the engine whole."""

import copy

import pytest
import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.registry import RoleLayout, launch_role_layout, make_engine
from hf_verl.engine.step import LogProbs, OptimizerSpec, SchedulerSpec, Values
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims
from tests.conftest import build_char_tokenizer

LAYOUT = RoleLayout(BackendSpec(), ParallelDims())


def _model(tok, cls="Qwen2ForCausalLM", **kw):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **kw)
    return getattr(transformers, cls)(cfg)


def _batches(tok, n=3):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        prompts = [torch.randint(3, len(tok), (int(k),), generator=g).tolist() for k in (3, 5)]
        completions = [torch.randint(3, len(tok), (int(k),), generator=g).tolist() for k in (4, 2)]
        batch = RolloutBatch.from_lists(prompts, completions, tok.pad_token_id)
        batch.advantages = torch.tensor([1.0, -0.5])
        out.append(batch)
    return out


def _policy_loss(out, mb):
    mask = mb.completion_mask.float()
    loss = -(out.logp * mb.advantages[:, None] * mask).sum() / mask.sum()
    return loss, {"tokens": mask.sum()}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_forward_backward_accumulates_the_window_as_separate_backwards():
    tok = build_char_tokenizer()
    model, batches = _model(tok), _batches(tok)
    reference = copy.deepcopy(model)
    engine = make_engine(model, "actor", LAYOUT, trainable=True)
    result = engine.forward_backward(batches, _policy_loss, forward=LogProbs(), loss_scale=1 / 3)
    for mb in batches:  # the same losses backpropagated one by one, by hand
        logp, _ = make_engine(reference, "reference", LAYOUT, trainable=True).logprobs(mb)
        (_policy_loss(type("Out", (), {"logp": logp})(), mb)[0] / 3).backward()
    got, want = _grads(model), _grads(reference)
    assert got.keys() == want.keys() and len(got) == len(list(model.parameters()))
    assert all(torch.allclose(got[n], want[n], atol=1e-7) for n in want)
    assert len(result.losses) == 3 and all(not t.requires_grad for t in result.losses)
    assert [m["tokens"] for m in result.metrics] == [float(mb.completion_mask.sum()) for mb in batches]
    assert result.is_output_rank and torch.isclose(result.total_loss, sum(result.losses))


def test_forward_only_keeps_mode_and_leaves_no_gradient():
    tok = build_char_tokenizer()
    model = _model(tok)
    engine = make_engine(model, "actor", LAYOUT, trainable=True)
    engine.train()
    result = engine.forward_backward(_batches(tok, 2), _policy_loss, forward=LogProbs(with_entropy=True),
                                     forward_only=True, keep_outputs=True)
    assert engine.training and not _grads(model)
    assert result.outputs[0].entropy.shape == result.outputs[0].logp.shape == (2, 4)
    frozen = make_engine(_model(tok), "reference", LAYOUT, trainable=False)
    with pytest.raises(ValueError, match="the reference engine is frozen"):
        frozen.forward_backward(_batches(tok, 1), _policy_loss, forward=LogProbs())


def test_infer_chunks_rows_in_eval_mode_and_restores_the_mode():
    tok = build_char_tokenizer()
    engine = make_engine(_model(tok), "actor", LAYOUT, trainable=True)
    batch = _batches(tok, 1)[0]
    engine.train()
    whole = engine.infer(batch, LogProbs(with_entropy=True))
    rows = engine.infer(batch, LogProbs(with_entropy=True), micro_batch=1)
    assert engine.training
    assert torch.allclose(whole.logp, rows.logp, atol=1e-6) and torch.allclose(whole.entropy, rows.entropy, atol=1e-6)
    assert not whole.logp.requires_grad and (whole.logp[batch.completion_mask == 0] == 0).all()
    critic = make_engine(_model(tok, "Qwen2ForSequenceClassification", num_labels=1), "critic", LAYOUT,
                         trainable=True, pad_token_id=tok.pad_token_id)
    assert critic.infer(batch, Values(), micro_batch=1).shape == batch.completion_mask.shape


def test_optimizer_step_clips_the_global_norm_steps_the_schedule_and_zeroes_gradients():
    tok = build_char_tokenizer()
    model = _model(tok)
    engine = make_engine(model, "actor", LAYOUT, trainable=True)
    spec = OptimizerSpec(torch.optim.SGD, {"lr": 1.0}, max_grad_norm=1e-3,
                         scheduler=SchedulerSpec("linear", num_warmup_steps=0, num_training_steps=4))
    engine.configure_optimizer(spec)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.forward_backward(_batches(tok, 2), _policy_loss, forward=LogProbs())
    grads = _grads(model)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
    assert engine.optimizer_step() == pytest.approx(norm, rel=1e-5)
    moved = torch.linalg.vector_norm(torch.stack([(p.detach() - before[n]).norm() for n, p in
                                                  model.named_parameters()])).item()
    assert moved == pytest.approx(1e-3, rel=1e-3)  # SGD at lr 1 moved by the clipped gradient exactly
    assert not _grads(model)
    assert engine.last_lr() == [0.75]  # linear decay over 4 steps, one taken
    state = engine.optimizer_state_dict()
    engine.load_optimizer_state_dict(state)
    with pytest.raises(RuntimeError, match="already has an optimizer"):
        engine.configure_optimizer(spec)


def test_optimizer_spec_groups_decay_like_transformers():
    params = [("w", torch.nn.Parameter(torch.ones(2))), ("b", torch.nn.Parameter(torch.ones(2))),
              ("frozen", torch.nn.Parameter(torch.ones(2), requires_grad=False))]
    grouped = OptimizerSpec(torch.optim.AdamW, {"lr": 0.1, "weight_decay": 9.0}, weight_decay=0.5,
                            decay_parameter_names={"w"}).build(params)
    assert [(len(g["params"]), g["weight_decay"]) for g in grouped.param_groups] == [(1, 0.5), (1, 0.0)]
    one = OptimizerSpec(torch.optim.AdamW, {"lr": 0.1}, weight_decay=0.5).build(params)
    assert [(len(g["params"]), g["weight_decay"]) for g in one.param_groups] == [(2, 0.5)]
    with pytest.raises(ValueError, match="needs optimizer_cls"):
        OptimizerSpec()


def test_registry_names_roles_and_engines():
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="unknown role 'judge'"):
        make_engine(_model(tok), "judge", LAYOUT)
    with pytest.raises(ValueError, match="no engine named 'warp'.*registered: \\['accelerate'"):
        make_engine(_model(tok), "actor", RoleLayout(BackendSpec(), ParallelDims(), engine="warp"))
    with pytest.raises(ValueError, match="above 1 need backend='megatron'"):
        launch_role_layout(1, tensor_parallel_size=2)
    assert LAYOUT.label == "accelerate plain one process"
    assert RoleLayout(BackendSpec("fsdp2"), ParallelDims(dp_shard=2, sp=2, world_size=4)).label == \
        "accelerate fsdp2 dp_shard=2 sp=2"
    fsdp = RoleLayout(BackendSpec(), ParallelDims(dp_replicate=2, world_size=2)).with_backend(BackendSpec("fsdp2"))
    assert (fsdp.dims.dp_shard, fsdp.dims.dp_replicate, fsdp.backend.kind) == (2, 1, "fsdp2")


def test_an_engine_is_its_parts_and_a_served_reference_only_scores():
    """TrainingEngine is the step, scoring, weights and adapters parts; a role that only scores implements `infer`
    alone (the served reference), and a part left unimplemented is refused at construction."""
    from hf_verl.engine.base import TrainingEngine
    from hf_verl.engine.parts import AdapterEngine, ModelScoring, ScoringEngine, StepEngine, WeightsEngine
    from hf_verl.engine.remote_reference import RemoteReference

    parts = (StepEngine, ModelScoring, ScoringEngine, WeightsEngine, AdapterEngine)
    tok = build_char_tokenizer()
    engine = make_engine(_model(tok), "reference", LAYOUT, trainable=False)
    assert isinstance(engine, TrainingEngine) and all(isinstance(engine, part) for part in parts)
    remote = RemoteReference("http://h:1")
    assert isinstance(remote, ScoringEngine)
    assert not any(isinstance(remote, part) for part in (TrainingEngine, StepEngine, ModelScoring, WeightsEngine))

    class Scores(ScoringEngine):  # what a scoring-only role must provide: infer
        role, device = "reference", torch.device("cpu")

        def infer(self, batch, forward, *, micro_batch=None):
            return batch

    assert Scores().infer(1, LogProbs()) == 1
    with pytest.raises(TypeError, match="abstract"):
        type("NoStep", (TrainingEngine,), {})()
    assert {"forward_backward", "optimizer_step", "export_weights", "infer", "adapters_disabled"} <= set(
        dir(TrainingEngine))
    assert {"optimizer_step", "_backward"} <= StepEngine.__abstractmethods__
    assert {"export_weights", "save_checkpoint"} <= WeightsEngine.__abstractmethods__
    assert {"token_logprobs", "logprobs"} <= ModelScoring.__abstractmethods__
    assert ScoringEngine.__abstractmethods__ == {"infer"}
    assert AdapterEngine.__abstractmethods__ == {"model", "module", "training", "train"}  # the model views only


@pytest.mark.parametrize("trainer_kind", ["grpo", "dpo"])
def test_trainers_hand_each_accumulation_window_to_the_engine_whole(tmp_path, trainer_kind):
    """gradient_accumulation_steps=2: one forward_backward of 2 micro-batches per optimizer step, then one
    optimizer_step; the Trainer's logged loss is the window's mean."""
    from datasets import Dataset

    tok = build_char_tokenizer()
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, logging_steps=1,
                  per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2,
                  gradient_checkpointing=False, save_strategy="no")
    if trainer_kind == "grpo":
        from hf_verl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(_model(tok), reward_funcs=lambda completions, **kw: [float(len(c) % 3) for c in
                                                                                  completions],
                              args=GRPOConfig(num_generations=2, max_completion_length=4, **common),
                              train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"] * 4}),
                              processing_class=tok)
    else:
        from hf_verl import DPOConfig, DPOTrainer

        rows = {"prompt": ["ab", "cd", "ef", "gh"] * 4, "chosen": ["a", "c", "e", "g"] * 4,
                "rejected": ["b", "d", "f", "h"] * 4}
        trainer = DPOTrainer(_model(tok), args=DPOConfig(max_length=16, **common),
                             train_dataset=Dataset.from_dict(rows), processing_class=tok)
    calls, steps = [], []
    forward_backward, optimizer_step = trainer.actor.forward_backward, trainer.actor.optimizer_step
    trainer.actor.forward_backward = lambda mbs, *a, **kw: calls.append((len(mbs), kw.get("forward_only", False))) \
        or forward_backward(mbs, *a, **kw)
    trainer.actor.optimizer_step = lambda: steps.append(1) or optimizer_step()
    trainer.train()
    assert [c for c in calls if not c[1]] == [(2, False), (2, False)] and len(steps) == 2
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(x)) for x in losses)
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(norms) == 2 and all(n > 0 for n in norms)


def test_replica_is_every_model_parallel_rank_of_one_data_parallel_rank():
    """The sampler's copies and the rollout broadcast count sp x tp x pp ranks as one replica."""
    dims = ParallelDims(dp_shard=2, sp=2, tp=2, world_size=8, rank=5)
    assert (dims.replica_size, dims.dp_rank, dims.replica_rank) == (4, 1, 1)
    ranks = [ParallelDims(dp_shard=2, pp=2, sp=2, world_size=8, rank=r) for r in range(8)]
    by_replica = {}
    for d in ranks:
        by_replica.setdefault(d.dp_rank, []).append(d.replica_rank)
    assert by_replica == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    assert ParallelDims().replica_size == 1 and ParallelDims().replica_group is None
