"""Padding-free rollouts on one process: the engine's log-prob forward and backward, padded against packed.

For each configuration (model width/depth, rows, prompt and completion length ranges) one seeded rollout
batch is scored by the training engine three ways, interleaved round by round: padded
(`padding_free=False`), packed (`True`) and the default (`None`, which packs when
`hf_verl.engine.hf_layouts.packing_pays`). Each line prints the padding per row, the median milliseconds per
forward+backward and the ratios against padded. The default should never be much slower than the better
of the two. Measure on a quiet machine.

Usage: python benchmarks/packing.py [--rounds 7]
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
from hf_verl.engine.accelerate_engine import AccelerateEngine
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims

# name, hidden, layers, vocab, rows, prompt range, completion range
CONFIGS = [
    ("short rows", 128, 2, 100, 16, (2, 6), (14, 16)),
    ("short, spread", 128, 2, 100, 16, (2, 6), (1, 16)),
    ("wide, medium", 256, 4, 100, 8, (10, 60), (30, 64)),
    ("long prompts", 128, 2, 100, 16, (50, 250), (20, 32)),
    ("deep, narrow", 128, 6, 8000, 8, (10, 40), (30, 48)),
    ("narrow, many rows", 64, 2, 8000, 32, (5, 20), (60, 128)),
    ("wide, long", 384, 2, 8000, 8, (20, 200), (20, 100)),
]


def _batch(rows, prompt, completion, vocab, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(*prompt))] for _ in range(rows)]
    completions = [[rng.randrange(2, vocab) for _ in range(rng.randint(*completion))] for _ in range(rows)]
    return RolloutBatch.from_lists(prompts, completions, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for name, hidden, layers, vocab, rows, prompt, completion in CONFIGS:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden,
                                             num_hidden_layers=layers, num_attention_heads=hidden // 32,
                                             num_key_value_heads=hidden // 64, vocab_size=vocab + 2))
        batch = _batch(rows, prompt, completion, vocab)
        engines = {mode: AccelerateEngine(model, role="actor", dims=ParallelDims(), backend=BackendSpec(),
                                          padding_free=mode) for mode in (False, True, None)}
        med = median_logprob_ms(model, engines, batch, a.rounds)
        mask = batch.attention_mask
        padding = (mask.numel() - int(mask.sum())) / rows
        print(f"{name:18s} h={hidden:3d} L={layers} rows={rows:2d} padding/row {padding:5.1f}: padded {med[False]:7.1f} ms, "
              f"packed {med[True]:7.1f} ms (x{med[False] / med[True]:.2f}), default {med[None]:7.1f} ms "
              f"(x{med[False] / med[None]:.2f})", flush=True)


if __name__ == "__main__":
    main()
