"""Run under `torchrun --nproc_per_node 2`: a GRPO run on gloo in which rank 1 misbehaves (argv[2]).

Modes: `reward` (rank 1's reward function never returns), `forward` (rank 1's model forward never returns
from the second step on), `raise` (rank 1's reward function raises `ValueError("reward exploded on rank 1")`
at step 2), `return` (nothing goes wrong: train one step and return without calling anything at the end).
argv[1] is the output folder, argv[3] the `ddp_timeout` in seconds (default 15).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from datasets import Dataset

from hf_verl.trainers.grpo_config import GRPOConfig
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer
from tests.test_grpo_trainer import _model, text_reward

STALL_S = 3600.0  # "never": far beyond any timeout the tests use


def stall(out_dir: str) -> None:
    with open(os.path.join(out_dir, "stall.json"), "w") as f:
        json.dump({"t": time.time()}, f)
    time.sleep(STALL_S)


def main(out_dir: str, mode: str, timeout: int) -> None:
    tok = build_char_tokenizer()
    model = _model(tok)
    calls = {"reward": 0, "forward": 0}

    def reward(completions, **kwargs):
        calls["reward"] += 1
        if dist.get_rank() == 1 and calls["reward"] == 2:
            if mode == "reward":
                stall(out_dir)
            if mode == "raise":
                raise ValueError("reward exploded on rank 1")
        return text_reward(completions, **kwargs)

    if mode == "forward":
        def stall_forward(module, args, kwargs):
            if torch.is_grad_enabled() and dist.get_rank() == 1:  # a training forward, not generation
                calls["forward"] += 1
                if calls["forward"] == 2:
                    stall(out_dir)
        model.register_forward_pre_hook(stall_forward, with_kwargs=True)
    ds = Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 4})
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, report_to=[], max_steps=1 if mode == "return" else 4,
                      logging_steps=1, per_device_train_batch_size=2, num_generations=4, max_completion_length=4,
                      learning_rate=1e-2, gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                      ddp_timeout=timeout)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 15)
