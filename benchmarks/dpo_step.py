"""Optimizer steps per second and peak memory: hf_verl's DPOTrainer vs TRL's, same run.

Both trainers get the same tiny Qwen2 model (hidden 128, 2 layers, same seeded initialisation),
the same word-level tokenizer (a synthetic vocabulary of 8192 words, large enough that the LM head
matters), the same 512 synthetic prompt/chosen/rejected rows (10-60 words each, so no pair reaches
max_length) and the same config (batch 8, lr 1e-5, max_length 128, sigmoid loss, fp32, CPU, seed 0).
Each timed run is a fresh subprocess of this script, so that its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, which sees torch's allocator) belongs to one trainer
alone. Memory is reported as the training delta (peak RSS at the end minus the RSS right before
``train()``) and as the absolute peak. Runs are interleaved over ``--repeats`` to share the
machine's noise. Needs `pip install trl==1.16.0` (benchmark only).

Contenders: hf_verl padded, hf_verl ``padding_free=True``, TRL padded. TRL 1.16 disables
``padding_free`` (it warns and falls back to padding), so "trl_padding_free" is only run with
``--with-trl-padding-free`` (it then times TRL's padded path a second time).

Usage: python benchmarks/dpo_step.py [--steps 30] [--repeats 2] [--profile hf_verl|trl]
(``--profile NAME`` runs one child under cProfile and prints the top functions by cumulative time.)
"""

import argparse
import copy
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from datasets import Dataset
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import StepTimer, current_rss_mib, peak_rss_mib, tiny_qwen2  # noqa: E402
from tests.conftest import CHAT_TEMPLATE  # noqa: E402

VOCAB_WORDS = 8192
CONTENDERS = ("hf_verl", "hf_verl_padding_free", "trl", "trl_padding_free")


def build_word_tokenizer(words: int = VOCAB_WORDS):
    """Word-level tokenizer over ``w0 .. w{words-1}`` (whitespace split), with <pad> and <eos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(words)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_dataset(n=512, seed=0):
    rng = random.Random(seed)

    def text(lo=10, hi=60):
        return " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(rng.randint(lo, hi)))

    rows = [{"prompt": text(), "chosen": " " + text(), "rejected": " " + text()} for _ in range(n)]
    return Dataset.from_list(rows)



def common(out, steps, padding_free):
    return dict(output_dir=out, use_cpu=True, report_to=[], max_steps=steps, logging_steps=1000,
                per_device_train_batch_size=8, learning_rate=1e-5, max_length=128, loss_type=["sigmoid"],
                gradient_checkpointing=False, bf16=False, save_strategy="no", disable_tqdm=True,
                padding_free=padding_free, seed=0, dataloader_num_workers=0)




def build_trainer(which, steps, out, callbacks):
    if which.startswith("hf_verl"):
        from hf_verl import DPOConfig, DPOTrainer
    else:
        from trl import DPOConfig, DPOTrainer
    tok = build_word_tokenizer()
    model = tiny_qwen2(tok, tie_word_embeddings=False)
    ref_model = copy.deepcopy(model)  # TRL would reload it from model's path, which a built model has not
    args = DPOConfig(**common(out, steps, which.endswith("padding_free")))
    return DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=build_dataset(), processing_class=tok,
                      callbacks=callbacks)


def child(which, steps):
    """One timed run in this (fresh) process; prints one JSON line."""
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(which, steps, out, [timer])
        rss0 = current_rss_mib()
        trainer.train()
        sps = timer.steps / (time.perf_counter() - timer.t0)
    peak = peak_rss_mib()
    print(json.dumps({"run": which, "steps_per_s": sps, "peak_rss_mib": peak, "delta_mib": peak - rss0}))


def profile(which, steps):
    """cProfile of `train()` for one contender (set-up excluded); top 40 by cumulative time."""
    import cProfile
    import pstats

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(which, steps, out, [])
        prof = cProfile.Profile()
        prof.enable()
        trainer.train()
        prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def spawn(which, a):
    cmd = [sys.executable, __file__, "--child", which, "--steps", str(a.steps)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{which} run failed:\n{res.stderr[-4000:]}")
    line = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(line), flush=True)
    return line


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--with-trl-padding-free", action="store_true",
                   help="also run TRL with padding_free=True (TRL 1.16 falls back to padding)")
    p.add_argument("--profile", choices=CONTENDERS, help="cProfile one contender instead of benchmarking")
    p.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps)
    if a.profile:
        return profile(a.profile, a.steps)
    names = ["hf_verl", "hf_verl_padding_free", "trl"] + (["trl_padding_free"] if a.with_trl_padding_free else [])
    results = {k: [] for k in names}
    for _ in range(a.repeats):  # interleave to share the machine's noise
        for which in results:
            results[which].append(spawn(which, a))
    best = {k: {"sps": max(r["steps_per_s"] for r in v),
                "delta": min(r["delta_mib"] for r in v),
                "peak": min(r["peak_rss_mib"] for r in v)} for k, v in results.items()}
    for k, b in best.items():
        print(f"{k:22s} steps/s {b['sps']:7.3f}   peak RSS delta {b['delta']:7.1f} MiB   "
              f"peak RSS {b['peak']:7.1f} MiB")

    def ratio(h, t, key):
        return f"x{h[key] / t[key]:.2f}" if t[key] > 0 else "n/a"

    t_pf = best.get("trl_padding_free", best["trl"])
    for ours, theirs, tb in (("hf_verl", "trl", best["trl"]),
                             ("hf_verl_padding_free", "trl_padding_free" if "trl_padding_free" in best else "trl", t_pf)):
        h = best[ours]
        print(f"ratio {ours}/{theirs}: steps/s {ratio(h, tb, 'sps')}, peak RSS delta {ratio(h, tb, 'delta')}, "
              f"peak RSS {ratio(h, tb, 'peak')}")


if __name__ == "__main__":
    main()
