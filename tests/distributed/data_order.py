"""DPO for 4 steps with the default shuffled sampler, recording the rows each rank trains on.

Run alone (`python -m tests.distributed.data_order OUT`) it is the one-process baseline (per-device batch 4); under
torchrun with ORDER_SP=2 (Ulysses) or ORDER_MEGATRON="tp,pp" (backend="megatron") on 2 processes it is one
data-parallel rank of the same per-device batch. Every rank writes `OUT/rank<r>.json`: per step the prompts of the
rows it trained on (each prompt is unique), the logged losses and mean chosen log-probs, and its data-parallel size.
Nothing reseeds the global RNG between the trainer's construction and `train()`, as in a user's script.
"""

import json
import os
import sys

from datasets import Dataset

from tests.conftest import build_char_tokenizer
from tests.distributed.parity import tiny_qwen2

SP = int(os.environ.get("ORDER_SP", "1"))
MEGATRON = tuple(int(x) for x in os.environ["ORDER_MEGATRON"].split(",")) if os.environ.get("ORDER_MEGATRON") else None


def main(out: str) -> None:
    from hf_verl import DPOConfig, DPOTrainer
    from hf_verl.trainers.dpo_trainer import _split_rows

    tok = build_char_tokenizer()
    words = [f"{a}{b}" for a in "abcd" for b in "wxyz"]  # 16 unique prompts
    data = Dataset.from_dict({"prompt": [w + "=" for w in words], "chosen": [w[::-1] for w in words],
                              "rejected": [w + w for w in words]})
    extra = {"sequence_parallel_size": SP} if SP > 1 else {}
    if MEGATRON:
        extra.update(backend="megatron", tensor_model_parallel_size=MEGATRON[0],
                     pipeline_model_parallel_size=MEGATRON[1])
    args = DPOConfig(output_dir=out, use_cpu=True, report_to=[], max_steps=4, logging_steps=1,
                     per_device_train_batch_size=4, gradient_accumulation_steps=1, learning_rate=1e-3,
                     lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True, seed=11,
                     gradient_checkpointing=False, bf16=False, max_length=32, beta=0.1, **extra)
    trainer = DPOTrainer(model=tiny_qwen2(tok), args=args, train_dataset=data, processing_class=tok)
    steps = []
    train_window = trainer._train_window

    def record(window):
        rows = []
        for batch in window:
            prompts, _ = _split_rows(batch)  # chosen rows, then rejected rows
            rows += [tok.decode(p) for p in prompts[: len(prompts) // 2]]
        steps.append(rows)
        return train_window(window)

    trainer._train_window = record
    trainer.train()
    logs = trainer.state.log_history
    with open(os.path.join(out, f"rank{trainer.dims.rank}.json"), "w") as f:
        json.dump({"steps": steps, "dp_size": trainer.dims.dp_size,
                   "losses": [h["loss"] for h in logs if "loss" in h],
                   "chosen_logps": [h["logps/chosen"] for h in logs if "logps/chosen" in h]}, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1])
    leave_together()
