"""The path the docs give a user, end to end: `hf-verl serve` started with its token in `HF_VERL_SERVE_TOKEN`, the
training script run with the same variable and the server as its generator (`placement={"generator": url}` in the
facade and in GRPOConfig), then the server asked what it serves: its greedy completions equal the trained actor's.

Before the role builder, the facade built its remote engine without the token and the first weight sync answered
401; the trainers had no `placement` at all.
"""

import copy
import os
import socket
import subprocess
import sys

import pytest
import torch

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.rollout.remote import RemoteEngine
from tests.conftest import build_char_tokenizer

TOKEN = "a-token-only-the-trainer-knows"
PROMPTS = ["abc", "xyz", "hello", "ab"]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def _model(tok, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))


def count_a(completions, **kwargs):
    return [float(c.count("a")) + 0.1 * len(c) for c in completions]


@pytest.fixture
def hf_verl_serve(tmp_path, monkeypatch):
    """`HF_VERL_SERVE_TOKEN=... hf-verl serve <dir> --port P` as docs/rollout.md starts it, on weights other than the
    policy's (the first sync must replace them); the test's process gets the same variable, as the training script
    would."""
    tok = build_char_tokenizer()
    _model(tok, seed=7).save_pretrained(tmp_path / "served")
    tok.save_pretrained(tmp_path / "served")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_VERL_SERVE_TOKEN=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", str(tmp_path / "served"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", TOKEN)
    try:
        RemoteEngine(url, max_retries=20, backoff_s=0.5).generate([tok("a")["input_ids"]], GREEDY)  # wait until up
        yield url, tok
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _served_equals(url, tok, model):
    """The server's greedy completions (asked without the token: generation needs none) equal the model's own."""
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    served = RemoteEngine(url).generate(prompts, GREEDY)
    local = TransformersEngine(copy.deepcopy(model).eval(), tok).generate(prompts, GREEDY)
    assert served.completion_ids == local.completion_ids
    return served.weight_version


@pytest.mark.slow
def test_the_facade_trains_against_hf_verl_serve_with_its_token(hf_verl_serve):
    from hf_verl import Trainer

    url, tok = hf_verl_serve
    policy = _model(tok, seed=0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = Trainer(actor_model=policy, reward_model=count_a, tokenizer=tok, placement={"generator": url},
                      config=dict(num_generations=4, max_completion_length=5, learning_rate=1e-2,
                                  use_async_rollout=False))
    assert isinstance(trainer.engine, RemoteEngine) and trainer.engine.token == TOKEN
    for i in range(3):
        trainer.step(trainer.compute_loss(trainer.rollout(PROMPTS[i % 2 * 2 : i % 2 * 2 + 2])))
    assert any(not torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    assert _served_equals(url, tok, policy) >= 3  # the server holds the weights of the last step


@pytest.mark.slow
def test_grpo_trainer_trains_against_hf_verl_serve_with_its_token(hf_verl_serve, tmp_path):
    from datasets import Dataset

    from hf_verl import GRPOConfig, GRPOTrainer

    url, tok = hf_verl_serve
    policy = _model(tok, seed=0)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=5, learning_rate=1e-2,
                      gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                      placement={"generator": url})
    trainer = GRPOTrainer(model=policy, reward_funcs=count_a, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}))
    assert isinstance(trainer.engine, RemoteEngine) and trainer.engine.token == TOKEN
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all("sampling/importance_sampling_ratio/mean" in h for h in logs)  # off-policy engine
    assert _served_equals(url, tok, policy) == 4  # a sync per round, and one at the end of train()
