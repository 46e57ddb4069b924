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
    with pytest.raises(ValueError, match="precompute_ref_log_probs=True is not supported with IterableDataset"):
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


# ---------------------------------------------------------------------- TRL's DPOTrainer behaviours (tests/trl_suite)
def _trainer(tmp_path, tok, **kw):
    return DPOTrainer(model=_model(tok), args=_args(tmp_path, **kw), train_dataset=_data(2), processing_class=tok)


def test_train_dataset_is_required(tmp_path):
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        DPOTrainer(model=_model(tok), args=_args(tmp_path), processing_class=tok)


def test_model_tags_are_trls(tmp_path):
    trainer = _trainer(tmp_path, build_char_tokenizer())
    assert {"trl", "dpo", "hf_verl"} <= set(trainer.model.model_tags)


def test_model_card_takes_trls_dataset_name(tmp_path):
    """`trainer.push_to_hub(dataset_name=...)` (TRL's keyword) reaches create_model_card: the card names the dataset
    and carries the trainer's tags; naming it twice is refused."""
    trainer = _trainer(tmp_path, build_char_tokenizer())
    trainer.create_model_card(model_name="tiny-dpo", dataset_name="trl-lib/ultrafeedback_binarized", tags="mine")
    card = (tmp_path / "README.md").read_text()
    assert "trl-lib/ultrafeedback_binarized" in card and "tiny-dpo" in card
    for tag in ("trl", "dpo", "hf_verl", "mine"):
        assert f"- {tag}" in card, tag
    with pytest.raises(ValueError, match="not both"):
        trainer.create_model_card(dataset_name="a", dataset="b")


def test_evaluate_takes_raw_datasets_and_dicts(tmp_path):
    from datasets import DatasetDict, IterableDatasetDict

    trainer = _trainer(tmp_path, build_char_tokenizer())
    raw = _data(1)  # untokenised: prompt / chosen / rejected
    assert trainer.evaluate(eval_dataset=raw)["eval_loss"] > 0
    assert trainer.evaluate(eval_dataset=raw.to_iterable_dataset())["eval_loss"] > 0
    for wrap in (dict, DatasetDict):
        metrics = trainer.evaluate(eval_dataset=wrap({"a": raw, "b": raw}))
        assert metrics["eval_a_loss"] == pytest.approx(metrics["eval_b_loss"])
    metrics = trainer.evaluate(eval_dataset=IterableDatasetDict({"s": raw.to_iterable_dataset()}))
    assert metrics["eval_s_loss"] > 0


def test_eval_dataset_dict_at_init_is_tokenised_per_split(tmp_path):
    tok = build_char_tokenizer()
    raw = _data(1)
    trainer = DPOTrainer(model=_model(tok), args=_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2),
                         train_dataset=_data(2), eval_dataset={"a": raw, "b": raw.to_iterable_dataset()},
                         processing_class=tok)
    assert set(trainer.eval_dataset) == {"a", "b"}
    assert all("prompt_ids" in next(iter(ds)) for ds in trainer.eval_dataset.values())
    trainer.train()
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"eval_a_loss", "eval_b_loss"} <= logged


def test_precompute_refuses_iterable_datasets_wherever_they_are(tmp_path):
    from datasets import IterableDatasetDict

    tok = build_char_tokenizer()
    stream = _data(1).to_iterable_dataset()
    for train, evals in ((stream, None), (_data(1), stream), (_data(1), {"e": stream}),
                         (_data(1), IterableDatasetDict({"e": stream}))):
        with pytest.raises(ValueError, match="precompute_ref_log_probs=True is not supported with IterableDataset"):
            DPOTrainer(model=_model(tok), args=_args(tmp_path, precompute_ref_log_probs=True), train_dataset=train,
                       eval_dataset=evals, processing_class=tok)
    trainer = DPOTrainer(model=_model(tok), args=_args(tmp_path, precompute_ref_log_probs=True),
                         train_dataset=_data(1), processing_class=tok)
    with pytest.raises(ValueError, match="precompute_ref_log_probs=True is not supported with IterableDataset"):
        trainer.evaluate(eval_dataset=stream)


def test_precompute_without_ref_model_uses_the_untrained_policy(tmp_path, monkeypatch):
    """No copy of the policy is kept: its log-probs before the first step are the reference. A dataset given to
    evaluate() before training is scored that way (equal to the live frozen-copy reference); after training it is
    refused, while the eval set given at init keeps its precomputed values."""
    monkeypatch.setenv("HF_VERL_CACHE", str(tmp_path / "cache"))
    tok = build_char_tokenizer()
    raw = _data(1)
    live = DPOTrainer(model=_model(tok), args=_args(tmp_path), train_dataset=_data(2), processing_class=tok)
    pre = DPOTrainer(model=_model(tok), args=_args(tmp_path, precompute_ref_log_probs=True), train_dataset=_data(2),
                     eval_dataset={"init": raw}, processing_class=tok)
    assert pre.reference is None and pre.ref_model is None
    assert pre.evaluate(eval_dataset=raw)["eval_loss"] == pytest.approx(live.evaluate(eval_dataset=raw)["eval_loss"])
    pre.train()
    with pytest.raises(ValueError, match="Cannot compute reference log-probs for a dataset passed to"):
        pre.evaluate(eval_dataset=raw)
    assert pre.evaluate()["eval_init_loss"] > 0


def test_model_by_id_loads_in_float32_unless_told(tmp_path):
    tok = build_char_tokenizer()
    path = tmp_path / "ckpt"
    _model(tok).to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)

    def dtype(**kw):
        trainer = DPOTrainer(model=str(path), args=_args(tmp_path, **kw), train_dataset=_data(1))
        return trainer.model.dtype, trainer.ref_model.dtype

    assert dtype() == (torch.float32, torch.float32)  # TRL's default, not the checkpoint's bfloat16
    assert dtype(model_init_kwargs={"dtype": "auto"}) == (torch.bfloat16, torch.bfloat16)
    assert dtype(model_init_kwargs={"dtype": torch.float16}) == (torch.float16, torch.float16)
    with pytest.raises(ValueError, match="model_init_kwargs\\['dtype'\\]"):
        dtype(model_init_kwargs={"dtype": "float8"})


def test_per_row_chat_template_kwargs_and_tools(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = ("{% if tools %}{{ tools | length }} tools\n{% endif %}{% if greet %}hi\n{% endif %}"
                         "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    rows = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": "q"}]] * 3,
        "chosen": [[{"role": "assistant", "content": "a"}]] * 3,
        "rejected": [[{"role": "assistant", "content": "b"}]] * 3,
        "chat_template_kwargs": [{"greet": True}, {"greet": False}, {"greet": False}],
        "tools": [None, None, '[{"type": "function", "function": {"name": "f"}}]'],  # JSON text, as TRL accepts
    })
    trainer = DPOTrainer(model=_model(tok), args=_args(tmp_path), train_dataset=rows, processing_class=tok)
    prompts = [tok.decode(r["prompt_ids"]) for r in trainer.train_dataset]
    assert prompts[0].startswith("hi\n<user>q") and prompts[1].startswith("<user>q")
    assert prompts[2].startswith("1 tools\n<user>q")  # `tools` given as JSON text, as TRL accepts


def test_default_collator_is_picklable(tmp_path):
    import pickle

    trainer = _trainer(tmp_path, build_char_tokenizer())
    collator = pickle.loads(pickle.dumps(trainer.data_collator))  # dataloader workers under spawn / forkserver
    rows = [trainer.train_dataset[i] for i in range(2)]
    assert torch.equal(collator(rows)["input_ids"], trainer.data_collator(rows)["input_ids"])


def test_vision_dataset_with_a_text_only_model_is_refused(tmp_path):
    """Image columns train vision-language models (tests/test_vlm.py); with a text-only model they are refused."""
    tok = build_char_tokenizer()
    rows = _data(1).add_column("images", [[]] * 3)
    with pytest.raises(ValueError, match=r"image column\(s\) \['images'\].*text-only"):
        DPOTrainer(model=_model(tok), args=_args(tmp_path), train_dataset=rows, processing_class=tok)


def test_peft_model_with_its_own_adapter_is_its_reference(tmp_path):
    """A PeftModel passed in (say an SFT LoRA) is the reference with that adapter, as in TRL: a frozen copy of the
    adapter named "ref", not the bare base model."""
    from peft import LoraConfig, get_peft_model

    tok = build_char_tokenizer()
    model = get_peft_model(_model(tok), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained-looking adapter: B no longer zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    trainer = DPOTrainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=_data(), processing_class=tok)
    assert "ref" in trainer.model.peft_config
    batch = trainer._prepare_inputs(trainer._collate([trainer.train_dataset[i] for i in range(4)]))
    with torch.no_grad():
        policy = trainer._sequence_logps(trainer.actor, batch)[0]
        with trainer.actor.adapters_disabled():
            base = trainer._sequence_logps(trainer.actor, batch)[0]
    reference = trainer._reference_logps(batch)
    assert torch.allclose(reference, policy, atol=1e-6) and not torch.allclose(reference, base, atol=1e-3)
    ref_before = {n: p.detach().clone() for n, p in model.named_parameters() if ".ref." in n}
    default_before = {n: p.detach().clone() for n, p in model.named_parameters() if ".default." in n}
    trainer.train()
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], p) and not params[n].requires_grad for n, p in ref_before.items())
    assert any(not torch.equal(params[n], p) for n, p in default_before.items())
    assert all(params[n].requires_grad for n in default_before)
