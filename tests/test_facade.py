"""The role-level facade `hf_verl.Trainer`: lazy roles, config, the three-call loop, tracing."""

import copy
import json
import logging

import pytest
import torch

from tests.conftest import build_bpe_tokenizer, build_char_tokenizer

ACTOR_ID = "Qwen/Qwen2.5-7B"


def tiny_llama(tok, cls_name="LlamaForCausalLM", seed=0, vocab_extra=0, **kw):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4,
                                      vocab_size=len(tok) + vocab_extra, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, bos_token_id=None, **kw)
    return getattr(transformers, cls_name)(config)


def count_a(prompts, completions, completion_ids, **kwargs):
    return [float(c.count("a")) for c in completions]


def make_trainer(tok=None, critic=False, **kwargs):
    from hf_verl import Trainer

    tok = tok or build_char_tokenizer()
    # per-row seeds: each test's rollouts are the same on every run, whatever else drew random numbers
    # synchronous unless a test asks (the facade's default is asynchronous rollout: tests/test_facade_async.py)
    config = dict(group_size=4, max_new_tokens=4, actor_lr=1e-2, critic_lr=1e-2, seed=0, per_row_sampling_seed=True,
                  use_async_rollout=False)
    config.update(kwargs.pop("config", {}))
    critic_model = None
    if critic:
        critic_model = tiny_llama(tok, "LlamaForSequenceClassification", seed=1, num_labels=1)
    return Trainer(actor_model=kwargs.pop("actor", None) or tiny_llama(tok), critic_model=critic_model,
                   reward_model=kwargs.pop("reward_model", count_a), tokenizer=tok, config=config, **kwargs)


PROMPTS = ["abc=", "hello", "xyz a"]


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def changed(before, model):
    after = dict(model.named_parameters())
    return [n for n, p in before.items() if not torch.equal(p, after[n])]


# ---------------------------------------------------------------------- lazy roles, offline
def test_construction_is_lazy_and_offline_and_first_use_names_the_role(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants
    import transformers

    from hf_verl import Trainer
    from hf_verl.facade.roles import RoleLoadError

    home = tmp_path / "hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)

    def forbidden(*args, **kwargs):
        raise AssertionError("construction must not load anything")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModelForSequenceClassification,
                transformers.AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", forbidden)
    trainer = Trainer(actor_model=ACTOR_ID, critic_model=ACTOR_ID, reward_model=[count_a, "org/reward-7b"],
                      reference_model=ACTOR_ID, tokenizer=None, dataset=None, config=None)
    assert not trainer.actor.loaded and not trainer.critic.loaded and not trainer.reference.loaded
    assert list(home.iterdir()) == []
    assert trainer.config.group_size == 8 and trainer.config.rollout_batch_size == 16

    with pytest.raises(RoleLoadError, match=r"actor model 'Qwen/Qwen2\.5-7B'.*HF_HUB_OFFLINE"):
        trainer.rollout(["abc"])
    with pytest.raises(RoleLoadError, match=r"reference model 'Qwen/Qwen2\.5-7B'"):
        trainer.reference.get()
    with pytest.raises(RoleLoadError, match=r"critic model 'Qwen/Qwen2\.5-7B'"):
        trainer.critic.get()
    with pytest.raises(RoleLoadError, match=r"reward model 'org/reward-7b'"):
        trainer.reward_funcs[1](prompts=["a"], completions=["b"])
    assert list(home.iterdir()) == []


# ---------------------------------------------------------------------- config
def test_config_validation_messages_and_defaults():
    from hf_verl.facade.config import TrainerConfig

    cfg = TrainerConfig()
    assert (cfg.lam, cfg.gamma, cfg.epsilon, cfg.cliprange_value, cfg.beta) == (0.95, 1.0, 0.2, 0.2, 0.0)
    assert (cfg.gae_lambda, cfg.clip_range, cfg.value_clip_range, cfg.kl_coef) == (0.95, 0.2, 0.2, 0.0)  # aliases
    assert (cfg.learning_rate, cfg.critic_learning_rate, cfg.advantage_estimator) == (1e-6, None, "auto")
    cfg.group_size = 3
    assert cfg.num_generations == 3 and cfg.to_dict()["num_generations"] == 3 and "group_size" not in cfg.to_dict()
    cfg.num_generations = 8
    with pytest.raises(AttributeError, match="Did you mean 'temperature'"):
        cfg.temprature = 0.5
    with pytest.raises(AttributeError, match="'actor_lr'"):
        cfg.actor_rl = 1e-3
    with pytest.raises(AttributeError, match="'group_size'"):
        cfg.group_sise  # noqa: B018 - reading an unknown name fails the same way
    with pytest.raises(TypeError, match=r"group_size \(num_generations\) must be an int >= 1, got str"):
        cfg.group_size = "8"
    with pytest.raises(TypeError, match="an int >= 1"):
        cfg.group_size = True
    with pytest.raises(ValueError, match=r"clip_range \(epsilon\) must be a finite float > 0, got -1"):
        cfg.clip_range = -1
    with pytest.raises(ValueError, match=r"gae_lambda \(lam\) must be a float in \[0, 1\]"):
        cfg.gae_lambda = 1.5
    with pytest.raises(ValueError, match=r"estimator \(advantage_estimator\) must be 'auto' or a registered estimator"):
        cfg.estimator = "ppo"
    with pytest.raises(ValueError, match="model_size"):
        cfg.model_size = "seven billion"
    cfg.model_size = "7B"
    cfg.model_size = 7_000_000_000
    cfg.actor_lr = 1  # ints are accepted for floats
    assert cfg.actor_lr == 1.0 and isinstance(cfg.actor_lr, float)


def test_config_changes_take_effect_at_next_step_and_rollout():
    trainer = make_trainer()
    seen = []
    generate = trainer.engine.generate
    trainer.engine.generate = lambda ids, sampling, **kw: seen.append(sampling) or generate(ids, sampling, **kw)
    trainer.step(trainer.compute_loss(trainer.rollout(PROMPTS)))
    groups = trainer.actor_engine.param_groups
    trainer.config.actor_lr = 3e-3
    assert trainer.actor_engine.param_groups is groups and all(g["lr"] == 3e-3 for g in groups)
    trainer.config.temperature = 0.5
    trainer.config.group_size = 2
    rollout = trainer.rollout(PROMPTS)
    assert seen[-1].temperature == 0.5 and rollout.batch_size == 2 * len(PROMPTS)
    metrics = trainer.step(trainer.compute_loss(rollout))
    assert metrics["lr/actor"] == 3e-3


def test_shared_knobs_have_the_trainers_names_and_defaults():
    """One vocabulary: every facade setting that GRPOConfig (or, for the critic, PPOConfig) also has
    carries the same default there."""
    import dataclasses

    from hf_verl import GRPOConfig, PPOConfig
    from hf_verl.facade.config import ALIASES, FIELDS

    grpo = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ppo = {f.name: f.default for f in dataclasses.fields(PPOConfig)}
    # "auto" picks what each trainer fixes: GAE with a critic (PPOTrainer), GRPO without (GRPOTrainer)
    # kl_estimator: the facade's KL is GRPO's loss term (k3, as GRPOConfig fixes it); PPOConfig's is the
    # KL folded into the rewards (k1), another concept
    # use_async_rollout: the facade keeps the seed article's default (True); the TRL-style trainers keep TRL's
    facade_only = {"advantage_estimator", "kl_estimator", "use_async_rollout"}
    shared = 0
    for name, field in FIELDS.items():
        source = grpo if name in grpo else ppo if name in ppo else None
        if source is None or name in facade_only:
            continue
        shared += 1
        assert field.default == source[name], (name, field.default, source[name])
    assert shared >= 20
    assert set(ALIASES.values()) <= set(FIELDS)


# ---------------------------------------------------------------------- parallelisms
def test_supported_parallelisms_are_truthful():
    """The real checks of this machine and installation: CPU processes over gloo run DDP and FSDP2,
    DeepSpeed runs when it imports, and what is not built yet says so."""
    import importlib.util

    import torch

    trainer = make_trainer()
    found, reasons = trainer.supported_parallelisms(), trainer.supported_parallelisms(reasons=True)
    assert set(reasons) == {"data", "fsdp", "zero", "sequence", "tensor", "pipeline", "expert"}
    assert found == [name for name in reasons if name in found]  # a subset, in the report's order
    if not torch.cuda.is_available():
        assert "data" in found and "fsdp" in found and "gloo" in reasons["data"]
    assert ("zero" in found) == (importlib.util.find_spec("deepspeed") is not None)
    if not torch.cuda.is_available():  # Ulysses runs wherever data parallelism does
        assert "sequence" in found and "sequence_parallel_size" in reasons["sequence"]
    megatron = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
    assert ("tensor" in found) == ("pipeline" in found) == (megatron and "data" in found)
    if megatron and "tensor" in found:
        assert "tensor_model_parallel_size" in reasons["tensor"] and "backend='megatron'" in reasons["pipeline"]


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: about 6 s
def test_a_backend_that_does_not_import_is_reported_with_its_error(tmp_path):
    """A deepspeed that is installed but broken (here: a package on the path that fails on import) is not
    supported, and the reason carries its import error; checked in a fresh interpreter."""
    import subprocess
    import sys

    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("raise ImportError('built for another CUDA')\n")
    code = ("from hf_verl.planner.capabilities import parallelism_report as r; rep = r(); "
            "print(rep['zero'].available, '|', rep['zero'].reason)")
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{__import__('os').getcwd()}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    available, reason = out.stdout.strip().split(" | ", 1)
    assert available == "False" and "built for another CUDA" in reason and "hf_verl[deepspeed]" in reason


# ---------------------------------------------------------------------- the loop
def test_three_call_loop_trains_the_actor_without_critic():
    trainer = make_trainer()
    before = snapshot(trainer.model)
    for _ in range(2):
        rollout = trainer.rollout(PROMPTS)
        assert rollout.batch_size == 12 and len(rollout.completions) == 12 and rollout.prompts[:4] == ["abc="] * 4
        assert rollout.advantages.shape == rollout.completion_ids.shape and rollout.values is None
        loss = trainer.compute_loss(rollout)
        assert torch.isfinite(loss)
        metrics = trainer.step(loss)
    assert metrics["weight_version"] == 2 and metrics["step"] == 2
    for key in ("loss/policy", "entropy", "grad_norm/actor", "reward/mean", "rollout/generated_tokens",
                "rollout/prompt_length_mean", "time/reward_s", "time/reference_s", "time/critic_s",
                "memory/peak_mb", "reward/count_a/mean"):
        assert key in metrics, key
    assert metrics["memory/peak_mb"] > 0
    moved = changed(before, trainer.model)
    assert len(moved) >= 0.9 * len(before), f"only {len(moved)}/{len(before)} params changed"


def test_three_call_loop_trains_actor_and_critic_with_gae_and_minibatches():
    trainer = make_trainer(critic=True)
    actor_before, critic_before = snapshot(trainer.model), snapshot(trainer.critic.get())
    rollout = trainer.rollout(PROMPTS)
    assert rollout.values.shape == rollout.returns.shape == rollout.completion_ids.shape
    for mb in rollout.split(6):  # one PPO epoch over two mini-batches
        metrics = trainer.step(trainer.compute_loss(mb))
        assert torch.isfinite(torch.tensor(metrics["loss/total"])) and "loss/value" in metrics
    assert trainer.roles.engine("critic").param_groups[0]["lr"] == 1e-2 and metrics["lr/critic"] == 1e-2
    assert changed(actor_before, trainer.model)
    # the classification-only pooling path is unused for per-token values; every trained tensor moved
    moved = changed(critic_before, trainer.critic.get())
    assert len(moved) == len(critic_before), set(critic_before) - set(moved)
    trainer.config.estimator = "grpo"
    with pytest.raises(ValueError, match="does not use the critic"):
        trainer.rollout(PROMPTS)


def test_dataloader_dict_batch_columns_reach_rewards_and_dataset_draws():
    from datasets import Dataset
    from torch.utils.data import DataLoader

    seen = {}

    def with_answer(prompts, completions, completion_ids, answer, **kwargs):
        seen["answer"] = answer
        return [1.0 if c.startswith(a) else 0.0 for c, a in zip(completions, answer)]

    ds = Dataset.from_dict({"prompt": ["ab=", "cd=", "ef="], "answer": ["b", "d", "f"]})
    trainer = make_trainer(reward_model=with_answer, dataset=ds, config={"group_size": 2, "rollout_batch_size": 2})
    batch = next(iter(DataLoader(ds, batch_size=3)))
    rollout = trainer.rollout(batch)
    assert seen["answer"] == ["b", "b", "d", "d", "f", "f"] and rollout.columns["answer"] == seen["answer"]
    assert rollout.split(2)[1].columns["answer"] == ["d", "d"]
    assert trainer.rollout().batch_size == 4  # drawn from the dataset: rollout_batch_size x group_size


def test_conversational_prompts_and_reward_model_with_its_own_tokenizer():
    rm_tok = build_bpe_tokenizer()
    reward_model = tiny_llama(rm_tok, "LlamaForSequenceClassification", seed=2, num_labels=1)
    trainer = make_trainer(reward_model=[count_a, reward_model], reward_tokenizer=rm_tok)
    rollout = trainer.rollout([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "abc"}]])
    assert rollout.rewards.shape == (8,) and torch.isfinite(rollout.rewards).all()
    assert trainer.step(trainer.compute_loss(rollout))["weight_version"] == 1


# ---------------------------------------------------------------------- tracing and debug
def test_debug_mode_writes_jsonl_records_at_role_boundaries(tmp_path):
    path = tmp_path / "debug" / "records.jsonl"
    trainer = make_trainer(critic=True, config={"debug_path": str(path)})
    trainer.debug_mode = True
    rollout = trainer.rollout(PROMPTS)
    trainer.step(trainer.compute_loss(rollout))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and all(r["trace_id"] == rollout.trace_id for r in rows)
    boundaries = {r["boundary"] for r in rows}
    assert {"actor->rollout", "reward->rollout", "actor->critic", "critic->rollout", "advantages->rollout",
            "rollout->actor", "compute_loss->step"} <= boundaries
    values = next(r for r in rows if r["boundary"] == "critic->rollout" and r["name"] == "values")
    assert values["shape"] == list(rollout.completion_ids.shape) and values["dtype"] == "float32"
    assert values["device"] == "cpu"


def test_trace_id_reaches_every_log_line_and_the_metrics(caplog):
    trainer = make_trainer()
    caplog.set_level(logging.INFO, logger="hf_verl.facade")
    rollout = trainer.rollout(PROMPTS)
    metrics = trainer.step(trainer.compute_loss(rollout))
    assert len(rollout.trace_id) == 12 and metrics["trace_id"] == rollout.trace_id
    records = [r for r in caplog.records if r.name.startswith("hf_verl.facade")]
    messages = " | ".join(r.getMessage() for r in records)
    assert "rollout:" in messages and "compute_loss:" in messages and "step 1:" in messages
    assert all(r.trace_id == rollout.trace_id for r in records)
    assert all(f"[trace={rollout.trace_id}]" in r.getMessage() for r in records)
    assert trainer.rollout(PROMPTS).trace_id != rollout.trace_id


# ---------------------------------------------------------------------- role pairings
def test_reference_in_another_dtype_is_moved_and_logged_once(caplog):
    tok = build_char_tokenizer()
    actor = tiny_llama(tok)
    reference = copy.deepcopy(actor).to(torch.float64)
    trainer = make_trainer(tok, actor=actor, reference_model=reference, config={"kl_coef": 0.1})
    caplog.set_level(logging.INFO, logger="hf_verl.facade")
    rollout = trainer.rollout(PROMPTS)
    trainer.rollout(PROMPTS)
    moves = [r.getMessage() for r in caplog.records if "moving rollout tensors" in r.getMessage()]
    assert len(moves) == 1
    assert "actor (cpu, torch.float32)" in moves[0] and "reference (cpu, torch.float64)" in moves[0]
    assert rollout.ref_logprobs.dtype == torch.float32
    torch.testing.assert_close(rollout.ref_logprobs, rollout.old_logprobs, atol=1e-4, rtol=0)
    metrics = trainer.step(trainer.compute_loss(rollout))
    assert abs(metrics["kl"]) < 1e-6


def test_peft_actor_with_adapters_disabled_is_the_reference():
    from peft import LoraConfig, get_peft_model

    tok = build_char_tokenizer()
    actor = get_peft_model(tiny_llama(tok), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = make_trainer(tok, actor=actor, config={"kl_coef": 0.05})
    rollout = trainer.rollout(PROMPTS)
    torch.testing.assert_close(rollout.ref_logprobs, rollout.old_logprobs)  # LoRA B starts at 0
    before = snapshot(actor)
    trainer.step(trainer.compute_loss(rollout))
    assert changed(before, actor) and all("lora" in n for n in before)


def test_an_engine_with_its_own_weights_receives_the_merged_peft_actor_after_a_step():
    # the engine holds a plain model: it must get base names with the LoRA deltas merged in
    from peft import LoraConfig, get_peft_model

    from hf_verl.rollout.hf_engine import TransformersEngine

    tok = build_char_tokenizer()
    base = tiny_llama(tok)
    engine = TransformersEngine(copy.deepcopy(base).eval(), tok)
    actor = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = make_trainer(tok, actor=actor, rollout_engine=engine, config={"use_async_rollout": False})
    trainer.step(trainer.compute_loss(trainer.rollout(PROMPTS)))
    merged = copy.deepcopy(actor).merge_and_unload().state_dict()
    assert engine.weight_version == 2  # synced before its first generation, and after the step
    assert all(torch.equal(v, merged[k]) for k, v in engine.model.state_dict().items())
    assert not torch.equal(engine.model.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           base.get_submodule("model.layers.0.self_attn.q_proj").base_layer.weight)


def test_vocabulary_mismatch_is_an_error_naming_both_roles():
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"actor .* vocabulary of \d+ tokens but the reference"):
        make_trainer(tok, reference_model=tiny_llama(tok, vocab_extra=5))
    from hf_verl import Trainer

    critic = tiny_llama(tok, "LlamaForSequenceClassification", vocab_extra=3, num_labels=1)
    with pytest.raises(ValueError, match="but the critic"):
        Trainer(actor_model=tiny_llama(tok), critic_model=critic, reward_model=count_a, tokenizer=tok)


def test_reward_returning_nan_is_an_error_naming_the_function():
    def broken_reward(prompts, completions, **kwargs):
        return [float("nan")] * len(completions)

    trainer = make_trainer(reward_model=broken_reward)
    with pytest.raises(ValueError, match="'broken_reward' returned nan"):
        trainer.rollout(PROMPTS)


# ---------------------------------------------------------------------- estimators, engines, defaults
@pytest.mark.parametrize("name", ["rloo", "dr_grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_critic_free_estimators_by_name(name):
    trainer = make_trainer(config={"estimator": name})
    rollout = trainer.rollout(PROMPTS)
    assert rollout.advantages.shape == rollout.completion_ids.shape
    assert torch.isfinite(rollout.advantages).all()
    assert (rollout.advantages * (1 - rollout.completion_mask)).abs().sum() == 0


def test_gae_without_critic_is_refused():
    trainer = make_trainer(config={"estimator": "gae"})
    with pytest.raises(ValueError, match="'gae' needs a critic"):
        trainer.rollout(PROMPTS)


def test_actor_given_as_rollout_engine_is_trained_and_synced():
    from hf_verl import Trainer
    from hf_verl.rollout.hf_engine import TransformersEngine

    tok = build_char_tokenizer()
    engine = TransformersEngine(tiny_llama(tok), tok)
    trainer = Trainer(actor_model=engine, reward_model=count_a, config={"group_size": 2, "max_new_tokens": 3})
    assert trainer.model is engine.model and trainer.tokenizer is tok
    metrics = trainer.step(trainer.compute_loss(trainer.rollout(PROMPTS)))
    assert engine.weight_version == metrics["weight_version"] == 1


def test_reward_functions_see_the_trace_id_and_debug_file_defaults_to_cwd(tmp_path, monkeypatch):
    from hf_verl.facade.debug import current_trace_id

    seen = []

    def traced(prompts, completions, **kwargs):
        seen.append(current_trace_id())
        return [0.0] * len(completions)

    monkeypatch.chdir(tmp_path)
    trainer = make_trainer(reward_model=traced)
    trainer.debug_mode = True
    rollout = trainer.rollout(PROMPTS)
    assert seen == [rollout.trace_id] and current_trace_id() is None
    rows = (tmp_path / "hf_verl_debug.jsonl").read_text().splitlines()
    assert rows and json.loads(rows[0])["trace_id"] == rollout.trace_id


def test_facade_passes_every_sampling_field_of_the_trainers():
    """min_p, repetition_penalty and stop (GRPOConfig's names) reach the rollout engine as the trainers pass them."""
    trainer = make_trainer(config={"min_p": 0.05, "repetition_penalty": 1.3, "stop": ["zz"], "per_row_sampling_seed": False})
    seen = []
    generate = trainer.engine.generate
    trainer.engine.generate = lambda ids, sampling, **kw: seen.append(sampling) or generate(ids, sampling, **kw)
    trainer.rollout(PROMPTS)
    assert (seen[0].min_p, seen[0].repetition_penalty, seen[0].stop) == (0.05, 1.3, ("zz",))
    with pytest.raises((TypeError, ValueError), match="repetition_penalty"):
        trainer.config.repetition_penalty = 0.0


def test_facade_reward_functions_get_trls_logging_keywords():
    """The facade scores through the trainers' collector: a reward function's log_metric values reach the rollout's
    metrics."""
    def logging_reward(completions, log_metric=None, **kwargs):
        log_metric("my/len", float(sum(len(c) for c in completions)))
        return [float(c.count("a")) for c in completions]

    trainer = make_trainer(reward_model=logging_reward)
    rollout = trainer.rollout(PROMPTS)
    assert rollout.metrics["my/len"] == float(sum(len(c) for c in rollout.completions))


@pytest.mark.parametrize("estimator, loss, kl", [("remax", None, "k1"), ("optimal_token_baseline", "vanilla", "k2"),
                                                 ("gdpo", "gspo", "k3")])
def test_the_facade_runs_every_estimator_loss_and_kl_estimator_the_trainers_run(estimator, loss, kl):
    """The facade runs the trainers' algorithm object: ReMax (its greedy baseline from the facade's engine) and the
    optimal-token baseline (the sampling policy's statistics), which it used to refuse, train like any other."""
    trainer = make_trainer(config=dict(advantage_estimator=estimator, policy_loss=loss, kl_estimator=kl, beta=0.1),
                           reference_model=tiny_llama(build_char_tokenizer(), seed=3))
    before = snapshot(trainer.model)
    rollout = trainer.rollout(PROMPTS)
    assert rollout.advantages.shape == rollout.completion_ids.shape and torch.isfinite(rollout.advantages).all()
    if estimator == "remax":  # reward minus the greedy completion's reward of the same prompt: one greedy per prompt
        greedy = trainer._round_collector().greedy_scores(rollout, [{"prompt": p} for p in rollout.prompts],
                                                          trainer.engine, None)
        expected = (rollout.rewards - greedy).unsqueeze(1) * rollout.completion_mask
        torch.testing.assert_close(rollout.advantages, expected)
    metrics = trainer.step(trainer.compute_loss(rollout))
    assert "kl" in metrics and torch.isfinite(torch.tensor(metrics["loss/total"]))
    assert changed(before, trainer.model)
