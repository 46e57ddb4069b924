"""DPOTrainer on a tiny model: data forms, padded == padding-free, precomputed == live reference."""

import logging

import pytest
import torch
from datasets import Dataset

from hf_verl.data.preference import extract_prompt, tokenize_pair
from hf_verl.trainers.dpo_config import DPOConfig
from hf_verl.trainers.dpo_trainer import DPOTrainer, preference_accuracy
from tests.conftest import build_char_tokenizer


def _model(tok, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))


def _data(n=8):
    return Dataset.from_dict({"prompt": ["abc=", "hello=", "x="] * n, "chosen": ["cba", "olleh", "x"] * n,
                              "rejected": ["abc", "hello", "y"] * n})


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                per_device_train_batch_size=4, learning_rate=1e-2, gradient_checkpointing=False,
                save_strategy="no", disable_tqdm=True, seed=0)
    base.update(kw)
    return DPOConfig(**base)


def test_implicit_prompt_extraction():
    assert extract_prompt("Q: hi A: yes", "Q: hi A: no") == ("Q: hi A:", " yes", " no")
    msgs = [{"role": "user", "content": "q"}]
    assert extract_prompt(msgs + [{"role": "assistant", "content": "a"}],
                          msgs + [{"role": "assistant", "content": "b"}]) == (
        msgs, [{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}])


def test_tokenize_pair_explicit_implicit_and_truncation():
    tok = build_char_tokenizer()
    a = tokenize_pair({"prompt": "ab=", "chosen": "ba", "rejected": "ab"}, tok, None)
    b = tokenize_pair({"chosen": "ab=ba", "rejected": "ab=ab"}, tok, None)
    assert a.prompt_ids == tok("ab=")["input_ids"] and a.chosen_ids == tok("ba<eos>")["input_ids"]
    assert (b.prompt_ids, b.chosen_ids, b.rejected_ids) == (a.prompt_ids, a.chosen_ids, a.rejected_ids)
    t = tokenize_pair({"prompt": "abcd=", "chosen": "dcba", "rejected": "x"}, tok, 7, "keep_start")
    assert t.truncated and len(t.prompt_ids) + len(t.chosen_ids) == 7 and len(t.rejected_ids) == 2
    e = tokenize_pair({"prompt": "abcd=", "chosen": "dcba", "rejected": "x"}, tok, 7, "keep_end")
    assert e.truncated and e.chosen_ids == tok("dcba<eos>")["input_ids"] and len(e.prompt_ids) == 2


def test_dpo_trains_and_logs_trl_metrics(tmp_path):
    tok = build_char_tokenizer()
    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPOTrainer(model=model, args=_args(tmp_path, max_steps=6), train_dataset=_data(),
                         processing_class=tok)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected", "logits/chosen", "logits/rejected"):
        assert key in logs[0], key
    assert logs[-1]["rewards/margins"] > 0 and logs[-1]["loss"] < logs[0]["loss"]
    assert [n for n, p in model.named_parameters() if torch.equal(p, before[n])] == []


def _first_loss(tmp_path, tok, **kw):
    trainer = DPOTrainer(model=_model(tok), args=_args(tmp_path, max_steps=1, **kw), train_dataset=_data(),
                         processing_class=tok)
    batch = trainer._collate([trainer.train_dataset[i] for i in range(4)])
    batch = trainer._prepare_inputs(batch)
    trainer.actor.eval()
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch).item(), trainer._sequence_logps(trainer.actor, batch)[0]


def test_padding_free_equals_padded(tmp_path):
    tok = build_char_tokenizer()
    loss_p, logps_p = _first_loss(tmp_path / "p", tok)
    loss_f, logps_f = _first_loss(tmp_path / "f", tok, padding_free=True)
    assert torch.allclose(logps_p, logps_f, atol=1e-5)
    assert loss_f == pytest.approx(loss_p, abs=1e-6)


def test_precomputed_reference_equals_live(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_VERL_CACHE", str(tmp_path / "cache"))
    tok = build_char_tokenizer()

    def losses(**kw):
        trainer = DPOTrainer(model=_model(tok), args=_args(tmp_path, max_steps=3, **kw), train_dataset=_data(),
                             processing_class=tok)
        trainer.train()
        return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    _, live = losses()
    pre, cached = losses(precompute_ref_log_probs=True)
    assert pre.ref_model is None and "ref_chosen_logps" in pre.train_dataset.column_names
    assert cached == pytest.approx(live, rel=1e-5)
    assert len(list((tmp_path / "cache" / "ref_logps").iterdir())) == 1
    _, again = losses(precompute_ref_log_probs=True)  # from the cache
    assert again == pytest.approx(live, rel=1e-5)


def test_peft_reference_is_the_base_model(tmp_path):
    from peft import LoraConfig

    tok = build_char_tokenizer()
    trainer = DPOTrainer(model=_model(tok), args=_args(tmp_path, max_steps=2), train_dataset=_data(),
                         processing_class=tok, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert trainer.ref_model is None
    batch = trainer._prepare_inputs(trainer._collate([trainer.train_dataset[i] for i in range(4)]))
    from hf_verl.engine.accelerate_engine import AccelerateEngine

    base = AccelerateEngine(_model(tok), role="reference", dims=trainer.dims, backend=trainer.backend,
                            trainable=False)
    with torch.no_grad():
        # LoRA starts as a no-op: the disabled-adapter reference equals the untouched base model
        assert torch.allclose(trainer._reference_logps(batch), trainer._sequence_logps(base, batch)[0], atol=1e-5)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and logs[-1]["rewards/margins"] != 0


def test_evaluation_reports_preference_accuracy(tmp_path):
    tok = build_char_tokenizer()
    trainer = DPOTrainer(model=_model(tok), args=_args(tmp_path, max_steps=4), train_dataset=_data(),
                         eval_dataset=_data(2), processing_class=tok, compute_metrics=preference_accuracy)
    trainer.train()
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval_preference_accuracy"] <= 1.0
    assert metrics["eval_rewards/accuracies"] == pytest.approx(metrics["eval_preference_accuracy"])


def test_bad_inputs(tmp_path, caplog):
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"missing column\(s\) \['rejected'\]; columns present: \['prompt', 'chosen'\]"):
        DPOTrainer(model=_model(tok), args=_args(tmp_path), processing_class=tok,
                   train_dataset=Dataset.from_dict({"prompt": ["a"], "chosen": ["b"]}))
    with pytest.raises(ValueError, match="row 1: 'rejected' is empty"):
        DPOTrainer(model=_model(tok), args=_args(tmp_path), processing_class=tok,
                   train_dataset=Dataset.from_dict({"prompt": ["a", "b"], "chosen": ["b", "c"], "rejected": ["c", ""]}))
    with pytest.raises(ValueError, match="unknown loss_type"):
        _args(tmp_path, loss_type=["sigmoid", "nope"])
    with caplog.at_level(logging.WARNING):
        t = DPOTrainer(model=_model(tok), args=_args(tmp_path), processing_class=tok,
                       train_dataset=Dataset.from_dict({"prompt": ["a", "b"] * 4, "chosen": ["x", "y"] * 4,
                                                        "rejected": ["x", "z"] * 4}))
    assert "4 of 8 train pairs have identical chosen and rejected" in caplog.text
    assert t._data_stats["data/identical_pairs"] == 4
    with caplog.at_level(logging.WARNING):
        t = DPOTrainer(model=_model(tok), args=_args(tmp_path, max_length=4), processing_class=tok,
                       train_dataset=Dataset.from_dict({"prompt": ["abcdefg", "a"] * 2, "chosen": ["x"] * 4,
                                                        "rejected": ["y"] * 4}))
    assert "dropping 2 train pairs whose prompt alone fills max_length=4" in caplog.text and len(t.train_dataset) == 2
    from datasets import IterableDataset

    stream = IterableDataset.from_generator(lambda: iter([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    with pytest.raises(ValueError, match="precompute_ref_log_probs needs a map-style dataset"):
        DPOTrainer(model=_model(tok), args=_args(tmp_path, precompute_ref_log_probs=True), processing_class=tok,
                   train_dataset=stream)


def test_bundled_evaluate_metric_loads_offline(monkeypatch):
    import evaluate

    from hf_verl.metrics import metric_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    metric = evaluate.load(metric_path("preference_accuracy"))
    assert metric.compute(chosen_scores=[1.0, 2.0, 0.5], rejected_scores=[0.0, 3.0, 0.5]) == {
        "preference_accuracy": pytest.approx(1 / 3)}  # the tie counts as wrong
    with pytest.raises(ValueError, match="no bundled metric 'nope'"):
        metric_path("nope")
