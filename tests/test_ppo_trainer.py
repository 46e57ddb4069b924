"""PPOTrainer on a tiny policy and critic: TRL's script shape, both models train, value loss falls."""

import pytest
import torch
from datasets import Dataset

from hf_verl.trainers.ppo_config import PPOConfig
from hf_verl.trainers.ppo_trainer import PPOTrainer, explained_variance
from tests.conftest import build_char_tokenizer


def _cfg(tok):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id, num_labels=1)


def _policy(tok, seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_cfg(tok))


def _critic(tok, seed=1):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    return LlamaForSequenceClassification(_cfg(tok))


def count_a(completions, **kwargs):
    return [float(c.count("a")) for c in completions]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=4, logging_steps=1,
                per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2,
                num_ppo_epochs=2, response_length=5, learning_rate=1e-2, critic_learning_rate=3e-2,
                save_strategy="no", stop_token="eos", disable_tqdm=True)
    base.update(kw)
    return PPOConfig(**base)


def test_batch_sizes_follow_trl(tmp_path):
    # TRL's PPO: local_batch_size = per_device x gradient_accumulation_steps x num_mini_batches
    args = _args(tmp_path, total_episodes=64, max_steps=-1, gradient_accumulation_steps=2)
    assert args.local_batch_size == 16 and args.local_mini_batch_size == 8 and args.batch_size == 16
    assert args.gradient_accumulation_steps == 2  # micro-batches per mini-batch = per optimizer step
    assert args.max_steps == 64 // 16 * 2 * 2  # updates x epochs x mini-batches
    args = _args(tmp_path, num_mini_batches=2, gradient_accumulation_steps=3)  # refused before: any combination
    assert (args.local_batch_size, args.local_mini_batch_size, args.steps_per_generation) == (24, 12, 6)


def test_trl_script_shape_trains_policy_and_critic(tmp_path):
    tok = build_char_tokenizer()
    policy, critic = _policy(tok), _critic(tok)
    p0 = {n: p.detach().clone() for n, p in policy.named_parameters()}
    c0 = {n: p.detach().clone() for n, p in critic.named_parameters()}
    ds = Dataset.from_dict({"input_ids": [tok("abc")["input_ids"], tok("xyz")["input_ids"]] * 8})
    trainer = PPOTrainer(args=_args(tmp_path), processing_class=tok, model=policy, ref_model=None,
                         reward_model=count_a, train_dataset=ds, value_model=critic)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    for key in ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg",
                "loss/value_avg", "val/clipfrac_avg", "val/ratio", "critic/vf_explained_var",
                "timing_s/generate", "perf/tokens_per_second"):
        assert key in logs[0], key
    assert [n for n, p in policy.named_parameters() if torch.equal(p, p0[n])] == []
    assert [n for n, p in critic.named_parameters() if torch.equal(p, c0[n])] == []
    # one rollout of 8 feeds 2 epochs x 2 mini-batches = 4 steps; the first mini-batch has ratio 1
    assert logs[0]["val/ratio"] == pytest.approx(1.0, abs=1e-5)


def test_value_loss_falls_on_a_fixed_batch(tmp_path):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xyz"] * 4})
    args = _args(tmp_path, max_steps=16, num_ppo_epochs=16, num_mini_batches=1, gradient_accumulation_steps=1,
                 per_device_train_batch_size=8, critic_warmup_steps=16, cliprange_value=100.0,
                 lr_scheduler_type="constant")  # the critic follows the run's schedule (a linear decay by default)
    # a reward with a spread on any sample (count_a is 0 on a batch without an "a": nothing to fit)
    trainer = PPOTrainer(args=args, processing_class=tok, model=_policy(tok),
                         reward_model=lambda completions, **kw: [1.0 + len(c) for c in completions],
                         train_dataset=ds, value_model=_critic(tok))
    policy0 = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    vf = [h["loss/value_avg"] for h in trainer.state.log_history if "loss/value_avg" in h]
    assert len(vf) == 16 and vf[-1] < 0.5 * vf[0]
    # critic warm-up: the policy did not move
    assert all(torch.equal(p, policy0[n]) for n, p in trainer.model.named_parameters())


def test_critic_free_estimator_and_text_prompts(tmp_path):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": "abc"}], [{"role": "user", "content": "b"}]] * 4})
    args = _args(tmp_path, advantage_estimator="rloo", num_generations=4, max_steps=2, kl_coef=0.0)
    trainer = PPOTrainer(args=args, processing_class=tok, model=_policy(tok), reward_model=count_a, train_dataset=ds)
    assert trainer.critic is None and trainer.ref_model is None
    trainer.train()
    assert "loss/value_avg" not in trainer.state.log_history[0]


def test_bad_inputs(tmp_path):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc"] * 8})
    with pytest.raises(ValueError, match="needs a value_model"):
        PPOTrainer(args=_args(tmp_path), processing_class=tok, model=_policy(tok), reward_model=count_a,
                   train_dataset=ds)
    with pytest.raises(ValueError, match=r"response_length \(max_completion_length\) must be an int >= 1, got 0"):
        _args(tmp_path, response_length=0)
    from transformers import LlamaConfig, LlamaForSequenceClassification

    other = LlamaForSequenceClassification(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=4, vocab_size=len(tok) + 7,
                                                       num_labels=1, pad_token_id=0))
    with pytest.raises(ValueError, match=r"value_model vocabulary \(\d+\) differs from the policy's"):
        PPOTrainer(args=_args(tmp_path), processing_class=tok, model=_policy(tok), reward_model=count_a,
                   train_dataset=ds, value_model=other)

    def nan_reward(completions, **kwargs):
        return [float("nan")] * len(completions)

    trainer = PPOTrainer(args=_args(tmp_path), processing_class=tok, model=_policy(tok), reward_model=nan_reward,
                         train_dataset=ds, value_model=_critic(tok))
    with pytest.raises(ValueError, match="nan_reward"):
        trainer.train()


def test_explained_variance():
    mask = torch.tensor([[1, 1, 0]])
    ret = torch.tensor([[1.0, 3.0, 9.0]])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 2.0), ret, mask) == pytest.approx(0.0)


@pytest.mark.slow
def test_resume_restores_policy_and_critic(tmp_path):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 4})

    def run(resume=None):
        args = _args(tmp_path, max_steps=8, save_strategy="steps", save_steps=4, seed=3)
        trainer = PPOTrainer(args=args, processing_class=tok, model=_policy(tok), reward_model=count_a,
                             train_dataset=ds, value_model=_critic(tok))
        trainer.train(resume_from_checkpoint=resume)
        return {h["step"]: (h["loss"], h["loss/value_avg"]) for h in trainer.state.log_history if "loss" in h}

    full = run()
    assert (tmp_path / "checkpoint-4" / "critic" / "model.safetensors").exists()
    resumed = run(str(tmp_path / "checkpoint-4"))
    for step in range(5, 9):  # a round = 2 epochs x 2 mini-batches: checkpoint-4 is a round boundary
        assert resumed[step] == pytest.approx(full[step], rel=1e-4, abs=1e-6)


def test_remax_runs_a_greedy_baseline(tmp_path):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "b"] * 4})
    calls = []

    def counting(completions, **kwargs):
        calls.append(len(completions))
        return count_a(completions)

    args = _args(tmp_path, advantage_estimator="remax", max_steps=1, kl_coef=0.0)
    trainer = PPOTrainer(args=args, processing_class=tok, model=_policy(tok), reward_model=counting, train_dataset=ds)
    trainer.train()
    assert calls == [8, 2]  # 8 sampled completions, then one greedy completion per distinct prompt


def test_async_rollout_with_a_critic(tmp_path):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 4})
    trainer = PPOTrainer(args=_args(tmp_path, max_steps=8, use_async_rollout=True), processing_class=tok,
                         model=_policy(tok), reward_model=count_a, train_dataset=ds, value_model=_critic(tok))
    trainer.train()
    stale = [h["rollout/staleness"] for h in trainer.state.log_history if "rollout/staleness" in h]
    assert stale == [0.0, 1.0]  # 8 steps = 2 rounds of 2 epochs x 2 mini-batches
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


def test_ppo_config_takes_output_dir_positionally():
    """TrainingArguments' first positional argument is output_dir; the mixins' fields must not come first."""
    from hf_verl import PPOConfig

    args = PPOConfig("some_dir", report_to=[], use_cpu=True)
    assert args.output_dir == "some_dir"
