"""Shared prompts on one process: the engine's log-prob forward and backward over a GRPO round (groups of
completions of one prompt) and a DPO batch (pairs), the prompt repeated per row against laid out once.

For each configuration (model width/depth, prompts x group size, prompt and completion length ranges) one seeded
batch is scored by the training engine, interleaved round by round:
- `padded` (`shared_prefix=False, padding_free=False`), the layout TRL runs;
- `packed` (`shared_prefix=False, padding_free=True`), padding-free rows;
- `shared` (`shared_prefix=True`), each prompt once;
- `default` (`shared_prefix=None, padding_free=None`), what the engine picks.
Each line prints the median milliseconds per forward+backward and the ratios against padded, and the cost
model's estimate (shared against the better of padded and packed) beside the measured ratio. Measure on a quiet
machine.

Usage: python benchmarks/prefix_sharing.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import median_logprob_ms

from hf_verl.data.batch import RolloutBatch
from hf_verl.data.prefix_sharing import (
    packed_cost,
    padded_cost,
    share_prefixes,
    sharing_cost,
)
from hf_verl.engine.accelerate_engine import AccelerateEngine
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims

# name, hidden, layers, vocab, prompts, group, prompt range, completion range
CONFIGS = [
    ("grpo g6-like", 128, 2, 100, 2, 8, (50, 250), (1, 32)),
    ("grpo g3-like", 256, 4, 100, 2, 4, (10, 60), (1, 64)),
    ("grpo g8-like", 128, 6, 8000, 1, 8, (10, 40), (1, 48)),
    ("grpo long prompt", 256, 4, 8000, 2, 8, (200, 400), (50, 100)),
    ("grpo short prompt", 128, 2, 100, 2, 8, (2, 6), (1, 16)),
    ("dpo pairs", 128, 2, 8192, 8, 2, (10, 60), (10, 60)),
    ("dpo long prompts", 256, 4, 8192, 4, 2, (100, 300), (20, 80)),
]
MODES = {"padded": (False, False), "packed": (False, True), "shared": (True, False), "default": (None, None)}


def _batch(prompts, group, prompt, completion, vocab, seed=0):
    rng = random.Random(seed)
    distinct = [[rng.randrange(2, vocab) for _ in range(rng.randint(*prompt))] for _ in range(prompts)]
    rows = [p for p in distinct for _ in range(group)]
    completions = [[rng.randrange(2, vocab) for _ in range(rng.randint(*completion))] for _ in rows]
    return RolloutBatch.from_lists(rows, completions, 0), rows, completions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for name, hidden, layers, vocab, prompts, group, prompt, completion in CONFIGS:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden,
                                             num_hidden_layers=layers, num_attention_heads=hidden // 32,
                                             num_key_value_heads=hidden // 64, vocab_size=vocab + 2))
        batch, rows, completions = _batch(prompts, group, prompt, completion, vocab)
        engines = {mode: AccelerateEngine(model, role="actor", dims=ParallelDims(), backend=BackendSpec(),
                                          shared_prefix=share, padding_free=pack)
                   for mode, (share, pack) in MODES.items()}
        med = median_logprob_ms(model, engines, batch, a.rounds)
        cost = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "kv_fraction": 0.5}
        estimate = sharing_cost(share_prefixes(rows, completions), **cost) / min(
            padded_cost(*batch.input_ids.shape, **cost),
            packed_cost([len(x) + len(y) for x, y in zip(rows, completions)], **cost))
        best = min(med["padded"], med["packed"])
        print(f"{name:18s} h={hidden:3d} L={layers} {prompts}x{group} prompt {prompt[0]}-{prompt[1]} completion "
              f"{completion[0]}-{completion[1]}: padded {med['padded']:7.1f} ms, packed {med['packed']:7.1f} ms, "
              f"shared {med['shared']:7.1f} ms (x{med['padded'] / med['shared']:.2f} vs padded, "
              f"x{best / med['shared']:.2f} vs the better; estimated cost {estimate:.2f}), default "
              f"{med['default']:7.1f} ms (x{med['padded'] / med['default']:.2f})", flush=True)


if __name__ == "__main__":
    main()
