"""The trainers' string path loads sharded: GRPO (2 steps) and DPO (1 step) from a saved model directory against
the same runs given the model loaded whole (as objects), on 2 processes.

`accelerate launch --config_file configs/accelerate/<fsdp2|zero3>_cpu.yaml -m tests.distributed.sharded_load_trainers
MODEL_DIR OUT`. Each trainer is built twice in this process: from `MODEL_DIR` (GRPO: `model=MODEL_DIR`; DPO:
`model=MODEL_DIR, ref_model=MODEL_DIR`) and from `from_pretrained` objects. The loader's INFO lines
(`hf_verl.parallel.sharded_load`) are collected per rank: each names the elements the rank read of the whole
model. The main rank writes `OUT/result.json`: per algorithm and load, the logged losses; the largest difference of
the final actor weights (gathered) between the two loads; each rank's loader lines.
"""

import json
import logging
import os
import sys

import torch
from datasets import Dataset

from tests.conftest import build_char_tokenizer

PROMPTS = ["abc", "xyz", "hello", "ab", "b", "cc", "dd", "e", "aa", "ba", "ca", "da"]


def count_a(completions, **kwargs):
    return [float(c.count("a")) + 0.1 * len(c) for c in completions]


def save_tiny_llama(directory: str, tok) -> None:
    """A 2-layer Llama over the char tokenizer's vocabulary, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), tie_word_embeddings=False,
                         max_position_embeddings=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _common(out: str, world: int) -> dict:
    return dict(output_dir=out, report_to=[], logging_steps=1, per_device_train_batch_size=8 // world,
                gradient_accumulation_steps=1, learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="no",
                disable_tqdm=True, seed=11, gradient_checkpointing=False, bf16=False)


def _grpo(model, out: str, world: int, tok):
    from hf_verl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(num_generations=4, max_completion_length=6, beta=0.05, temperature=1.0, max_steps=2,
                      per_row_sampling_seed=True, **_common(out, world))
    return GRPOTrainer(model=model, reward_funcs=count_a, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                       processing_class=tok)


def _dpo(model, ref_model, out: str, world: int, tok):
    from hf_verl import DPOConfig, DPOTrainer

    pairs = {"prompt": [p + "=" for p in PROMPTS], "chosen": [p[::-1] for p in PROMPTS],
             "rejected": [p + p for p in PROMPTS]}
    args = DPOConfig(max_length=32, beta=0.1, max_steps=1, **_common(out, world))
    return DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_dict(pairs),
                      processing_class=tok)


def _run(trainer) -> tuple[list[float], dict]:
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer.actor.full_state_dict()  # a collective: the main rank keeps the tensors


def main(model_dir: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    world = int(os.environ["WORLD_SIZE"])
    tok = build_char_tokenizer()
    handler = _Lines()
    logger = logging.getLogger("hf_verl.parallel.sharded_load")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    result: dict = {}

    def whole():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    for algo in ("grpo", "dpo"):
        runs = {}
        for load in ("sharded", "whole"):
            handler.lines.clear()
            if algo == "grpo":
                trainer = _grpo(model_dir if load == "sharded" else whole(), out, world, tok)
            else:
                trainer = (_dpo(model_dir, model_dir, out, world, tok) if load == "sharded"
                           else _dpo(whole(), whole(), out, world, tok))
            lines = list(handler.lines)  # what the construction loaded (before any step)
            digest = getattr(trainer, "_ref_digest", None)
            losses, weights = _run(trainer)
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, lines)
            runs[load] = {"losses": losses, "weights": weights, "lines": gathered, "digest": digest,
                          "backend": trainer.backend.label}
            del trainer
        entry = {load: {k: v for k, v in run.items() if k != "weights"} for load, run in runs.items()}
        if torch.distributed.get_rank() == 0:
            a, b = runs["sharded"]["weights"], runs["whole"]["weights"]
            entry["same_names"] = set(a) == set(b)
            entry["weight_diff"] = max(float((a[k] - b[k]).abs().max()) for k in b)
            entry["trained"] = max(float((b[k] - whole().state_dict()[k]).abs().max()) for k in b)
        result[algo] = entry
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1], sys.argv[2])
    leave_together()
