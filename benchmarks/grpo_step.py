"""Optimizer steps per second and peak memory: hf_verl's GRPOTrainer vs TRL's, same run.

Both trainers get the same tiny Qwen2 model (fresh copy of one initialisation), tokenizer,
prompts, reward and config. Needs `pip install trl==1.16.0` (a benchmark-only dependency).
Usage: python benchmarks/grpo_step.py [--steps 20] [--repeats 2]
"""

import argparse
import copy
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import build_char_tokenizer  # noqa: E402


def count_a(completions, **kwargs):
    return [float(c.count("a")) for c in completions]


class StepTimer(TrainerCallback):
    """Times steps after a warm-up step, so that one-off set-up is not counted."""

    def __init__(self):
        self.t0, self.steps = None, 0

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 1:
            self.t0 = time.perf_counter()
        elif self.t0 is not None:
            self.steps += 1


def common(out, steps):
    return dict(output_dir=out, use_cpu=True, report_to=[], max_steps=steps, logging_steps=1000,
                per_device_train_batch_size=16, num_generations=8, max_completion_length=16,
                learning_rate=1e-4, gradient_checkpointing=False, bf16=False, save_strategy="no",
                beta=0.0, disable_tqdm=True)


def run(which, model, tok, ds, steps):
    if which == "hf_verl":
        from hf_verl import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(model=model, reward_funcs=count_a, args=GRPOConfig(**common(out, steps)),
                              train_dataset=ds, processing_class=tok, callbacks=[timer])
        tracemalloc.start()
        trainer.train()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return timer.steps / (time.perf_counter() - timer.t0), peak / 2**20


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    base.generation_config.pad_token_id, base.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    ds = Dataset.from_dict({"prompt": ["reverse abcde", "what is 2+2?", "hello there", "count to 5"] * 64})
    results = {"hf_verl": [], "trl": []}
    for _ in range(a.repeats):  # interleave to share the machine's noise
        for which in results:
            results[which].append(run(which, copy.deepcopy(base), tok, ds, a.steps))
    best = {k: (max(s for s, _ in v), min(m for _, m in v)) for k, v in results.items()}
    for k, (sps, mem) in best.items():
        print(f"{k:8s} steps/s {sps:7.3f}   peak traced memory {mem:8.1f} MiB")
    print(f"ratio hf_verl/trl: steps/s x{best['hf_verl'][0] / best['trl'][0]:.2f}, "
          f"memory x{best['hf_verl'][1] / best['trl'][1]:.2f}  (maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
