"""The registries are the extension points: a user's own file (docs/adding_an_algorithm.md's, run as written)
registers an estimator, a policy loss and a rollout engine, and GRPOConfig, PPOConfig and the facade's config run
them by name, with no edit to hf_verl. The built-ins sit in the same registries."""

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from hf_verl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    advantage_estimator_names,
    get_advantage_estimator,
    register_advantage_estimator,
    register_policy_loss,
)
from hf_verl.algorithms.estimators import BUILTIN_ESTIMATORS, compute_advantages
from hf_verl.algorithms.policy_losses import BUILTIN_POLICY_LOSSES
from hf_verl.rollout import ROLLOUT_ENGINES
from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _args, _model, text_reward

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding_an_algorithm.md"
NAMES = {"estimator": "median_baseline", "loss": "capped_reinforce", "engine": "greedy_transformers"}


def _users_file() -> str:
    """The first python block under the page's "A user's file" heading: the file a user writes."""
    text = DOC.read_text()
    section = text[text.index("## A user's file"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def users_algorithms(tmp_path, monkeypatch):
    """The page's file imported as a user imports theirs; its registrations are removed afterwards."""
    (tmp_path / "my_algorithms.py").write_text(_users_file())
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_algorithms")
    yield module
    sys.modules.pop("my_algorithms", None)
    ADVANTAGE_ESTIMATORS.pop(NAMES["estimator"], None)
    POLICY_LOSSES.pop(NAMES["loss"], None)
    ROLLOUT_ENGINES.pop(NAMES["engine"], None)


def _median_advantages(scores: torch.Tensor, group: int) -> torch.Tensor:
    groups = scores.view(-1, group)
    return (groups - groups.median(dim=-1, keepdim=True).values).reshape(-1)


def test_the_builtins_are_registered_as_a_user_registers():
    assert set(BUILTIN_ESTIMATORS) <= set(advantage_estimator_names())
    assert set(BUILTIN_POLICY_LOSSES) <= set(POLICY_LOSSES)
    assert {"transformers", "vllm", "remote"} <= set(ROLLOUT_ENGINES)
    assert advantage_estimator_names(critic=True) == ("gae",)
    assert get_advantage_estimator("remax").requires == ("scores", "greedy_scores")
    assert POLICY_LOSSES["bypass_mode"].behaviour == "sampling" and POLICY_LOSSES["vespo"].importance_weights == "argument"


def test_registration_errors_say_what_to_change():
    with pytest.raises(ValueError, match="already registered.*replace=True"):
        register_advantage_estimator("grpo")(lambda **kw: None)
    with pytest.raises(ValueError, match="already registered.*replace=True"):
        register_policy_loss("clip")(lambda *a: None)
    with pytest.raises(ValueError, match=r"requires names unknown inputs \['advantage'\]"):
        register_advantage_estimator("x", requires=("advantage",))
    with pytest.raises(ValueError, match="behaviour must be one of"):
        register_policy_loss("x", behaviour="new")
    with pytest.raises(ValueError, match="'ppo' is an alias of the policy loss 'clip'"):
        register_policy_loss("ppo")(lambda *a: None)
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'.*register_advantage_estimator"):
        compute_advantages("nope", mask=torch.ones(2, 2), scores=torch.zeros(2))


def test_an_estimator_receives_only_what_it_names_and_must_return_a_pair():
    seen = {}

    @register_advantage_estimator("only_scores", uses_groups=False)
    def only_scores(scores, mask):
        seen["got"] = (scores.shape, mask.shape)
        return scores.unsqueeze(-1) * mask, None

    @register_advantage_estimator("bad_return")
    def bad_return(scores, mask, **kwargs):
        return scores

    try:
        mask = torch.ones(4, 3)
        adv, ret = compute_advantages("only_scores", scores=torch.arange(4.0), mask=mask, num_generations=2,
                                      gamma=1.0, values=None)
        assert seen["got"] == ((4,), (4, 3)) and ret is None and adv[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(TypeError, match="must return \\(advantages, returns_or_None\\), got Tensor"):
            compute_advantages("bad_return", scores=torch.zeros(4), mask=mask)
        with pytest.raises(ValueError, match="estimator 'only_scores' needs scores"):
            compute_advantages("only_scores", mask=mask)
    finally:
        ADVANTAGE_ESTIMATORS.pop("only_scores")
        ADVANTAGE_ESTIMATORS.pop("bad_return")


def test_configs_accept_a_name_only_once_it_is_registered(tmp_path, users_algorithms):
    from hf_verl import GRPOConfig, PPOConfig
    from hf_verl.facade.config import TrainerConfig

    assert GRPOConfig(output_dir=str(tmp_path), advantage_estimator="median_baseline", policy_loss="capped_reinforce",
                      rollout_engine="greedy_transformers", use_cpu=True).policy_loss == "capped_reinforce"
    assert PPOConfig(output_dir=str(tmp_path), advantage_estimator="median_baseline", num_generations=2,
                     use_cpu=True).advantage_estimator == "median_baseline"
    config = TrainerConfig(advantage_estimator="median_baseline", policy_loss="capped_reinforce")
    assert config.policy_loss == "capped_reinforce"
    with pytest.raises(ValueError, match="median_baseline_2.*register_advantage_estimator"):
        GRPOConfig(output_dir=str(tmp_path), advantage_estimator="median_baseline_2", use_cpu=True)
    with pytest.raises(ValueError, match="rollout_engine='greedy' is not a registered rollout engine"):
        GRPOConfig(output_dir=str(tmp_path), rollout_engine="greedy", use_cpu=True)
    with pytest.raises(ValueError, match="policy_loss must be None or a registered policy loss.*register_policy_loss"):
        TrainerConfig(policy_loss="capped")


def _grpo(tmp_path, tok, **kw):
    from hf_verl import GRPOTrainer

    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, reward_funcs=text_reward, args=_args(tmp_path, max_steps=2, **kw),
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2}),
                          processing_class=tok)
    return trainer, model, before


def _spy(name: str) -> list:
    """Record every call of the registered estimator `name`: (its scores, the advantages it returned)."""
    import dataclasses

    calls, spec = [], ADVANTAGE_ESTIMATORS[name]

    def recording(**inputs):
        out = spec.fn(**inputs)
        calls.append((inputs["scores"].clone(), out[0].clone(), inputs["mask"].clone()))
        return out

    ADVANTAGE_ESTIMATORS[name] = dataclasses.replace(spec, fn=recording, accepts=None)
    return calls


def test_grpo_trains_with_the_users_estimator_and_loss(tmp_path, users_algorithms):
    tok = build_char_tokenizer()
    calls = _spy("median_baseline")
    trainer, model, before = _grpo(tmp_path, tok, advantage_estimator="median_baseline",
                                   policy_loss="capped_reinforce", num_iterations=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all("capped_frac" in h for h in logs)  # the user's loss's own statistic
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert len(calls) == 1  # one round (2 steps = 1 generation x num_iterations 2)
    scores, advantages, mask = calls[0]
    torch.testing.assert_close(advantages, _median_advantages(scores, 4).unsqueeze(-1) * mask)
    rows = sorted(tuple(r) for mb in trainer._buffer for r in mb.advantages.tolist())
    assert rows == sorted(tuple(r) for r in advantages.tolist())  # the round trained on exactly those


def test_the_users_rollout_engine_generates_for_the_trainer_and_the_facade(tmp_path, users_algorithms):
    from hf_verl import Trainer

    tok = build_char_tokenizer()
    trainer, _, _ = _grpo(tmp_path, tok, rollout_engine="greedy_transformers")
    assert type(trainer.engine).__name__ == "Greedy" and trainer.engine.model is trainer.actor.model
    collected = trainer._collect([{"prompt": "abc"}] * 4, trainer.engine)
    assert len({tuple(row) for row in collected.batch.completion_ids.tolist()}) == 1  # greedy: one completion
    facade = Trainer(actor_model=_model(tok), reward_model=text_reward, tokenizer=tok,
                     rollout_engine="greedy_transformers", config=dict(num_generations=4, max_completion_length=4,
                                                                       use_async_rollout=False))
    rollout = facade.rollout(["abc"])
    assert type(facade.engine).__name__ == "Greedy"
    assert len({tuple(row) for row in rollout.completion_ids.tolist()}) == 1


def test_ppo_trainer_runs_the_users_estimator_and_loss(tmp_path, users_algorithms):
    from hf_verl import PPOConfig, PPOTrainer

    tok = build_char_tokenizer()
    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, logging_steps=1,
                     per_device_train_batch_size=4, num_generations=2, response_length=5, learning_rate=1e-2,
                     advantage_estimator="median_baseline", policy_loss="capped_reinforce", kl_coef=0.0,
                     save_strategy="no", num_ppo_epochs=1, stop_token="eos")
    trainer = PPOTrainer(args=args, processing_class=tok, model=model, reward_model=text_reward,
                         train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2}))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss/policy_avg"])) for h in logs)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    batch = trainer._buffer[0]
    assert batch.advantages.dim() == 2 and batch.returns is None


def test_the_facade_runs_the_users_estimator_and_loss(users_algorithms):
    from hf_verl import Trainer

    tok = build_char_tokenizer()
    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    facade = Trainer(actor_model=model, reward_model=text_reward, tokenizer=tok,
                     config=dict(num_generations=4, max_completion_length=5, learning_rate=1e-2,
                                 advantage_estimator="median_baseline", policy_loss="capped_reinforce",
                                 use_async_rollout=False))
    rollout = facade.rollout(["abc", "hello"])
    expected = _median_advantages(rollout.rewards, 4).unsqueeze(-1) * rollout.completion_mask
    torch.testing.assert_close(rollout.advantages, expected)
    metrics = facade.step(facade.compute_loss(rollout))
    assert "capped_frac" in metrics and torch.isfinite(torch.tensor(metrics["loss/total"]))
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
