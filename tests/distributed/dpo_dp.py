"""DPO under data parallelism: run with plain python (1 process, batch 4) or torchrun (2 x 2).

Writes `result<rank>.json` into argv[1]: the logged losses and a checksum of the final weights.
The default shuffled sampler (seeded with `seed`) deals the same global batches whatever the layout (the 2 processes'
batches of 2 are one process's batch of 4), so the results must match.
"""

import json
import os
import sys


from hf_verl.trainers.dpo_config import DPOConfig
from hf_verl.trainers.dpo_trainer import DPOTrainer
from tests.conftest import build_char_tokenizer
from tests.test_dpo_trainer import _data, _model


def main(out_dir: str, per_device: int, padding_free: bool) -> None:
    tok = build_char_tokenizer()
    args = DPOConfig(output_dir=out_dir, use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                     per_device_train_batch_size=per_device, learning_rate=1e-2, gradient_checkpointing=False,
                     save_strategy="no", disable_tqdm=True,
                     padding_free=padding_free, seed=0)
    trainer = DPOTrainer(model=_model(tok), args=args, train_dataset=_data(), processing_class=tok)
    trainer.train()
    rank = trainer.accelerator.process_index
    model = trainer.accelerator.unwrap_model(trainer.model)
    result = {"world": trainer.accelerator.num_processes,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "margins": [h["rewards/margins"] for h in trainer.state.log_history if "rewards/margins" in h],
              "checksum": sum(p.detach().double().abs().sum().item() for p in model.parameters())}
    with open(os.path.join(out_dir, f"result{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")
    leave_together()
