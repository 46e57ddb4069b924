"""RewardTrainer for 4 steps on one global batch of 4 pairs: run with plain python (one process, 4 pairs a step) or
under `accelerate launch` with 2 processes (2 pairs each, the launch's backend: FSDP2 in the test).

The default shuffled sampler (seeded with `seed`) deals the same global batches whatever the layout, so the logged
losses and metrics and the final weights must match. The main rank writes `OUT/result.json` (the logged values, the
backend, world and data-parallel sizes, the type of the model's parameters) and the final model into `OUT/final`.
"""

import json
import os
import sys

from hf_verl import RewardConfig, RewardTrainer
from tests.conftest import build_char_tokenizer
from tests.test_reward_trainer import _reward_model, letter_pairs

GLOBAL_PAIRS = 4
METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens")


def main(out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = build_char_tokenizer()
    args = RewardConfig(output_dir=out, use_cpu=True, report_to=[], max_steps=4, logging_steps=1,
                        per_device_train_batch_size=GLOBAL_PAIRS // world, gradient_accumulation_steps=1,
                        learning_rate=1e-3, lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True,
                        seed=11, gradient_checkpointing=False, bf16=False, center_rewards_coefficient=0.01)
    data = letter_pairs(16).add_column("margin", [0.1 * (i % 3) for i in range(16)])
    trainer = RewardTrainer(model=_reward_model(tok), args=args, train_dataset=data, processing_class=tok)
    param = next(trainer.actor.model.parameters())
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    if trainer.dims.is_main:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        result = {"losses": [h["loss"] for h in logs], **{k: [h[k] for h in logs] for k in METRICS},
                  "backend": trainer.backend.label, "world": trainer.dims.world_size, "dp_size": trainer.dims.dp_size,
                  "param_type": type(param).__name__}
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1])
    leave_together()
