"""Run under `accelerate launch` with a sharded config: GRPO on FSDP2 / ZeRO-3 generating on one shared
`hf-verl serve`-style server (argv[2]). The main rank streams the gathered weights to the server, the
other rank walks the same buckets (gathering is a collective) and sends nothing. After training the
final weights are pushed once more and saved to argv[1]/final for the test to compare with the server.
"""

import json
import os
import sys

from datasets import Dataset

from hf_verl.trainers.grpo_config import GRPOConfig
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer
from tests.test_serve import _model


def count_a(completions, **kwargs):
    return [float(c.count("a")) + 0.1 * len(c) for c in completions]


def main(out: str, url: str) -> None:
    tok = build_char_tokenizer()
    args = GRPOConfig(output_dir=out, use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=5, learning_rate=1e-2,
                      gradient_checkpointing=False, save_strategy="no", disable_tqdm=True, use_vllm=True,
                      vllm_mode="server", vllm_server_base_url=url)
    trainer = GRPOTrainer(model=_model(tok, seed=0), reward_funcs=count_a, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 2}))
    trainer.train()
    trainer._sync_engine()  # the final weights onto the server
    trainer.save_model(os.path.join(out, "final"))
    if trainer.dims.is_main:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"backend": trainer.backend.label, "steps": trainer.state.global_step,
                       "max_logp_gap": max(h["sampling/sampling_logp_difference/max"] for h in logs)}, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1], sys.argv[2])
    leave_together()
