"""Delta against full weight sync, measured: GRPO on 2 gloo processes (DDP) generating on `hf-verl serve` (bf16
weights, transformers engine) through the remote engine, at TRL's default learning rate (1e-6), `weight_sync="full"`
against `weight_sync="delta"`: bytes per sync (what crossed the wire: the main rank's upload) and seconds per sync
(the trainer's `timing_s/weight_sync`), median over the syncs after the first (the first is full in both), and
whether the served weights equal the trained policy cast to bf16 at the end.

    python benchmarks/delta_sync.py [--hidden 512] [--layers 8] [--steps 6]

Time only on a quiet machine (two CPU-heavy processes on 2 cores slow each other down).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOKEN = "bench-token"


def model(tok, hidden: int, layers: int, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                        num_attention_heads=8, num_key_value_heads=4, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))


def worker(args) -> None:
    """One rank of the GRPO run (under torchrun)."""
    import torch
    from datasets import Dataset

    from hf_verl import GRPOConfig, GRPOTrainer
    from tests.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    policy = model(tok, args.hidden, args.layers, seed=0)
    config = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[], max_steps=args.steps,
                        logging_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                        learning_rate=1e-6, save_strategy="no", disable_tqdm=True, weight_sync=args.mode,
                        placement={"generator": args.url})
    trainer = GRPOTrainer(model=policy, reward_funcs=lambda completions, **kw: [float(c.count("a")) for c in
                                                                                completions],
                          args=config, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz", "hello", "ab"] * 8}))
    sent, engine = [], trainer.engine
    sync = engine.sync_weights

    def counting(named):
        pairs = list(named)
        sent.append(sum(t.numel() * t.element_size() for _, t in pairs))
        return sync(pairs)

    engine.sync_weights = counting
    trainer.train()
    seconds = [h["timing_s/weight_sync"] for h in trainer.state.log_history if "timing_s/weight_sync" in h]
    if int(os.environ.get("RANK", "0")) == 0:
        state = {k: v.to(torch.bfloat16) for k, v in policy.state_dict().items()}
        Path(args.out).write_text(json.dumps({"bytes": sent, "seconds": seconds}))
        torch.save(state, args.out + ".pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", default="full")
    parser.add_argument("--url", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.serve.server import RolloutServer
    from tests.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    results = {}
    for mode in ("full", "delta"):
        served = model(tok, args.hidden, args.layers, seed=1).to(torch.bfloat16)
        server = RolloutServer(TransformersEngine(served, tok), tok, "bench", port=0, token=TOKEN).start()
        out = os.path.join(tempfile.mkdtemp(), "result.json")
        try:
            env = {**os.environ, "HF_VERL_SERVE_TOKEN": TOKEN, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            subprocess.run(["torchrun", "--nproc_per_node", "2", "--master_port", "29531", __file__, "--worker",
                            "--mode", mode, "--url", server.address, "--out", out, "--hidden", str(args.hidden),
                            "--layers", str(args.layers), "--steps", str(args.steps)], check=True, env=env,
                           cwd=ROOT)
            result = json.loads(Path(out).read_text())
            trained = torch.load(out + ".pt")
            result["exact"] = all(torch.equal(served.state_dict()[k], v) for k, v in trained.items())
            results[mode] = result
        finally:
            server.shutdown()
    params = sum(p.numel() for p in model(tok, args.hidden, args.layers, 0).parameters())
    print(f"GRPO, 2 processes, {params / 1e6:.1f}M parameters, bf16 server, lr 1e-6, {args.steps} steps")
    print("| weight_sync | syncs | MB per sync (median after the first) | s per sync (median) | served == trained (bf16) |")
    print("|---|---|---|---|---|")
    for mode, r in results.items():
        later = r["bytes"][1:] or r["bytes"]
        print(f"| {mode} | {len(r['bytes'])} | {statistics.median(later) / 2**20:.2f} | "
              f"{statistics.median(r['seconds'][1:] or r['seconds']):.3f} | {r['exact']} |")
    full, delta = results["full"], results["delta"]
    print(f"bytes full/delta: x{statistics.median(full['bytes'][1:]) / max(statistics.median(delta['bytes'][1:]), 1):.1f}; "
          f"seconds full/delta: x{statistics.median(full['seconds'][1:]) / statistics.median(delta['seconds'][1:]):.2f}")


if __name__ == "__main__":
    main()
