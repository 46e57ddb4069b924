"""RewardTrainer on tiny models built in code: the Bradley-Terry loss and TRL's metrics against a hand computation,
the dataset formats, a separable preference set learnt, the trained model saved, loaded as
AutoModelForSequenceClassification, used as PPOTrainer's reward model and served on `/classify`, bad inputs, and
2 gloo processes under FSDP2 against one process."""

import json
import logging
import math
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from hf_verl import RewardConfig, RewardTrainer
from hf_verl.algorithms.reward_losses import bradley_terry_loss, pairwise_reward_metrics
from hf_verl.data.preference import tokenize_sequences
from hf_verl.engine.step import SequenceScores
from tests.conftest import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _reward_model(tok, seed=0, num_labels=1):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    return LlamaForSequenceClassification(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, num_labels=num_labels))


def letter_pairs(n, seed=0):
    """A separable preference set: after a random 3-letter prompt, a letter from a-m is preferred to one from n-z
    (a model at initialisation ranks the pairs about half right)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [w + "=" for w in words],
                              "chosen": [rng.choice("abcdefghijklm") for _ in words],
                              "rejected": [rng.choice("nopqrstuvwxyz") for _ in words]})


def _args(tmp_path, **kw):
    base = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": [], "max_steps": 3, "logging_steps": 1,
            "per_device_train_batch_size": 4, "learning_rate": 1e-3, "gradient_checkpointing": False,
            "save_strategy": "no", "disable_tqdm": True, "seed": 0}
    return RewardConfig(**{**base, **kw})


def _hf_scores(model, batch):
    """The model's own forward: the pooled logit of each row."""
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]


# ------------------------------------------------------------------------------------------------ loss and metrics
def test_bradley_terry_loss_and_metrics_by_hand():
    chosen, rejected = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.0])
    margin = torch.tensor([0.5, 0.0, 1.0])

    def nll(x):
        return -math.log(1 / (1 + math.exp(-x)))

    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx((nll(1.0) + nll(-1.0) + nll(0.0)) / 3)
    with_margin = (nll(0.5) + nll(-1.0) + nll(-1.0)) / 3
    assert bradley_terry_loss(chosen, rejected, margin=margin).item() == pytest.approx(with_margin)
    centred = bradley_terry_loss(chosen, rejected, margin=margin, center_rewards_coefficient=0.01).item()
    assert centred == pytest.approx(with_margin + 0.01 * (1.0 + 0.0 + 16.0) / 3)
    metrics = {k: v.item() for k, v in pairwise_reward_metrics(chosen, rejected).items()}
    assert metrics == pytest.approx({"accuracy": 1 / 3, "margin": 0.0, "min_reward": -0.5, "mean_reward": 5 / 6,
                                     "max_reward": 2.0})  # the tie counts as wrong, as in TRL


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_trainer_loss_is_the_hand_computation_on_the_models_own_scores(tmp_path, pad_is_eos):
    """On a fixed batch with margins: the engine's scores are the saved model's own forward (also when the pad token
    is the EOS, where the score is read before the trailing EOS as transformers does), and the loss and logged
    metrics are the formulas applied to them."""
    tok = build_char_tokenizer(pad=not pad_is_eos)
    data = letter_pairs(4).add_column("margin", [0.5, 0.0, 1.0, 0.25])
    trainer = RewardTrainer(model=_reward_model(tok), args=_args(tmp_path, center_rewards_coefficient=0.01),
                            train_dataset=data, processing_class=tok)
    assert tok.pad_token_id == (tok.eos_token_id if pad_is_eos else tok.convert_tokens_to_ids("<pad>"))
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    trainer.actor.eval()
    with torch.no_grad():
        scores = SequenceScores(tok.pad_token_id).run(trainer.actor, batch)
        loss = trainer.compute_loss(trainer.model, batch)
    expected = _hf_scores(trainer.model, batch)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    c, r = expected.double().chunk(2)
    margin = torch.tensor([0.5, 0.0, 1.0, 0.25], dtype=torch.float64)
    by_hand = (-torch.nn.functional.logsigmoid(c - r - margin)).mean() + 0.01 * ((c + r) ** 2).mean()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    trainer._take_metrics("eval", [pairwise_reward_metrics(*expected.chunk(2))], [batch])
    logs = {"eval_loss": loss.item()}
    trainer.log(logs)
    assert logs["eval_accuracy"] == pytest.approx((c > r).double().mean().item())
    assert logs["eval_margin"] == pytest.approx((c - r).mean().item(), rel=1e-5)
    assert logs["eval_min_reward"] == pytest.approx(expected.min().item(), rel=1e-5)
    assert logs["eval_max_reward"] == pytest.approx(expected.max().item(), rel=1e-5)
    assert logs["eval_mean_reward"] == pytest.approx(expected.mean().item(), rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------------------------ data formats
def test_every_trl_format_tokenises_to_the_whole_sequences():
    tok = build_char_tokenizer()
    eos = tok.eos_token

    def ids(text, special=True):
        return tok(text, add_special_tokens=special)["input_ids"]

    explicit = tokenize_sequences({"prompt": "ab=", "chosen": "ba", "rejected": "ab"}, tok)
    implicit = tokenize_sequences({"chosen": "ab=ba", "rejected": "ab=ab"}, tok)
    assert explicit == implicit == (ids("ab=ba" + eos), ids("ab=ab" + eos))
    assert tokenize_sequences({"chosen": "x", "rejected": "xy"}, tok) == (ids("x" + eos), ids("xy" + eos))
    user = [{"role": "user", "content": "ab="}]
    answer = [{"role": "assistant", "content": "ba"}]
    wrong = [{"role": "assistant", "content": "ab"}]
    want = (tok.apply_chat_template(user + answer, tokenize=True, return_dict=True)["input_ids"],
            tok.apply_chat_template(user + wrong, tokenize=True, return_dict=True)["input_ids"])
    assert tokenize_sequences({"prompt": user, "chosen": answer, "rejected": wrong}, tok) == want
    assert tokenize_sequences({"chosen": user + answer, "rejected": user + wrong}, tok) == want


def test_pretokenized_and_legacy_columns_and_the_length_filter(tmp_path, caplog):
    tok = build_char_tokenizer()
    raw = letter_pairs(8)
    token_rows = [tokenize_sequences(row, tok) for row in raw]
    tokenized = Dataset.from_dict({"chosen_ids": [c for c, _ in token_rows], "rejected_ids": [r for _, r in token_rows]})
    trainer = RewardTrainer(model=_reward_model(tok), args=_args(tmp_path), train_dataset=raw, processing_class=tok)
    assert trainer.train_dataset["chosen_ids"] == tokenized["chosen_ids"]
    legacy = tokenized.rename_columns({"chosen_ids": "chosen_input_ids", "rejected_ids": "rejected_input_ids"})
    with pytest.warns(FutureWarning, match="chosen_input_ids / rejected_input_ids are deprecated"):
        trainer = RewardTrainer(model=_reward_model(tok), args=_args(tmp_path), train_dataset=legacy,
                                processing_class=tok)
    assert set(trainer.train_dataset.column_names) == {"chosen_ids", "rejected_ids"}
    long = Dataset.from_dict({"prompt": ["abcdefgh=", "a="] * 2, "chosen": ["x"] * 4, "rejected": ["y"] * 4})
    with caplog.at_level(logging.WARNING):
        trainer = RewardTrainer(model=_reward_model(tok), args=_args(tmp_path, max_length=6), train_dataset=long,
                                processing_class=tok)
    assert "dropped 2 of 4 train pairs" in caplog.text and len(trainer.train_dataset) == 2
    trainer.train()  # the streaming form of the same data trains too
    stream = RewardTrainer(model=_reward_model(tok), args=_args(tmp_path, max_length=6),
                           train_dataset=long.to_iterable_dataset(), processing_class=tok)
    stream.train()
    assert stream.state.global_step == 3


def test_chat_template_path_takes_a_jinja_file_or_another_tokenizers_template(tmp_path):
    from tests.conftest import CHAT_TEMPLATE, build_hermes_tokenizer

    tok = build_char_tokenizer()
    user = [{"role": "user", "content": "ab="}]
    rows = Dataset.from_dict({"prompt": [user] * 4, "chosen": [[{"role": "assistant", "content": "ba"}]] * 4,
                              "rejected": [[{"role": "assistant", "content": "ab"}]] * 4})
    (tmp_path / "t.jinja").write_text(CHAT_TEMPLATE.replace("<assistant>{% endif %}", "<assistant>!{% endif %}"))
    RewardTrainer(model=_reward_model(tok), args=_args(tmp_path, chat_template_path=str(tmp_path / "t.jinja")),
                  train_dataset=rows, processing_class=tok)
    assert tok.chat_template.endswith("<assistant>!{% endif %}")
    source = build_hermes_tokenizer()
    source.save_pretrained(tmp_path / "hermes")
    tok, model = build_char_tokenizer(), _reward_model(tok)
    size = len(tok)
    trainer = RewardTrainer(model=model, args=_args(tmp_path, chat_template_path=str(tmp_path / "hermes")),
                            train_dataset=rows, processing_class=tok)
    assert tok.chat_template == source.chat_template and tok.eos_token == "<|im_end|>"
    assert len(tok) == size + 2 and model.get_input_embeddings().num_embeddings == len(tok)
    assert trainer.train_dataset[0]["chosen_ids"][-2] == tok.convert_tokens_to_ids("<|im_end|>")
    trainer.train()


# ------------------------------------------------------------------------------------------------ training
def test_training_lifts_pairwise_accuracy_and_changes_every_parameter(tmp_path):
    tok = build_char_tokenizer()
    model = _reward_model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = RewardTrainer(model=model, args=_args(tmp_path, max_steps=40, per_device_train_batch_size=8,
                                                    learning_rate=3e-3, logging_steps=10),
                            train_dataset=letter_pairs(64), eval_dataset=letter_pairs(32, seed=1),
                            processing_class=tok)
    start = trainer.evaluate()
    trainer.train()
    end = trainer.evaluate()
    assert start["eval_accuracy"] <= 0.7 and end["eval_accuracy"] >= 0.9, (start, end)
    assert end["eval_loss"] < start["eval_loss"]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for key in ("accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"):
        assert key in logs[0], key
    assert logs[-1]["margin"] > logs[0]["margin"]
    assert logs[-1]["num_tokens"] == sum(len(c) + len(r) for c, r in zip(
        *[trainer.train_dataset[col] for col in ("chosen_ids", "rejected_ids")])) * 40 * 8 / 64
    assert [n for n, p in model.named_parameters() if torch.equal(p, before[n])] == []


def test_a_causal_lm_by_path_gets_a_one_label_head(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, vocab_size=len(tok))).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    trainer = RewardTrainer(model=str(tmp_path / "lm"), args=_args(tmp_path / "out"), train_dataset=letter_pairs(8))
    assert type(trainer.model).__name__ == "LlamaForSequenceClassification" and trainer.model.config.num_labels == 1
    assert trainer.model.config.pad_token_id == tok.pad_token_id and trainer.model.dtype == torch.float32
    assert {"trl", "reward-trainer"} <= set(trainer.model.model_tags)
    trainer.train()
    assert trainer.state.global_step == 3


def test_peft_trains_the_adapters_and_the_head_it_is_told_to(tmp_path, caplog):
    from peft import LoraConfig

    tok = build_char_tokenizer()
    with caplog.at_level(logging.WARNING):
        RewardTrainer(model=_reward_model(tok), args=_args(tmp_path), train_dataset=letter_pairs(8),
                      processing_class=tok, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert "the `score` head keeps its initial weights" in caplog.text
    trainer = RewardTrainer(model=_reward_model(tok), args=_args(tmp_path), train_dataset=letter_pairs(8),
                            processing_class=tok, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                          modules_to_save=["score"]))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert changed == trainable and any("lora_" in n for n in changed) and any("score" in n for n in changed)


# ------------------------------------------------------------------------------------------------ the pipeline
@pytest.fixture(scope="module")
def saved_reward_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward")
    tok = build_char_tokenizer()
    trainer = RewardTrainer(model=_reward_model(tok), args=_args(tmp / "run", max_steps=10, per_device_train_batch_size=8),
                            train_dataset=letter_pairs(32), processing_class=tok)
    trainer.train()
    trainer.save_model(str(tmp / "rm"))
    return tmp / "rm", trainer.model.eval(), tok


def test_the_saved_model_loads_as_a_sequence_classifier_with_the_same_scores(saved_reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path, trained, tok = saved_reward_model
    assert (path / "model.safetensors").exists()
    loaded = AutoModelForSequenceClassification.from_pretrained(path).eval()
    assert loaded.config.num_labels == 1 and AutoTokenizer.from_pretrained(path).pad_token_id == tok.pad_token_id
    ids = [tokenize_sequences(row, tok)[0] for row in letter_pairs(4, seed=3)]
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(len(ids), len(ids[0]), dtype=torch.long)}
    torch.testing.assert_close(_hf_scores(loaded, batch), _hf_scores(trained, batch))


def test_the_saved_model_is_ppos_reward_model(saved_reward_model, tmp_path):
    from hf_verl import PPOTrainer
    from hf_verl.rewards.reward_model import RewardModelScorer
    from tests.test_ppo_trainer import _args as ppo_args
    from tests.test_ppo_trainer import _critic, _policy

    path, trained, tok = saved_reward_model
    trainer = PPOTrainer(args=ppo_args(tmp_path, max_steps=1), processing_class=tok, model=_policy(tok),
                         reward_model=str(path), value_model=_critic(tok),
                         train_dataset=Dataset.from_dict({"prompt": ["abc=", "xyz=", "hel=", "ab="] * 2}))
    scorer = trainer.reward_funcs[0]
    assert isinstance(scorer, RewardModelScorer)
    got = scorer(prompts=["abc=", "xy="], completions=["a", "z"])
    texts = tok(["abc=a", "xy=z"], return_tensors="pt", padding=True, add_special_tokens=False)
    assert got == pytest.approx(_hf_scores(trained, texts).tolist(), abs=1e-5)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "objective/scores" in h]  # TRL's PPO name of the mean score
    assert math.isfinite(log["objective/scores"]) and log["rewards/rm/mean"] == log["objective/scores"]


def _post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_hf_verl_serve_classify_serves_the_saved_model(saved_reward_model):
    path, trained, tok = saved_reward_model
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", str(path), "--task", "classify", "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT)))
    try:
        ids = [tokenize_sequences(row, tok)[0] for row in letter_pairs(3, seed=4)]
        deadline = time.time() + 120
        while True:
            try:
                answer = _post(f"http://127.0.0.1:{port}/classify", {"input": ids, "use_activation": False})
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()[-3000:]
                time.sleep(0.5)
        batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(3, len(ids[0]), dtype=torch.long)}
        assert [d["probs"][0] for d in answer["data"]] == pytest.approx(_hf_scores(trained, batch).tolist(), abs=1e-5)
        texts = _post(f"http://127.0.0.1:{port}/classify", {"input": ["abc=a<eos>"], "use_activation": False})
        one = {"input_ids": torch.tensor([tok("abc=a<eos>")["input_ids"]])}
        one["attention_mask"] = torch.ones_like(one["input_ids"])
        assert texts["data"][0]["probs"][0] == pytest.approx(_hf_scores(trained, one).item(), abs=1e-5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_say_what_is_wrong(tmp_path):
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"missing column\(s\) \['rejected'\]; columns present: \['prompt', "
                                         r"'chosen'\]\. RewardTrainer needs 'chosen' and 'rejected'"):
        RewardTrainer(model=_reward_model(tok), args=_args(tmp_path), processing_class=tok,
                      train_dataset=Dataset.from_dict({"prompt": ["a"], "chosen": ["b"]}))
    with pytest.raises(ValueError, match=r"missing column\(s\) \['chosen', 'rejected'\]; columns present: \['text'\]"):
        RewardTrainer(model=_reward_model(tok), args=_args(tmp_path), processing_class=tok,
                      train_dataset=Dataset.from_dict({"text": ["a"]}))
    with pytest.raises(ValueError, match=r"num_labels=2`, but reward models require `num_labels=1`"):
        RewardTrainer(model=_reward_model(tok, num_labels=2), args=_args(tmp_path), processing_class=tok,
                      train_dataset=letter_pairs(2))
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        RewardTrainer(model=_reward_model(tok), args=_args(tmp_path), processing_class=tok)
    with pytest.raises(ValueError, match="every train pair is longer than max_length=3"):
        RewardTrainer(model=_reward_model(tok), args=_args(tmp_path, max_length=3), processing_class=tok,
                      train_dataset=letter_pairs(2))
    with pytest.raises(ValueError, match="center_rewards_coefficient must be a float >= 0"):
        _args(tmp_path, center_rewards_coefficient=-0.1)
    with pytest.raises(ValueError, match="vision-related.*RewardTrainer"):
        RewardTrainer(model=_reward_model(tok), args=_args(tmp_path), processing_class=tok,
                      train_dataset=letter_pairs(2).add_column("images", [[], []]))


# ------------------------------------------------------------------------------------------------ data parallel
@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_over_two_processes_equals_one_process(tmp_path):
    """The same global batch (4 pairs, the default shuffled sampler) on one process and on 2 gloo processes under
    FSDP2 (2 pairs each): the same logged losses and metrics, and the same trained weights."""
    from safetensors.torch import load_file

    from tests.one_and_two import one_and_two

    want, got, one, two = one_and_two("tests.distributed.reward_dp", "fsdp2_cpu", tmp_path)
    assert (want["world"], want["dp_size"]) == (1, 1)
    assert (got["world"], got["dp_size"], got["backend"], got["param_type"]) == (2, 2, "fsdp2", "DTensor")
    assert len(got["losses"]) == 4
    for key in ("losses", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (one, two))
    assert set(a) == set(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 2e-5
    assert want["losses"][-1] < want["losses"][0]
