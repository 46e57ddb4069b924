"""GRPO on a tiny Gemma 3 with image prompts, as one data-parallel rank (under `torchrun --nproc_per_node 2`, gloo)
or as the one-process baseline (`run(out_dir, per_device_batch)` in the test's own process).

Rows are sampled from per-row seeds (`per_row_sampling_seed`), so that both layouts generate the same completions
for the same global round; each run saves its final weights and logged losses into `out_dir`.
"""

import json
import os
import sys

import torch
from datasets import Dataset

from tests.vlm_models import build_gemma3, random_image


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def run(out_dir: str, per_device_batch: int) -> dict:
    from hf_verl import GRPOConfig, GRPOTrainer

    model, processor = build_gemma3()
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"what is {c}?"}], "image": random_image(i)}
                              for i, c in enumerate("abcd")])
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, report_to=[], max_steps=2, logging_steps=1,
                      per_device_train_batch_size=per_device_batch, num_generations=4, max_completion_length=5,
                      learning_rate=1e-2, beta=0.1, bf16=False, gradient_checkpointing=False, save_strategy="no",
                      disable_tqdm=True, seed=7, per_row_sampling_seed=True)
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=data,
                          processing_class=processor)
    trainer.train()
    state = {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters()}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"state": state, "losses": [h["loss"] for h in logs], "rewards": [h["reward"] for h in logs],
            "distributed_type": str(trainer.accelerator.distributed_type), "world": trainer.args.world_size}


if __name__ == "__main__":
    import torch.distributed as dist

    from hf_verl.parallel.comm import leave_together

    out = sys.argv[1]
    result = run(out, per_device_batch=2)
    if dist.get_rank() == 0:
        torch.save(result["state"], os.path.join(out, "state.pt"))
        with open(os.path.join(out, "rank0.json"), "w") as f:
            json.dump({k: v for k, v in result.items() if k != "state"}, f)
    leave_together()
