"""The two front-ends run one pipeline: the facade's hand-written loop and the TRL-style trainers give
the same losses on the same model, data and seed.

Both sample with per-row seeds (so the rollouts are the same), see the same prompts in the same order
(the trainer's dataset unshuffled, the facade given those batches), and take one optimizer step per
rollout with the same AdamW, learning rate and clipping. The one difference left is that the facade
always recomputes old log-probs, where GRPOTrainer, on policy, takes the ratio as exactly 1: the
losses agree to float noise.
"""

import copy

import pytest
import torch
from datasets import Dataset

from tests.conftest import build_char_tokenizer

PROMPTS = ["abc", "xyz", "hello", "ab", "b", "cc", "aaa", "ba"]


def tiny_qwen2(tok, cls="Qwen2ForCausalLM", seed=0, **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                   eos_token_id=tok.eos_token_id, **kw)
    return getattr(transformers, cls)(cfg)


def count_a(completions, **kwargs):
    return [float(c.count("a")) + 0.1 * len(c) for c in completions]


def common(tmp_path, rows):
    return dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                per_device_train_batch_size=rows, gradient_accumulation_steps=1, learning_rate=1e-3,
                lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True, seed=11,
                # unshuffled: the facade is handed the trainer's batches in dataset order (not a layout comparison)
                gradient_checkpointing=False, per_row_sampling_seed=True, shuffle_dataset=False)


def facade_losses(trainer, batches):
    out = []
    for batch in batches:
        loss = trainer.compute_loss(trainer.rollout(batch))
        out.append(loss.item())
        trainer.step(loss)
    return out


def test_facade_loop_equals_grpo_trainer(tmp_path):
    from hf_verl import GRPOConfig, GRPOTrainer, Trainer

    tok = build_char_tokenizer()
    model = tiny_qwen2(tok)
    args = GRPOConfig(num_generations=4, max_completion_length=6, beta=0.05, **common(tmp_path, 8))
    grpo = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=count_a, args=args,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)
    grpo.train()
    want = [h["loss"] for h in grpo.state.log_history if "loss" in h]

    facade = Trainer(actor_model=copy.deepcopy(model), reference_model=copy.deepcopy(model), reward_model=count_a,
                     tokenizer=tok, config=dict(num_generations=4, max_completion_length=6, beta=0.05,
                                                learning_rate=1e-3, seed=11, per_row_sampling_seed=True))
    got = facade_losses(facade, [PROMPTS[2 * i : 2 * i + 2] for i in range(3)])
    assert len(want) == 3 and len(set(round(x, 6) for x in want)) == 3  # three different steps
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    trained = dict(grpo.actor.model.named_parameters())
    # and the same weights after 3 steps. The losses differ by float noise (the facade recomputes old log-probs),
    # and AdamW turns noise on an element whose gradient is near 0 into up to a learning-rate-sized step, so
    # a few elements may differ by a fraction of lr = 1e-3; everything else within 1e-5.
    for name, p in facade.model.named_parameters():
        diff = (p - trained[name]).abs()
        assert diff.max() < 1e-4, name
        assert (diff > 1e-5 + 1e-4 * trained[name].abs()).float().mean() < 1e-3, name


def test_facade_with_a_critic_equals_ppo_trainer(tmp_path):
    from hf_verl import PPOConfig, PPOTrainer, Trainer

    tok = build_char_tokenizer()
    model = tiny_qwen2(tok)
    critic = tiny_qwen2(tok, "Qwen2ForSequenceClassification", seed=1, num_labels=1)
    args = PPOConfig(num_mini_batches=1, num_ppo_epochs=1, response_length=6, stop_token="eos", kl_coef=0.0,
                     temperature=1.0, critic_learning_rate=2e-3, vf_coef=0.1, **common(tmp_path, 4))
    ppo = PPOTrainer(args=args, processing_class=tok, model=copy.deepcopy(model), reward_model=count_a,
                     train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}), value_model=copy.deepcopy(critic))
    ppo.train()
    want = [h["loss"] for h in ppo.state.log_history if "loss" in h]
    want_value = [h["loss/value_avg"] for h in ppo.state.log_history if "loss/value_avg" in h]

    facade = Trainer(actor_model=copy.deepcopy(model), critic_model=copy.deepcopy(critic), reward_model=count_a,
                     tokenizer=tok, config=dict(num_generations=1, max_completion_length=6, learning_rate=1e-3,
                                                critic_learning_rate=2e-3, vf_coef=0.1, seed=11,
                                                per_row_sampling_seed=True))
    values = []
    got = []
    for i in range(3):
        loss = facade.compute_loss(facade.rollout((PROMPTS * 2)[4 * i : 4 * i + 4]))
        got.append(loss.item())
        values.append(facade._loss_metrics["loss/value"])
        facade.step(loss)
    assert len(want) == 3
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert values == pytest.approx(want_value, rel=1e-5, abs=1e-6)
