"""GRPOTrainer end to end on a tiny model: parameters change, losses finite, metrics logged."""

import threading

import pytest
import torch
from datasets import Dataset

from hf_verl.trainers.grpo_config import GRPOConfig
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer


def _model(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
    return Qwen2ForCausalLM(cfg)


def count_a(completions, **kwargs):
    return [float(c.count("a")) if isinstance(c, str) else float(c[-1]["content"].count("a"))
            for c in completions]


def text_reward(completions, **kwargs):
    """A reward that varies with any change of text: count_a is 0 on a whole round now and then (no 'a' drawn),
    and a round of equal rewards has zero advantages: nothing trains, the loss is exactly 0."""
    return [float(sum(map(ord, c if isinstance(c, str) else c[-1]["content"])) % 5) for c in completions]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                learning_rate=1e-2, gradient_checkpointing=False, save_strategy="no")
    base.update(kw)
    return GRPOConfig(**base)


@pytest.mark.parametrize("conversational, beta", [(False, 0.0), (True, 0.1)])
def test_grpo_trains_every_parameter(tmp_path, conversational, beta):
    tok = build_char_tokenizer()
    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompts = ["abc", "xyz", "hello", "ab"] * 2
    if conversational:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    ds = Dataset.from_dict({"prompt": prompts})
    trainer = GRPOTrainer(model=model, reward_funcs=count_a, args=_args(tmp_path, beta=beta),
                          train_dataset=ds, processing_class=tok)
    assert (trainer.ref_model is not None) == (beta > 0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    for key in ("reward", "reward_std", "rewards/count_a/mean", "frac_reward_zero_std",
                "completions/mean_length", "entropy", "timing_s/generate", "perf/tokens_per_second"):
        assert key in logs[0], key
    if beta > 0:
        assert "kl" in logs[0]
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged


def test_missing_prompt_column_is_named(tmp_path):
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"no 'prompt' column; columns present: \['question'\]"):
        GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(tmp_path),
                    train_dataset=Dataset.from_dict({"question": ["a"]}), processing_class=tok)


def test_grpo_with_lora_uses_disabled_adapters_as_reference(tmp_path):
    from peft import LoraConfig

    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xyz"] * 4})
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(tmp_path, beta=0.1, max_steps=2),
                          train_dataset=ds, processing_class=tok,
                          peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert trainer.ref_model is None
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert lora and all("lora" in n for n in lora)
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if n in lora and not torch.equal(p, lora[n])]
    assert any("lora_B" in n for n in changed)
    assert "kl" in [h for h in trainer.state.log_history if "loss" in h][0]


@pytest.mark.parametrize("kw, match", [({"num_generations": 4, "per_device_train_batch_size": 6},
                                        "not divisible by num_generations=4"),
                                       ({"num_generations": 2, "per_device_train_batch_size": 4},
                                        "has 1 prompts but one generation round needs 2")])
def test_unsupported_layouts_are_refused(tmp_path, kw, match):
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match=match):
        GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(tmp_path, **kw),
                    train_dataset=Dataset.from_dict({"prompt": ["a"]}), processing_class=tok)


@pytest.mark.slow
def test_resume_logs_the_same_losses(tmp_path):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 4})

    def losses(trainer):
        return {h["step"]: (h["loss"], h["entropy"]) for h in trainer.state.log_history if "loss" in h}

    # beta > 0: with ratio 1 and equal completion lengths the policy term alone is exactly 0 on every step
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, seed=7, beta=0.05)
    full = GRPOTrainer(model=_model(tok), reward_funcs=text_reward, args=_args(tmp_path / "a", **kw),
                       train_dataset=ds, processing_class=tok)
    full.train()
    resumed = GRPOTrainer(model=_model(tok), reward_funcs=text_reward, args=_args(tmp_path / "a", **kw),
                          train_dataset=ds, processing_class=tok)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    want, got = losses(full), losses(resumed)
    assert sorted(got) == [1, 2, 3, 4]  # 1-2 restored from the checkpoint, 3-4 recomputed
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7)
    assert got[3][0] != got[4][0] and got[3][1] != got[4][1]


def test_generation_round_is_reused_with_exact_old_logprobs(tmp_path):
    """steps_per_generation=2 x num_iterations=2: one rollout feeds 4 micro-steps (2 optimizer
    steps), and the recorded old log-probs are the generating policy's (= the engine's)."""
    tok = build_char_tokenizer()
    calls = []

    def counting(completions, **kwargs):
        calls.append(len(completions))
        return count_a(completions)

    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2})
    args = _args(tmp_path, max_steps=5, steps_per_generation=2, num_iterations=2, learning_rate=1e-2)
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=counting, args=args, train_dataset=ds,
                          processing_class=tok)
    assert args.generation_batch_size == 8
    trainer.train()
    # a round feeds 2 x 2 = 4 micro-steps (here 4 optimizer steps); step 5 starts a second round
    assert calls == [8, 8]
    mbs = trainer._buffer
    assert len(mbs) == 2 and all(mb.batch_size == 4 for mb in mbs)
    for mb in mbs:
        m = mb.completion_mask.bool()
        assert mb.old_logprobs is not None
        assert torch.allclose(mb.old_logprobs[m], mb.sampling_logprobs[m], atol=1e-4)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 5 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


def test_one_step_rounds_need_no_old_logprobs(tmp_path):
    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xyz"] * 4})
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(tmp_path, max_steps=1),
                          train_dataset=ds, processing_class=tok)
    trainer.train()
    assert trainer._buffer[0].old_logprobs is None  # ratio is 1 by construction: no extra forward


def test_bad_reward_mid_run_saves_a_resumable_checkpoint(tmp_path):
    tok = build_char_tokenizer()
    calls = []

    def flaky(completions, **kwargs):
        calls.append(1)
        return [float("nan")] * len(completions) if len(calls) == 3 else count_a(completions)

    ds = Dataset.from_dict({"prompt": ["abc", "xyz"] * 4})
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=flaky, args=_args(tmp_path, max_steps=5),
                          train_dataset=ds, processing_class=tok)
    with pytest.raises(ValueError, match=r"(?si)flaky.*nan.*checkpoint of step 2 was saved"):
        trainer.train()
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "trainer_state.json").exists()
    resumed = GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(tmp_path, max_steps=3),
                          train_dataset=ds, processing_class=tok)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 3


@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_critic_free_estimators_train(tmp_path, estimator):
    tok = build_char_tokenizer()
    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2})
    trainer = GRPOTrainer(model=model, reward_funcs=count_a, args=_args(tmp_path, advantage_estimator=estimator,
                                                                         max_steps=2), train_dataset=ds,
                          processing_class=tok)
    trainer.train()
    (mb,) = trainer._buffer
    assert mb.advantages.shape == mb.completion_ids.shape  # token-level
    assert torch.all(mb.advantages[mb.completion_mask == 0] == 0)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_remax_baseline_is_the_greedy_score(tmp_path):
    from hf_verl.rollout.base import SamplingParams

    tok = build_char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2})
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(
        tmp_path, advantage_estimator="remax", max_steps=1, learning_rate=0.0, temperature=1.5),
        train_dataset=ds, processing_class=tok)
    trainer.train()
    (mb,) = trainer._buffer
    greedy = trainer.engine.generate(mb.meta["prompt_ids"], SamplingParams(max_new_tokens=6, temperature=0.0))
    baseline = torch.tensor(count_a(tok.batch_decode(greedy.completion_ids, skip_special_tokens=True)))
    first = mb.advantages[:, 0]
    assert torch.allclose(first, mb.rewards - baseline)


def test_gae_is_refused_without_a_critic(tmp_path):
    with pytest.raises(ValueError, match="'gae' needs a critic: use PPOTrainer"):
        _args(tmp_path, advantage_estimator="gae")


def test_evaluation_reports_rewards(tmp_path):
    tok = build_char_tokenizer()

    def one(completions, **kwargs):
        return [1.0] * len(completions)

    def none_for_b(prompts, completions, **kwargs):
        return [None if p.startswith("b") else 2.0 for p in prompts]

    train = Dataset.from_dict({"prompt": ["abc", "xyz"] * 4})
    evals = Dataset.from_dict({"prompt": ["abc", "bcd", "cde"]})
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=[one, none_for_b], train_dataset=train, eval_dataset=evals,
                          args=_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1,
                                     per_device_eval_batch_size=2, num_generations_eval=2), processing_class=tok)
    trainer.train()
    evals_logged = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals_logged] == [1, 2]
    m = trainer.evaluate()
    assert m["eval_rewards/one/mean"] == 1.0 and m["eval_rewards/none_for_b/mean"] == 2.0  # None skipped
    assert m["eval_reward"] == pytest.approx((3 + 2 * 2) / 3)  # weighted sum per row, None counts 0
    assert 1 <= m["eval_completions/mean_length"] <= 6


@pytest.mark.parametrize("steps_per_generation", [1, 2])
def test_async_rollout_is_one_version_stale_and_trains(tmp_path, steps_per_generation, caplog):
    tok = build_char_tokenizer()
    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = []

    def counting(prompts, completions, **kwargs):
        seen.append(list(prompts))
        return text_reward(completions)  # the generating thread's draws are not reproducible

    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab", "b", "cc", "dd", "e"]})
    args = _args(tmp_path, max_steps=4, use_async_rollout=True, steps_per_generation=steps_per_generation,
                 gradient_accumulation_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=counting, args=args, train_dataset=ds, processing_class=tok)
    with caplog.at_level("INFO"):
        trainer.train()
    assert "does not match this round's rows" not in caplog.text  # prefetched rows = dataloader rows
    logs = [h for h in trainer.state.log_history if "loss" in h]
    rounds = 4 // steps_per_generation
    assert len(seen) == rounds  # round 0 synchronously, then one prefetch per following round, none beyond
    stale = [h["rollout/staleness"] for h in logs if "rollout/staleness" in h]
    assert stale[0] == 0 and all(s == 1 for s in stale[1:]) and len(stale) == rounds
    assert all("sampling/importance_sampling_ratio/mean" in h for h in logs if "rollout/staleness" in h)
    assert "generating on a copy of the actor" in caplog.text  # not on the weights the optimizer steps
    assert trainer._async_engine is None  # the copy is freed when train() ends
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_max_staleness_zero_rolls_out_synchronously(tmp_path, caplog):
    """As in the facade (one schema): `max_staleness=0` with `use_async_rollout` generates every round with the
    current weights, on the main thread, with no actor copy."""
    tok = build_char_tokenizer()
    threads = []

    def counting(prompts, completions, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        return text_reward(completions)

    args = _args(tmp_path, max_steps=2, use_async_rollout=True, max_staleness=0, gradient_accumulation_steps=1)
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=counting, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2}))
    with caplog.at_level("INFO"):
        trainer.train()
    assert threads == [True, True] and "generating on a copy of the actor" not in caplog.text
    assert not any("rollout/staleness" in h for h in trainer.state.log_history)


def test_a_round_with_every_completion_masked_out_trains_on_with_zero_loss(tmp_path):
    """mask_truncated_completions with every completion truncated leaves no token in the loss: the step
    runs (zero loss, zero gradient, logged) instead of failing in backward."""
    tok = build_char_tokenizer()
    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, reward_funcs=count_a, processing_class=tok,
                          args=_args(tmp_path, max_steps=2, mask_truncated_completions=True, max_completion_length=3),
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
    trainer.engine.eos_token_ids = set()  # never stops: every completion is truncated
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["loss"] == 0.0 and h["completions/clipped_ratio"] == 1.0 for h in logs)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing to learn from


def test_a_round_where_every_reward_is_none_trains_on_with_zero_advantages(tmp_path, caplog):
    tok = build_char_tokenizer()

    def abstain(completions, **kwargs):
        return [None] * len(completions)

    trainer = GRPOTrainer(model=_model(tok), reward_funcs=abstain, processing_class=tok, args=_args(tmp_path, max_steps=2),
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
    with caplog.at_level("WARNING"):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["loss"] == 0.0 and h["reward"] == 0.0 for h in logs)
    assert "All reward functions returned None for the following kwargs" in caplog.text  # TRL's warning


# ---------------------------------------------------------------------- TRL's API on the trainer
def _trainer(tmp_path, reward_funcs=count_a, **kw):
    tok = build_char_tokenizer()
    ds = kw.pop("train_dataset", Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
    return GRPOTrainer(model=_model(tok), reward_funcs=reward_funcs, processing_class=tok, train_dataset=ds,
                       args=_args(tmp_path, **kw))


def test_high_entropy_and_off_policy_masks_are_trls(tmp_path):
    trainer = _trainer(tmp_path)
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    # the 0.8-quantile of the 10 unmasked entropies (0.1 .. 1.0) is 0.82: 0.9 and 1.0 stay
    assert trainer.get_high_entropy_mask(entropies, mask, 0.8).nonzero().tolist() == [[1, 2], [1, 3]]
    assert torch.equal(trainer.get_high_entropy_mask(entropies, mask, 0.0), mask.bool())
    assert not trainer.get_high_entropy_mask(entropies, torch.zeros_like(mask), 0.5).any()
    logp = torch.zeros(3, 4)
    logp[0], logp[1], logp[2] = -2.0, -0.5, -2.0  # mean KL from the sampler (logp 0): 2, 0.5, 2
    keep = GRPOTrainer.get_off_policy_mask(torch.tensor([[1.0], [-1.0], [-1.0]]), logp, torch.zeros(3, 4),
                                           torch.ones(3, 4), 1.0)
    assert keep.tolist() == [[1.0], [1.0], [0.0]]  # dropped: negative advantage and KL above the threshold


def test_reward_attributes_and_processing_classes_follow_trl(tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = build_char_tokenizer()
    rm = Qwen2ForSequenceClassification(Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, num_key_value_heads=1,
                                                    vocab_size=len(tok), num_labels=1, pad_token_id=tok.pad_token_id))
    ds = Dataset.from_dict({"prompt": ["abc", "xyz"] * 4})
    with pytest.raises(ValueError, match=r"reward processing classes \(1\) must match the number of reward functions"):
        GRPOTrainer(model=_model(tok), reward_funcs=[rm, count_a], reward_processing_classes=tok,
                    processing_class=tok, train_dataset=ds, args=_args(tmp_path))
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=[count_a, rm], reward_processing_classes=[None, tok],
                          processing_class=tok, train_dataset=ds, args=_args(tmp_path, reward_weights=[0.5, 2.0]))
    assert trainer.reward_processing_classes == [None, tok]
    assert trainer.reward_func_names[0] == "count_a"
    assert trainer.reward_weights.tolist() == [0.5, 2.0]
    assert {"trl", "grpo"} <= set(trainer.model.model_tags)  # TRL's Hub tags, for the model card


def test_a_model_id_loads_in_float32_unless_asked(tmp_path):
    tok = build_char_tokenizer()
    path = tmp_path / "policy"
    _model(tok).to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    ds = Dataset.from_dict({"prompt": ["abc", "xyz"] * 4})
    trainer = GRPOTrainer(model=str(path), reward_funcs=count_a, train_dataset=ds, args=_args(tmp_path / "a"))
    assert trainer.model.dtype == torch.float32  # TRL's default, whatever the checkpoint holds
    trainer = GRPOTrainer(model=str(path), reward_funcs=count_a, train_dataset=ds,
                          args=_args(tmp_path / "b", model_init_kwargs={"dtype": "auto"}))
    assert trainer.model.dtype == torch.bfloat16


def test_a_train_dataset_is_required_without_an_environment(tmp_path):
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="`train_dataset` is required unless an `environment_factory`"):
        GRPOTrainer(model=_model(tok), reward_funcs=count_a, processing_class=tok, args=_args(tmp_path))


def test_reward_functions_get_trainer_state_log_metric_and_log_extra(tmp_path):
    steps = []

    def shaped(completions, trainer_state, log_metric, log_extra, **kwargs):
        steps.append(trainer_state.global_step)
        log_metric("custom/accuracy", 0.75)
        log_extra("first_chars", [c[:2] for c in completions])
        return count_a(completions)

    def plain(prompts, completions, completion_ids):  # no **kwargs: gets none of the extra keywords
        return [0.0] * len(completions)

    trainer = _trainer(tmp_path, reward_funcs=[shaped, plain], max_steps=2, log_completions=True)
    trainer.train()
    assert steps == [0, 1]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["custom/accuracy"] == 0.75 for h in logs)
    rows = trainer.completion_log.rows
    assert len(rows) == 4 and all(r["first_chars"] == r["completion"][:2] for r in rows)
    assert list(trainer.completion_log.extra_columns) == ["first_chars"]
    assert trainer._logs["extra"]["first_chars"] == [r["first_chars"] for r in rows]  # TRL's view of the table


def test_evaluation_reports_the_loss_and_reads_iterable_datasets(tmp_path):
    evals = Dataset.from_dict({"prompt": ["abc", "bcd", "cde"]})
    trainer = _trainer(tmp_path, per_device_eval_batch_size=4, num_generations_eval=2)
    m = trainer.evaluate(evals)
    assert torch.isfinite(torch.tensor(m["eval_loss"]))
    streamed = trainer.evaluate(evals.to_iterable_dataset())  # no length: read once as a stream
    assert streamed["eval_reward"] == pytest.approx(m["eval_reward"], abs=6.0) and "eval_loss" in streamed
    both = trainer.evaluate({"a": evals, "b": evals.to_iterable_dataset()})
    assert {"eval_a_loss", "eval_b_loss", "eval_a_reward", "eval_b_reward"} <= set(both)
    trainer.args.dataloader_num_workers = 2
    assert trainer.get_eval_dataloader(evals.to_iterable_dataset()).num_workers == 0  # a stream: one reader
    assert trainer.get_eval_dataloader(evals).num_workers == 2 and trainer.args.dataloader_num_workers == 2


def test_config_takes_output_dir_first(tmp_path):
    assert GRPOConfig(str(tmp_path), report_to="none").output_dir == str(tmp_path)  # as TrainingArguments


def test_an_iterable_train_dataset_trains_in_whole_groups(tmp_path):
    import pickle

    seen = []

    def groups(prompts, completions, **kwargs):
        seen.append(list(prompts))
        return count_a(completions)

    stream = Dataset.from_dict({"prompt": ["abc", "xyz", "ab", "b"] * 2}).to_iterable_dataset()
    trainer = _trainer(tmp_path, reward_funcs=groups, train_dataset=stream, max_steps=3, dataloader_num_workers=2,
                       shuffle_dataset=False)
    assert trainer.args.accelerator_config.dispatch_batches is False and trainer.args.dataloader_num_workers == 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert seen[:2] == [["abc"] * 4, ["xyz"] * 4]  # one prompt per round of 4, groups kept whole, in order
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    pickle.dumps(trainer.data_collator)  # dataloader workers (spawn) need a picklable collator
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        _trainer(tmp_path, train_dataset=stream, accelerator_config={"dispatch_batches": True})


def test_a_model_with_its_own_generate_decodes_with_it(tmp_path):
    """The lean decode loop reimplements transformers' generate only: a generate set on the model (custom code,
    a patch) is called, and bare ids it returns are scored by a teacher-forced forward."""
    from unittest.mock import patch

    trainer = _trainer(tmp_path, max_steps=1, max_completion_length=4)
    tok = trainer.processing_class
    fixed = tok("aaa", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def fake_generate(input_ids, **kwargs):
        return torch.cat([input_ids, torch.tensor([fixed] * input_ids.shape[0])], dim=-1)

    with patch.object(trainer.model, "generate", side_effect=fake_generate) as mock:
        trainer.train()
    assert mock.called
    log = [h for h in trainer.state.log_history if "loss" in h][0]
    assert log["rewards/count_a/mean"] == 3.0 and log["completions/mean_length"] == 4.0
    from hf_verl.rollout.base import SamplingParams

    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        scored = trainer.engine.generate([tok("abc")["input_ids"]], SamplingParams(max_new_tokens=4, temperature=0.7))
    ids = torch.tensor([tok("abc")["input_ids"] + fixed])
    with torch.no_grad():
        ref = torch.log_softmax(trainer.model(ids).logits[0, -5:-1] / 0.7, -1).gather(-1, ids[0, -4:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(scored.logprobs[0]), ref, rtol=1e-4, atol=1e-5)


def test_a_hybrid_cache_that_cannot_repeat_rows_is_prefilled_per_row(char_tokenizer):
    """Hybrid Mamba / attention models (NemotronH) have cache layers without `batch_select_indices`: the
    one-prefill-per-distinct-prompt shortcut steps aside and decoding matches `generate`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_verl.rollout.base import SamplingParams
    from hf_verl.rollout.hf_engine import TransformersEngine

    tok = char_tokenizer
    cfg = AutoConfig.for_model(
        "nemotron_h", vocab_size=len(tok), hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        layers_block_type=["mamba", "attention", "moe"], num_hidden_layers=3, mamba_num_heads=8, mamba_head_dim=4,
        mamba_n_groups=1, ssm_state_size=16, mamba_d_conv=4, mamba_expand=2, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    prompts = [tok("abc")["input_ids"]] * 2 + [tok("xy")["input_ids"]] * 2  # repeated prompts, as in GRPO groups
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    engine = TransformersEngine(model, tok)
    lean = engine.generate(prompts, greedy)
    assert not engine._dedup_prefill
    assert lean.completion_ids == TransformersEngine(model, tok, use_generate=True).generate(prompts, greedy).completion_ids


def test_an_environment_can_own_the_data(tmp_path):
    """TRL: without a train_dataset the environment's reset() returns the prompt; max_steps sets the length, and
    the checks on data come before any other."""
    from tests.test_grpo_tools import _args as tool_args
    from tests.test_grpo_tools import _bigram_llama
    from tests.test_grpo_tools import _tokenizer as hermes_tokenizer

    class Quiz:
        def reset(self, **row):
            assert "prompt" in row  # the placeholder row: an empty user message
            return "what is 2+3? (use the add tool)"

        def add(self, a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first integer
                b: the second integer
            """
            return a + b

    seen = []

    def answered(prompts, completions, **kwargs):
        seen.extend(p[-1]["content"] for p in prompts)
        return [float(any(m["role"] == "tool" for m in c)) for c in completions]

    tok = hermes_tokenizer()
    with pytest.raises(ValueError, match="`max_steps` must be set"):
        GRPOTrainer(model=_bigram_llama(tok), reward_funcs=answered, processing_class=tok, environment_factory=Quiz,
                    args=tool_args(tmp_path, max_steps=-1))
    with pytest.raises(ValueError, match="requires a `train_dataset` with an `environment` column"):
        GRPOTrainer(model=_bigram_llama(tok), reward_funcs=answered, processing_class=tok,
                    environment_factory={"a": Quiz, "b": Quiz}, args=tool_args(tmp_path))
    trainer = GRPOTrainer(model=_bigram_llama(tok), reward_funcs=answered, processing_class=tok,
                          environment_factory=Quiz, args=tool_args(tmp_path, max_steps=2))
    assert [t.__name__ for t in trainer.tools] == ["add"]  # TRL's attribute: the environment's methods
    trainer.train()
    assert len(seen) == 16 and set(seen) == {"what is 2+3? (use the add tool)"}
    assert all(h["tools/call_frequency"] > 0 for h in trainer.state.log_history if "loss" in h)


def test_entropy_coef_is_the_coefficient_in_force(tmp_path):
    assert _trainer(tmp_path, entropy_coef=0.2).entropy_coef == 0.2
    trainer = _trainer(tmp_path, max_steps=2, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=100.0,
                       entropy_coef_delta=0.005)
    trainer.train()
    assert trainer.entropy_coef == pytest.approx(0.01 + 2 * 0.005)  # raised once per optimizer step


def test_round_metrics_follow_trl(tmp_path):
    """TRL's length metrics (over the completions as generated, before mask_truncated_completions) and tokens
    seen; every EOS id the model declares (generation_config) ends a completion, as in TRL and vLLM."""
    from hf_verl.rollout.base import SamplingParams
    from hf_verl.rollout.hf_engine import TransformersEngine

    trainer = _trainer(tmp_path, max_steps=1, mask_truncated_completions=True, max_completion_length=3)
    tok = trainer.processing_class
    prompt = tok("abc")["input_ids"]
    first = trainer.engine.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0.0)).completion_ids[0][0]
    trainer.model.generation_config.eos_token_id = [tok.eos_token_id, first]
    engine = TransformersEngine(trainer.model, tok)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert out.completion_ids == [[first]] and out.finish_reasons == ["stop"]
    trainer.train()
    log = [h for h in trainer.state.log_history if "loss" in h][0]
    assert 1 <= log["completions/min_length"] <= log["completions/mean_length"] <= log["completions/max_length"] <= 3
    assert 0 <= log["completions/mean_terminated_length"] <= 3 and 0 <= log["completions/clipped_ratio"] <= 1
    assert log["num_tokens"] == trainer.state.num_input_tokens_seen > 0


def test_transformers_generation_kwargs_reach_generate(tmp_path):
    """TRL passes generation_kwargs to transformers' GenerationConfig: fields beyond the sampling settings (here
    beam sampling) go to model.generate, whose completions are then scored by a teacher-forced forward."""
    from unittest.mock import patch

    from transformers import GenerationMixin

    trainer = _trainer(tmp_path, max_steps=1, generation_kwargs={"do_sample": True, "top_k": 5, "num_beams": 2,
                                                                  "length_penalty": -0.1})
    assert trainer._sampling_params().top_k == 5
    with patch.object(GenerationMixin, "generate", autospec=True, side_effect=GenerationMixin.generate) as gen:
        trainer.train()
    assert gen.called and gen.call_args.kwargs["num_beams"] == 2 and gen.call_args.kwargs["length_penalty"] == -0.1
    log = [h for h in trainer.state.log_history if "loss" in h][0]
    assert torch.isfinite(torch.tensor(log["loss"])) and log["completions/mean_length"] >= 1


def test_a_lora_adapter_on_the_lm_head_trains(tmp_path):
    """Without Liger, hf_verl computes the log-probs through the head module, so an adapter on lm_head trains like
    any other (TRL refuses it only with use_liger_kernel=True, as hf_verl does: see the next test)."""
    from peft import LoraConfig

    tok = build_char_tokenizer()
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=count_a, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}),
                          args=_args(tmp_path, max_steps=2, learning_rate=0.05),
                          peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    head = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lm_head.lora_B" in n}
    assert head
    trainer.train()
    assert all(not torch.equal(p, head[n]) for n, p in trainer.model.named_parameters() if n in head)


def test_liger_with_an_lm_head_adapter_is_refused_and_modules_to_save_is_not(tmp_path):
    from peft import LoraConfig

    tok = build_char_tokenizer()
    kw = dict(reward_funcs=count_a, processing_class=tok, train_dataset=Dataset.from_dict({"prompt": ["abc"] * 8}),
              args=_args(tmp_path, use_liger_kernel=True))
    with pytest.raises(ValueError, match="use_liger_kernel=True with a PEFT adapter on lm_head.*modules_to_save"):
        GRPOTrainer(model=_model(tok), peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), **kw)
    # a whole trained copy of the head (modules_to_save) passes the guard; what stops it where liger-kernel is not
    # installed is the package check, at construction (as in TRL), not at train()
    from transformers.utils import is_liger_kernel_available

    if is_liger_kernel_available():
        GRPOTrainer(model=_model(tok), peft_config=LoraConfig(r=4, target_modules=["q_proj"],
                                                              modules_to_save=["lm_head"]), **kw)
    else:
        with pytest.raises(ImportError, match="use_liger_kernel=True needs liger-kernel"):
            GRPOTrainer(model=_model(tok), peft_config=LoraConfig(r=4, target_modules=["q_proj"],
                                                                  modules_to_save=["lm_head"]), **kw)


def test_the_trainers_answer_supported_parallelisms_from_the_facades_checks(tmp_path):
    """docs/megatron.md's `trainer.supported_parallelisms()` on a GRPOTrainer (EngineTrainerMixin, the base of the
    three trainers): the same list and reasons as hf_verl.planner.capabilities, which the facade answers too."""
    from hf_verl.planner.capabilities import PARALLELISMS, parallelism_report, supported_parallelisms

    tok = build_char_tokenizer()
    trainer = GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(tmp_path, max_steps=1),
                          train_dataset=Dataset.from_dict({"prompt": ["abc"] * 8}), processing_class=tok)
    assert trainer.supported_parallelisms() == supported_parallelisms()
    reasons = trainer.supported_parallelisms(reasons=True)
    assert list(reasons) == list(PARALLELISMS)  # a reason for every parallelism, in the report's order
    assert reasons == {name: a.reason for name, a in parallelism_report().items()}
    assert all(isinstance(r, str) and r for r in reasons.values())
    if not torch.cuda.is_available():
        assert "data" in trainer.supported_parallelisms() and reasons["data"] == "CPU processes over gloo"
