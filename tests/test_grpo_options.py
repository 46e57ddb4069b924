"""The TRL 1.16 GRPO / DPO options beyond the basics, each through a short real training run: loss forms by
TRL's and verl's names, adaptive entropy, reference mixing, the float32 LM head, a Mixture-of-Experts router
loss, generation_kwargs, pad_to_multiple_of, completion logging, GDPO aggregation and the refusals."""

import json
import os

import pytest
import torch
from datasets import Dataset

from hf_verl.algorithms.advantages import gdpo_advantages
from hf_verl.data.batch import RolloutBatch
from hf_verl.data.preference import TokenizedPair, collate_pairs
from hf_verl.trainers.grpo_config import GRPOConfig
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _args, _model, count_a

PROMPTS = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2})


def _train(tmp_path, model=None, **kw):
    tok = build_char_tokenizer()
    model = model if model is not None else _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, reward_funcs=count_a, args=_args(tmp_path, **kw), train_dataset=PROMPTS,
                          processing_class=tok)
    trainer.train()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return trainer, logs, changed


@pytest.mark.parametrize("kw,metric", [
    ({"loss_type": "cispo", "epsilon_high": 5.0}, "cispo_clip_ratio"),
    ({"loss_type": "sapo"}, None),
    ({"loss_type": "vespo"}, "vespo/phi_seq_mean"),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, "clip_ratio/region_mean"),
    ({"policy_loss": "gspo", "loss_type": "grpo"}, "clip_ratio/region_mean"),
    ({"policy_loss": "geo_mean", "loss_type": "grpo"}, None),
    ({"policy_loss": "gpg", "advantage_estimator": "gpg"}, None),
    ({"advantage_estimator": "opo", "top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.1}, None),
    ({"advantage_estimator": "optimal_token_baseline"}, None),
    ({"advantage_estimator": "gdpo", "policy_loss": "kl_cov"}, None),
])
def test_loss_forms_train(tmp_path, kw, metric):
    _, logs, changed = _train(tmp_path, max_steps=2, num_iterations=2, **kw)
    assert changed and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    if metric:
        assert metric in logs[0]


def test_adaptive_entropy_moves_the_coefficient_and_is_checkpointed(tmp_path):
    trainer, logs, _ = _train(tmp_path, max_steps=3, use_adaptive_entropy=True, entropy_coef=0.01,
                              entropy_coef_delta=0.005, entropy_target=100.0, save_strategy="steps", save_steps=3)
    # entropy (a few nats) is under the target every step: the coefficient rises by delta per step
    assert [round(h["entropy_coef"], 6) for h in logs] == [0.015, 0.02, 0.025]
    with open(os.path.join(tmp_path, "checkpoint-3", "entropy_ctrl_state.json")) as f:
        assert json.load(f)["entropy_coef"] == pytest.approx(0.025)


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path):
    tok = build_char_tokenizer()
    model = _model(tok)
    args = _args(tmp_path, max_steps=1, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1,
                 ref_model_mixup_alpha=0.5)
    trainer = GRPOTrainer(model=model, reward_funcs=count_a, args=args, train_dataset=PROMPTS, processing_class=tok)
    ref_before = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    for (n, r), p in zip(trainer.ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(r, 0.5 * ref_before[n] + 0.5 * p.detach())
    with pytest.raises(ValueError, match="beta > 0"):
        _args(tmp_path, sync_ref_model=True)


def test_fp32_lm_head_on_a_bf16_model(tmp_path):
    tok = build_char_tokenizer()
    model = _model(tok).to(torch.bfloat16)
    trainer, logs, changed = _train(tmp_path, model=model, max_steps=1, cast_lm_head_to_fp32=True)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.norm.weight.dtype == torch.bfloat16
    assert changed and torch.isfinite(torch.tensor(logs[0]["loss"]))


def _moe(tok):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, router_aux_loss_coef=0.01)
    return Qwen2MoeForCausalLM(cfg)


def test_moe_router_aux_loss_is_added_and_a_dense_model_refuses_a_coefficient(tmp_path):
    tok = build_char_tokenizer()
    trainer, logs, _ = _train(tmp_path, model=_moe(tok), max_steps=1)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.01
    assert logs[0]["aux_loss"] > 0
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(tmp_path, router_aux_loss_coef=0.1),
                    train_dataset=PROMPTS, processing_class=tok)


def test_generation_kwargs_override_and_unknown_keys_are_refused(tmp_path):
    trainer, logs, _ = _train(tmp_path, max_steps=1, max_completion_length=6, generation_kwargs={"max_tokens": 2})
    assert trainer._sampling_params().max_new_tokens == 2 and logs[0]["completions/mean_length"] <= 2
    with pytest.raises(ValueError, match="neither sampling settings nor transformers GenerationConfig fields"):
        _args(tmp_path, generation_kwargs={"guidance_scal": 2.0})
    with pytest.raises(ValueError, match="not supported by hf_verl's engines"):  # vLLM: sampling settings only
        _args(tmp_path, generation_kwargs={"num_beams": 2}, use_vllm=True)
    assert _args(tmp_path, generation_kwargs='{"top_k": 3}').generation_kwargs == {"top_k": 3}  # CLI JSON


def test_pad_to_multiple_of_pads_with_masked_positions():
    batch = RolloutBatch.from_lists([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_token_id=0,
                                    sampling_logprobs=[[-1.0, -2.0], [-1.0, -1.0, -1.0]])
    padded = batch.pad_to_multiple(4, 0)
    assert padded.prompt_ids.shape == (2, 4) and padded.completion_ids.shape == (2, 4)
    assert padded.prompt_ids[0].tolist() == [0, 5, 6, 7] and padded.completion_mask[1].tolist() == [1, 1, 1, 0]
    assert padded.num_completion_tokens == batch.num_completion_tokens
    pairs = [TokenizedPair([1, 2], [3], [4, 5])]
    assert collate_pairs(pairs, 0, pad_to_multiple_of=8)["input_ids"].shape == (2, 8)
    packed = collate_pairs(pairs, 0, padding_free=True, pad_to_multiple_of=8)
    assert packed["input_ids"].shape == (1, 8) and packed["seq_index"][0, -1] == -1
    assert GRPOConfig(output_dir="/tmp/x", pad_to_multiple_of="auto").pad_to_multiple_of is None


def test_log_completions_writes_parquet_and_images_are_refused(tmp_path):
    import pandas as pd

    _train(tmp_path, max_steps=2, log_completions=True, num_completions_to_print=2)
    frame = pd.read_parquet(tmp_path / "completions" / "completions_00002.parquet")
    assert list(frame.columns) == ["step", "prompt", "completion", "count_a", "advantage"] and len(frame) == 4
    tok = build_char_tokenizer()
    images = Dataset.from_dict({"prompt": ["a"] * 8, "image": [None] * 8})
    with pytest.raises(ValueError, match="text-only"):
        GRPOTrainer(model=_model(tok), reward_funcs=count_a, args=_args(tmp_path), train_dataset=images,
                    processing_class=tok)


def test_normalize_then_sum_trains_and_matches_gdpo(tmp_path):
    _, logs, changed = _train(tmp_path, max_steps=1, multi_objective_aggregation="normalize_then_sum")
    assert changed
    per_func = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, float("nan")], [1.0, 1.0]])
    adv, _ = gdpo_advantages(per_func, 2)
    # group z-scores per function, summed (NaN ignored), then normalised over the batch
    z = torch.tensor([0.7071 - 0.7071, -0.7071 + 0.7071, 0.7071, -0.7071 + 0.0])
    expected = (z - z.mean()) / (z.std() + 1e-4)
    torch.testing.assert_close(adv, expected, atol=1e-3, rtol=1e-3)


def test_dpo_moe_aux_loss_pad_token_and_padding(tmp_path):
    from hf_verl.trainers.dpo_config import DPOConfig
    from hf_verl.trainers.dpo_trainer import DPOTrainer
    from tests.test_dpo_trainer import _args as dpo_args
    from tests.test_dpo_trainer import _data

    tok = build_char_tokenizer()
    trainer = DPOTrainer(model=_moe(tok), args=dpo_args(tmp_path, max_steps=1, pad_to_multiple_of=16, pad_token="<eos>"),
                         train_dataset=_data(), processing_class=tok)
    trainer.train()
    assert trainer.aux_loss_enabled and trainer.state.log_history[0]["aux_loss"] > 0
    assert tok.pad_token == "<eos>"
    batch = trainer._collate([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[1] % 16 == 0
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        DPOTrainer(model=_model(tok), args=dpo_args(tmp_path, pad_token="<nope>"), train_dataset=_data(),
                   processing_class=build_char_tokenizer())
    with pytest.raises(ValueError, match="already there"):
        DPOConfig(output_dir=str(tmp_path), activation_offloading=True)


@pytest.mark.parametrize("kw", [{"ld_alpha": 0.5}, {"use_weighting": True}, {"use_weighting": True, "padding_free": True}])
def test_dpo_ld_alpha_and_wpo_train(tmp_path, kw):
    from hf_verl.trainers.dpo_trainer import DPOTrainer
    from tests.test_dpo_trainer import _args as dpo_args
    from tests.test_dpo_trainer import _data
    from tests.test_dpo_trainer import _model as dpo_model

    tok = build_char_tokenizer()
    model = dpo_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = DPOTrainer(model=model, args=dpo_args(tmp_path, max_steps=1, **kw), train_dataset=_data(),
                         processing_class=tok)
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
