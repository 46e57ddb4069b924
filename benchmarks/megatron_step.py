"""Megatron-Core layouts on this machine: time of one RL optimizer step, peak memory per rank, weight-export time.

Each run builds a Qwen2 model in code (fp32), puts it on one layout through the training engine of hf_verl, and
times one optimizer step of a GRPO-shaped batch (`--rows` completions, a `--prompt`-token prompt and a
`--completion`-token completion each; forward, vocabulary-parallel log-probs and entropy, backward, clipping and
Adam) as the median of `--repeats` steps after a warm-up step; then the HF export of the whole model
(`export_weights`, 64 MiB buckets: the weight sync to a rollout engine), and the peak RSS of the busiest rank.

Layouts (the same global batch in each):
  plain      one process, the accelerate engine (the baseline of the ratios)
  mcore-tp1  one process, the Megatron engine
  mcore-tp2  two processes (torchrun, gloo), tensor parallel
  mcore-pp2  two processes, pipeline parallel (two micro-batches, 1F1B)
  ddp2       two processes, the accelerate engine under DDP (each rank half of the rows)

With `--device cuda` (benchmarks/gpu_check.py: plain and mcore-tp1 on one GPU) the model starts on the GPU, the
step's time ends at a `torch.cuda.synchronize()`, and `peak_gpu_mib` is `torch.cuda.max_memory_allocated`.

Usage:
  python benchmarks/megatron_step.py [--hidden 512 --layers 8] [--rows 8 --prompt 32 --completion 224]
      [--layouts plain,mcore-tp1,mcore-tp2,mcore-pp2,ddp2] [--repeats 3] [--device cpu|cuda]
Measure on a quiet machine only (two CPU-heavy processes slow each other down many times over on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = {"plain": (1, None), "mcore-tp1": (1, (1, 1)), "mcore-tp2": (2, (2, 1)), "mcore-pp2": (2, (1, 2)),
           "ddp2": (2, None)}


def _model(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    heads = max(hidden // 64, 2)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                                        max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
                                        attn_implementation="sdpa"))


def child(a: argparse.Namespace) -> None:
    """One rank of a layout: prints one JSON line."""
    import torch
    import torch.distributed as dist

    from hf_verl.data.batch import RolloutBatch
    from hf_verl.engine.registry import RoleLayout, make_engine
    from hf_verl.engine.step import LogProbs, OptimizerSpec
    from hf_verl.parallel.backend import BackendSpec
    from hf_verl.parallel.dims import ParallelDims
    from hf_verl.parallel.megatron.launch import ensure_process_group

    _, megatron = LAYOUTS[a.layout]
    ensure_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    rows = a.rows // world if megatron is None else a.rows  # DDP splits the rows; TP / PP ranks share them
    batch = RolloutBatch(prompt_ids=torch.randint(1, a.vocab, (rows, a.prompt), generator=g),
                         prompt_mask=torch.ones(rows, a.prompt, dtype=torch.long),
                         completion_ids=torch.randint(1, a.vocab, (rows, a.completion), generator=g),
                         completion_mask=torch.ones(rows, a.completion, dtype=torch.long)).to(a.device)
    model = _model(a.hidden, a.layers, a.vocab).to(a.device)
    params = sum(p.numel() for p in model.parameters())
    if megatron is None:
        dims = ParallelDims.data_parallel(world, rank, shard=False, device_type=a.device)
        layout = RoleLayout(BackendSpec("ddp" if world > 1 else "plain"), dims)
    else:
        from hf_verl.parallel.megatron.launch import MEGATRON_BACKEND

        dims = ParallelDims.data_parallel(world, rank, shard=False, device_type=a.device, tp=megatron[0],
                                          pp=megatron[1])
        layout = RoleLayout(MEGATRON_BACKEND, dims, engine="megatron")
    from accelerate import Accelerator

    engine = make_engine(model, "actor", layout, accelerator=Accelerator(cpu=a.device == "cpu"), trainable=True,
                         micro_batch_size=rows, max_grad_norm=1.0)
    del model
    engine.configure_optimizer(OptimizerSpec(torch.optim.AdamW, {"lr": 1e-5}, max_grad_norm=1.0))
    micro = [batch] if megatron is None or megatron[1] == 1 else [batch.select(slice(0, rows // 2)),
                                                                   batch.select(slice(rows // 2, rows))]
    tokens = float(batch.completion_mask.sum())
    request = LogProbs(chunk_size=256, with_entropy=True)

    def loss_fn(out, mb):
        return -(out.logp * mb.completion_mask).sum() / tokens + 0.0 * out.entropy.sum(), {}

    times = []
    for i in range(a.repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        engine.forward_backward(micro, loss_fn, forward=request)
        engine.optimizer_step()
        if a.device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    exported = sum(t.numel() for bucket in engine.export_weights(64 << 20) for _, t in bucket)
    export_s = time.perf_counter() - t0
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        gpu_peak = torch.cuda.max_memory_allocated() / 2**20 if a.device == "cuda" else None
        print(json.dumps({"layout": a.layout, "world": world, "params": params, "exported": exported,
                          "step_s": statistics.median(times), "export_s": export_s, "peak_rss_mib": peak.item(),
                          "peak_gpu_mib": gpu_peak}), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(a: argparse.Namespace, layout: str) -> dict:
    procs, _ = LAYOUTS[layout]
    args = [f"--{k}={v}" for k, v in vars(a).items() if k not in ("layouts", "child", "layout")]
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port",
                               str(_free_port())] if procs > 1 else []) + [__file__, "--child", f"--layout={layout}", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // procs)),
               TMPDIR=tempfile.gettempdir())
    if a.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode:
        raise RuntimeError(f"{layout} failed:\n{proc.stderr[-3000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def parser() -> argparse.ArgumentParser:
    """This script's options (also how benchmarks/gpu_check.py sets up a run)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--completion", type=int, default=224)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one-process layouts on the GPU")
    p.add_argument("--child", action="store_true")
    p.add_argument("--layout", default="plain")
    return p


def main() -> None:
    a = parser().parse_args()
    if a.child:
        child(a)
        return
    results = [run(a, layout) for layout in a.layouts.split(",")]
    base = results[0]
    print(f"model: hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab} ({base['params'] / 1e6:.1f}M "
          f"parameters); batch: {a.rows} rows x ({a.prompt} + {a.completion}) tokens; baseline {base['layout']}")
    print(f"{'layout':<10} {'procs':>5} {'step s':>8} {'x base':>7} {'export s':>9} {'peak RSS MiB/rank':>18} {'x base':>7}")
    for r in results:
        print(f"{r['layout']:<10} {r['world']:>5} {r['step_s']:>8.3f} {r['step_s'] / base['step_s']:>7.2f} "
              f"{r['export_s']:>9.3f} {r['peak_rss_mib']:>18.0f} {r['peak_rss_mib'] / base['peak_rss_mib']:>7.2f}")


if __name__ == "__main__":
    main()
