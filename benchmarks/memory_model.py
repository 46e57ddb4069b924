"""The planner's memory model against the measured peak RSS per rank, on this CPU.

Each configuration builds a Llama in code (fp32), lays it out through hf_verl's training engine (plain, DDP,
FSDP2, ZeRO-2/3, Ulysses SP, Megatron TP / PP; two processes over gloo where the layout needs them), and runs
`--steps` GRPO-shaped optimizer steps (a prompt + completion batch; the completion's log-probs and entropy in
checkpointed chunks, a policy-gradient loss, backward, clipping, AdamW), with a frozen reference model's log-probs
where the configuration has one. Each rank reports its peak RSS (`ru_maxrss`); the table compares the busiest
rank with `hf_verl.planner.estimate_memory`'s prediction for the same model, layout and batch (computed from the
model's config in the parent process, before any run: the prediction never sees a measurement).

`CHECK_CONFIGS` are the ones benchmarks/gpu_check.py runs on one process (`--device cuda`: the model on the GPU,
bf16 autocast, peak `torch.cuda.max_memory_allocated`), each compared with `hf_verl.planner.estimate_memory` of a
GRPOConfig asking for the same step (:func:`estimate`).

Usage:
  python benchmarks/memory_model.py                 # every configuration, the table of docs/planner.md
  python benchmarks/memory_model.py --only plain-s-256,ddp2-s-256
  python benchmarks/memory_model.py --baseline      # the runtime baseline constants (memory.RUNTIME_BASELINE_BYTES)
Peak RSS is a memory measurement: it does not depend on what else runs on the machine (no timing is reported).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# model name -> (hidden, layers, heads, kv heads, intermediate, vocab)
MODELS = {"xs": (64, 2, 4, 2, 128, 1000), "t": (256, 4, 4, 2, 688, 8000), "s": (512, 8, 8, 4, 1376, 16000),
          "m": (768, 10, 12, 4, 2048, 16000), "q05": (896, 24, 14, 2, 4864, 151_936)}  # q05: Qwen2.5-0.5B's shape
# name -> (model, layout kind, seq_len, rows per micro-batch, options)
CONFIGS = {
    "plain-t-128": ("t", "plain", 128, 4, {}),
    "plain-s-256": ("s", "plain", 256, 4, {}),
    "plain-s-1024": ("s", "plain", 1024, 2, {}),
    "plain-s-1024-ckpt": ("s", "plain", 1024, 2, {"ckpt": True}),
    "plain-s-256-ref": ("s", "plain", 256, 4, {"reference": True}),
    "plain-m-256": ("m", "plain", 256, 4, {}),
    "ddp2-s-256": ("s", "ddp", 256, 4, {}),
    "fsdp2-s-256": ("s", "fsdp2", 256, 4, {}),
    "fsdp2-m-256": ("m", "fsdp2", 256, 4, {}),
    "zero2-s-256": ("s", "zero2", 256, 4, {}),
    "zero3-s-256": ("s", "zero3", 256, 4, {}),
    "sp2-s-1024": ("s", "sp2", 1024, 2, {}),
    "tp2-s-256": ("s", "tp2", 256, 4, {}),
    "pp2-s-256": ("s", "pp2", 256, 4, {}),
}
# benchmarks/gpu_check.py: three one-process layouts the planner models (plain, activation checkpointing, a frozen
# reference beside the actor), on a 0.5B shape for one GPU and on the "t" model for its CPU mode
CHECK_CONFIGS = {
    "gpu-q05-512": ("q05", "plain", 512, 4, {}),
    "gpu-q05-1024-ckpt": ("q05", "plain", 1024, 4, {"ckpt": True}),
    "gpu-q05-512-ref": ("q05", "plain", 512, 4, {"reference": True}),
    "cpu-t-128": ("t", "plain", 128, 4, {}),
    "cpu-t-256-ckpt": ("t", "plain", 256, 4, {"ckpt": True}),
    "cpu-t-128-ref": ("t", "plain", 128, 4, {"reference": True}),
}
PROMPT = 32


def _spec(name: str):
    """(model, layout kind, seq_len, rows, options) of a configuration of CONFIGS or CHECK_CONFIGS."""
    return {**CONFIGS, **CHECK_CONFIGS}[name]


def _config(model: str):
    from transformers import LlamaConfig

    h, layers, heads, kv, inter, vocab = MODELS[model]
    return LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                       tie_word_embeddings=False, pad_token_id=0, attn_implementation="sdpa")


def _layout(kind: str, world: int, rank: int, ckpt: bool = False, rows: int = 1):
    """(RoleLayout for the engine, planner Layout for the prediction)."""
    from hf_verl.engine.registry import RoleLayout
    from hf_verl.parallel.backend import BackendSpec
    from hf_verl.parallel.dims import ParallelDims
    from hf_verl.planner import Layout

    def dp(shard, **axes):
        return ParallelDims.data_parallel(world, rank, shard=shard, **axes)

    if kind in ("tp2", "pp2"):
        from hf_verl.parallel.megatron.launch import MEGATRON_BACKEND

        tp, pp = (2, 1) if kind == "tp2" else (1, 2)
        return (RoleLayout(MEGATRON_BACKEND, dp(False, tp=tp, pp=pp), engine="megatron"),
                Layout(tp=tp, pp=pp, megatron=True, activation_checkpointing=ckpt, micro_batch_size=rows // pp))
    if kind == "sp2":
        return (RoleLayout(BackendSpec("ddp"), dp(False, sp=2)),
                Layout(sp=2, activation_checkpointing=ckpt, micro_batch_size=rows))
    backend = {"plain": BackendSpec(), "ddp": BackendSpec("ddp"), "fsdp2": BackendSpec("fsdp2"),
               "zero2": BackendSpec("deepspeed", zero_stage=2), "zero3": BackendSpec("deepspeed", zero_stage=3)}[kind]
    sharding = {"plain": "none", "ddp": "none", "fsdp2": "fsdp2", "zero2": "zero2", "zero3": "zero3"}[kind]
    return (RoleLayout(backend, dp(backend.shards)),
            Layout(dp=world, sharding=sharding, activation_checkpointing=ckpt, micro_batch_size=rows // world))


def child(a: argparse.Namespace) -> None:
    """One rank: build, lay out, run the steps, print this rank's peak as JSON (RSS; on a GPU, the allocator's)."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    from hf_verl.data.batch import RolloutBatch
    from hf_verl.engine.registry import make_engine
    from hf_verl.engine.step import LogProbs, OptimizerSpec

    model_name, kind, seq, rows, opts = _spec(a.config) if not a.baseline else ("xs", a.config, 64, 2, {})
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = a.device == "cuda"
    if gpu and kind != "plain":
        raise SystemExit(f"--device cuda runs the one-process layout (plain) only, not {kind}")
    if world > 1:
        if kind in ("tp2", "pp2"):
            from hf_verl.parallel.megatron.launch import ensure_process_group

            ensure_process_group()
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    layout, _ = _layout(kind, world, rank, opts.get("ckpt", False), rows)
    torch.manual_seed(0)
    config = _config(model_name)
    with torch.device(a.device):
        model = LlamaForCausalLM(config)
        reference = LlamaForCausalLM(config).requires_grad_(False) if opts.get("reference") else None
    local_rows = rows // layout.dims.dp_size
    g = torch.Generator().manual_seed(1)
    completion = seq - PROMPT
    batch = RolloutBatch(prompt_ids=torch.randint(1, config.vocab_size, (local_rows, PROMPT), generator=g),
                         prompt_mask=torch.ones(local_rows, PROMPT, dtype=torch.long),
                         completion_ids=torch.randint(1, config.vocab_size, (local_rows, completion), generator=g),
                         completion_mask=torch.ones(local_rows, completion, dtype=torch.long)).to(a.device)
    accelerator = Accelerator(cpu=not gpu)
    engine = make_engine(model, "actor", layout, accelerator=accelerator, trainable=True, micro_batch_size=local_rows,
                         max_grad_norm=1.0, gradient_checkpointing=opts.get("ckpt", False), bf16=gpu)
    ref_engine = None if reference is None else make_engine(reference, "reference", layout, accelerator=accelerator,
                                                            trainable=False, micro_batch_size=local_rows, bf16=gpu)
    del model, reference
    engine.configure_optimizer(OptimizerSpec(torch.optim.AdamW, {"lr": 1e-5}, max_grad_norm=1.0))
    pp = layout.dims.pp
    micro = [batch] if pp == 1 else [batch.select(slice(i, i + local_rows // pp)) for i in range(0, local_rows,
                                                                                           local_rows // pp)]
    tokens = float(batch.completion_mask.sum())
    request = LogProbs(chunk_size=1024, with_entropy=True)

    def loss_fn(out, mb):
        return -(out.logp * mb.completion_mask).sum() / tokens + 0.0 * out.entropy.sum(), {}

    for _ in range(a.steps):
        if ref_engine is not None:
            ref_engine.infer(batch, LogProbs(chunk_size=1024))
        engine.forward_backward(micro, loss_fn, forward=request)
        engine.optimizer_step()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = torch.cuda.max_memory_allocated() if gpu else rss  # on a GPU, what the caching allocator handed out
    print(json.dumps({"rank": rank, "peak": peak, "rss": rss, "params": sum(p.numel() for p in engine.model.parameters())}),
          flush=True)
    if world > 1:
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name: str, steps: int, baseline: bool = False, device: str = "cpu") -> list[int]:
    """Peak RSS of each rank of configuration `name` (bytes); with `baseline`, `name` is a layout kind run on the
    0.1M-parameter model. With `device="cuda"` (one-process layouts): the peak of `torch.cuda.max_memory_allocated`."""
    kind = name if baseline else _spec(name)[1]
    procs = 1 if kind == "plain" else 2
    args = [__file__, "--child", f"--config={name}", f"--steps={steps}", f"--device={device}"] + (
        ["--baseline"] if baseline else [])
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(_free_port())] if procs > 1 else []) + args
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               TMPDIR=tempfile.gettempdir(), TOKENIZERS_PARALLELISM="false")
    if device == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    from _common import json_objects

    return [obj["peak"] for obj in json_objects(proc.stdout) if "peak" in obj]


def predict(name: str):
    """The memory model's per-rank estimate for configuration `name` (from the config alone)."""
    from hf_verl.planner import Workload, memory_breakdown
    from hf_verl.planner.architectures import from_config

    model_name, kind, seq, rows, opts = CONFIGS[name]
    world = 1 if kind == "plain" else 2
    _, layout = _layout_for_prediction(kind, world, opts.get("ckpt", False), rows)
    arch = from_config(_config(model_name), source=f"benchmark model {model_name}")
    work = Workload(seq_len=seq, scored_len=seq - PROMPT)
    est = memory_breakdown(arch, layout, work)
    if opts.get("reference"):
        est = est + memory_breakdown(arch, layout, Workload(seq_len=seq, scored_len=seq - PROMPT, trainable=False),
                                     role="reference")
    return arch, layout, est


def estimate(name: str, device: str = "cpu"):
    """`hf_verl.planner.estimate_memory` for one-process configuration `name`: its model config, and a GRPOConfig
    asking for the child's step (rows = `per_device_train_batch_size`, a `PROMPT`-token prompt and the rest of
    `seq_len` completion, checkpointing, a reference through `beta > 0`; bf16 on a GPU, as the child runs)."""
    from hf_verl import GRPOConfig
    from hf_verl.planner import Layout, estimate_memory

    model_name, kind, seq, rows, opts = _spec(name)
    if kind != "plain":
        raise ValueError(f"estimate() takes one-process configurations, not {kind}")
    gpu, ckpt = device == "cuda", opts.get("ckpt", False)
    args = GRPOConfig(output_dir=tempfile.gettempdir(), use_cpu=not gpu, bf16=gpu, report_to=[],
                      per_device_train_batch_size=rows, num_generations=rows, max_prompt_length=PROMPT,
                      max_completion_length=seq - PROMPT, gradient_checkpointing=ckpt,
                      beta=0.04 if opts.get("reference") else 0.0)
    return estimate_memory(_config(model_name), args, Layout(activation_checkpointing=ckpt, micro_batch_size=rows),
                           device=device)


def _layout_for_prediction(kind, world, ckpt, rows):
    from hf_verl.planner import Layout

    if kind in ("tp2", "pp2"):
        tp, pp = (2, 1) if kind == "tp2" else (1, 2)
        return None, Layout(tp=tp, pp=pp, activation_checkpointing=ckpt, micro_batch_size=rows // pp)
    if kind == "sp2":
        return None, Layout(sp=2, activation_checkpointing=ckpt, micro_batch_size=rows)
    sharding = {"plain": "none", "ddp": "none", "fsdp2": "fsdp2", "zero2": "zero2", "zero3": "zero3"}[kind]
    return None, Layout(dp=world, sharding=sharding, activation_checkpointing=ckpt, micro_batch_size=rows // world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--baseline", action="store_true", help="measure the runtime baseline (a 0.1M model)")
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--child", action="store_true")
    p.add_argument("--config", default="plain-t-128")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the child runs (cuda: plain only)")
    a = p.parse_args()
    if a.child:
        child(a)
        return
    if a.baseline:
        for kind in ("plain", "ddp", "zero2", "tp2"):
            print(f"runtime baseline ({kind}, 0.1M-parameter model, one step): "
                  f"{max(measure(kind, 1, True)) / 2**20:.0f} MiB per rank", flush=True)
        return
    names = [n for n in a.only.split(",") if n] or list(CONFIGS)
    rows = []
    print(f"{'configuration':<20} {'params':>7} {'layout':<44} {'predicted':>10} {'measured':>10} {'error':>7}")
    for name in names:
        arch, layout, est = predict(name)
        measured = max(measure(name, a.steps))
        err = (est.peak_bytes - measured) / measured
        rows.append({"config": name, "params": arch.params, "layout": layout.label, "predicted": est.peak_bytes,
                     "measured": measured, "error": err})
        print(f"{name:<20} {arch.params / 1e6:>6.1f}M {layout.label:<44} {est.peak_bytes / 2**20:>8.0f}Mi "
              f"{measured / 2**20:>8.0f}Mi {100 * err:>+6.1f}%", flush=True)
    errs = [abs(r["error"]) for r in rows]
    print(f"median |error| {100 * statistics.median(errs):.1f}%, max |error| {100 * max(errs):.1f}% "
          f"over {len(rows)} configurations")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
