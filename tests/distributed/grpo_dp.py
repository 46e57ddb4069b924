"""Run under `torchrun --nproc_per_node 2`: GRPO data parallel on gloo, one group split over ranks.

Each rank writes `rank<k>.json` into the folder given as argv[1]: its buffered rewards and
advantages, the group-normalised advantages recomputed from the gathered rewards, and a
checksum of its final parameters (identical across ranks when DDP syncs gradients).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset

from hf_verl.algorithms.advantages import grpo_advantages
from hf_verl.trainers.grpo_config import GRPOConfig
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _model, text_reward


def main(out_dir: str) -> None:
    tok = build_char_tokenizer()
    model = _model(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2})
    # 2 completions per rank x 2 ranks = one round of 4 = one group of num_generations=4
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                      per_device_train_batch_size=2, num_generations=4, max_completion_length=6,
                      learning_rate=1e-2, gradient_checkpointing=False, save_strategy="no",
                      temperature=1.5, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=text_reward, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    rank, world = dist.get_rank(), dist.get_world_size()
    (mb,) = trainer._buffer
    gathered = [torch.zeros_like(mb.rewards) for _ in range(world)]
    dist.all_gather(gathered, mb.rewards.contiguous())
    all_rewards = torch.cat(gathered)
    expected, _ = grpo_advantages(all_rewards, 4, "group")
    params = trainer.accelerator.unwrap_model(trainer.model).named_parameters()
    changed = sum(not torch.equal(p.detach(), before[n]) for n, p in params)
    checksum = sum(p.detach().double().sum().item() for p in trainer.model.parameters())
    logs = [h for h in trainer.state.log_history if "loss" in h]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"world": world, "distributed_type": str(trainer.accelerator.distributed_type),
                   "rewards": mb.rewards.tolist(), "advantages": mb.advantages.tolist(),
                   "expected": expected[rank * 2 : (rank + 1) * 2].tolist(), "all_rewards": all_rewards.tolist(),
                   "checksum": checksum, "changed": changed, "num_params": len(before),
                   "logged_reward": [h["reward"] for h in logs], "losses": [h["loss"] for h in logs]}, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1])
    leave_together()
