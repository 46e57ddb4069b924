"""Optimizer steps per second and peak memory: hf_verl's GRPOTrainer vs TRL's, same run.

Both trainers get the same tiny Qwen2 model (same seeded initialisation), tokenizer, prompts,
reward and config. Each timed run is a fresh subprocess of this script, so that its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, which sees torch's allocator, unlike tracemalloc)
belongs to one trainer alone. Memory is reported as the training delta (peak RSS at the end
minus the RSS right before ``train()``) and as the absolute peak. Runs of the two trainers are
interleaved to share the machine's noise. Needs `pip install trl==1.16.0` (benchmark only).
Usage: python benchmarks/grpo_step.py [--steps 20] [--repeats 2] [--with-generate]
(``--with-generate`` adds a third, interleaved contender: hf_verl rolling out with ``model.generate``.)
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import StepTimer, count_a, current_rss_mib, peak_rss_mib, tiny_qwen2  # noqa: E402
from tests.conftest import build_char_tokenizer  # noqa: E402




def common(out, steps):
    return dict(output_dir=out, use_cpu=True, report_to=[], max_steps=steps, logging_steps=1000,
                per_device_train_batch_size=16, num_generations=8, max_completion_length=16,
                learning_rate=1e-4, gradient_checkpointing=False, bf16=False, save_strategy="no",
                beta=0.0, disable_tqdm=True)




def child(which, steps):
    """One timed run in this (fresh) process; prints one JSON line."""
    if which.startswith("hf_verl"):
        from hf_verl import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    tok = build_char_tokenizer()
    model = tiny_qwen2(tok)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    ds = Dataset.from_dict({"prompt": ["reverse abcde", "what is 2+2?", "hello there", "count to 5"] * 64})
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(model=model, reward_funcs=count_a, args=GRPOConfig(**common(out, steps)),
                              train_dataset=ds, processing_class=tok, callbacks=[timer])
        if which == "hf_verl_generate":
            trainer.engine.use_generate = True  # the old model.generate rollout path
        rss0 = current_rss_mib()
        trainer.train()
        sps = timer.steps / (time.perf_counter() - timer.t0)
    peak = peak_rss_mib()
    print(json.dumps({"steps_per_s": sps, "peak_rss_mib": peak, "delta_mib": peak - rss0}))


def spawn(which, a):
    cmd = [sys.executable, __file__, "--child", which, "--steps", str(a.steps)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{which} run failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--with-generate", action="store_true",
                   help="also time hf_verl rolling out with model.generate (the pre-loop path)")
    p.add_argument("--child", choices=["hf_verl", "trl", "hf_verl_generate"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps)
    results = {"hf_verl": [], "trl": []}
    if a.with_generate:
        results["hf_verl_generate"] = []
    for _ in range(a.repeats):  # interleave to share the machine's noise
        for which in results:
            results[which].append(spawn(which, a))
            print(f"  run {which:16s} {json.dumps(results[which][-1])}", flush=True)
    best = {k: {"sps": max(r["steps_per_s"] for r in v),
                "delta": min(r["delta_mib"] for r in v),
                "peak": min(r["peak_rss_mib"] for r in v)} for k, v in results.items()}
    for k, b in best.items():
        print(f"{k:16s} steps/s {b['sps']:7.3f}   peak RSS delta {b['delta']:7.1f} MiB   "
              f"peak RSS {b['peak']:7.1f} MiB")
    t = best["trl"]

    def ratio(h, key):
        return f"x{h[key] / t[key]:.2f}" if t[key] > 0 else "n/a"

    for k, h in best.items():
        if k != "trl":
            print(f"ratio {k}/trl: steps/s {ratio(h, 'sps')}, peak RSS delta {ratio(h, 'delta')}, "
                  f"peak RSS {ratio(h, 'peak')}")


if __name__ == "__main__":
    main()
