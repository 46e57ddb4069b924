"""Ulysses sequence parallelism on this machine: peak memory per rank and step time against sequence length.

For each sequence length, a fresh run trains one step (forward, token log-probs and entropy of one packed
row, backward) of a Qwen2 model built in code (hidden 512, 8 layers, 8 query / 2 key-value heads, vocabulary
8000, fp32; LM head in chunks of 256 positions, so that activations, not logits, fill the memory) through the training engine: at SP=1 as one process, at SP=2 as two processes under torchrun
(gloo) splitting the sequence. Each run reports its peak RSS (``ru_maxrss``, per rank: the larger of the two),
the RSS before the step (weights, optimizer state), the time of the step (best of ``--repeats`` after a
warm-up) and, at SP=2, the share of the step spent in the all-to-alls (timed around ``ulysses._all_to_all``).

The summary finds, for a memory cap (default: the peak RSS of SP=1 at the longest length that was run at
SP=1), the longest length that stays under it at SP=1 and at SP=2, and their ratio.

Second part (``--packing``): packed (padding-free) against padded log-probs + backward on a batch of rows
with a realistic spread of lengths (prompts 16-256 tokens, completions 16-1024), one process: tokens/s each.

Usage:
  python benchmarks/sequence_parallel.py [--lengths 1024,2048,4096,8192] [--sp2-lengths ...] [--repeats 3]
  python benchmarks/sequence_parallel.py --packing [--rows 32]
Measure on a quiet machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


MMAP_THRESHOLD = 65536


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _model(vocab=8000):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                                        attn_implementation="sdpa", tie_word_embeddings=False, pad_token_id=0))


def child(length: int, repeats: int, out: str, backend_kind: str = "ddp", optimizer: str = "sgd",
          checkpointing: bool = False) -> None:
    """One run (a single process, or one rank of a torchrun launch): prints/writes one JSON line per rank."""
    import torch
    import torch.distributed as dist

    from hf_verl.data.batch import RolloutBatch
    from hf_verl.engine.accelerate_engine import AccelerateEngine
    from hf_verl.parallel import ulysses
    from hf_verl.parallel.backend import BackendSpec
    from hf_verl.parallel.dims import ParallelDims

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    comm_s = [0.0]
    inner = ulysses._all_to_all

    def timed(*args, **kwargs):  # benchmark-only instrumentation: time spent in the all-to-alls
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            comm_s[0] += time.perf_counter() - t

    ulysses._all_to_all = timed
    kind = backend_kind if world > 1 else "plain"
    dims = ParallelDims.data_parallel(world, rank, shard=kind == "fsdp2", sp=world)
    backend = BackendSpec(kind)
    accelerator = None
    if kind == "ddp":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
    engine = AccelerateEngine(_model(), role="actor", dims=dims, backend=backend, accelerator=accelerator,
                              gradient_checkpointing=checkpointing)
    params = engine.module.parameters()
    engine.attach_optimizer(torch.optim.AdamW(params, lr=1e-4) if optimizer == "adamw"
                            else torch.optim.SGD(params, lr=1e-4))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 8000, (length // 4,), generator=g).tolist()
    completion = torch.randint(1, 8000, (length - len(prompt),), generator=g).tolist()
    batch = RolloutBatch.from_lists([prompt], [completion], pad_token_id=0)
    rss0 = _rss_mib()
    times, comms = [], []
    for _ in range(repeats + 1):
        comm_s[0] = 0.0
        t = time.perf_counter()
        logp, entropy = engine.logprobs(batch, with_entropy=True, chunk_size=256)
        loss = -(logp.sum() + 0.01 * entropy.sum()) / batch.completion_mask.sum()
        engine.backward(loss)
        engine.step(1.0)
        times.append(time.perf_counter() - t)
        comms.append(comm_s[0])
    best = min(range(1, len(times)), key=lambda i: times[i])
    row = {"length": length, "sp": world, "rank": rank, "step_s": times[best], "all_to_all_s": comms[best],
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_before_mib": rss0}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(row, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(length: int, sp: int, repeats: int, tmp: str, extra: list[str], glibc_heap: bool = False) -> dict:
    out = f"{tmp}/sp{sp}_{length}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // sp)))
    if not glibc_heap:
        # every block of 64 KiB or more is its own mapping, returned to the system when freed, so that the peak RSS
        # is the memory the step holds at once (what a GPU's allocator peak measures), not glibc's heap history
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    script = [str(Path(__file__).resolve()), "--child", str(length), "--repeats", str(repeats), "--out", out, *extra]
    if sp == 1:
        cmd = [sys.executable, *script]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(sp), "--master_port", str(port),
               *script]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"length": length, "sp": sp, "error": proc.stderr.strip().splitlines()[-1][:300]}
    rows = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(sp)]
    return {"length": length, "sp": sp, "step_s": max(r["step_s"] for r in rows),
            "all_to_all_s": max(r["all_to_all_s"] for r in rows),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rows),
            "rss_before_mib": max(r["rss_before_mib"] for r in rows)}


def packing(rows: int, repeats: int) -> None:
    """Packed vs padded: log-probs + backward over one batch with a spread of lengths, one process."""
    import random


    from hf_verl.data.batch import RolloutBatch
    from hf_verl.engine.accelerate_engine import AccelerateEngine
    from hf_verl.parallel.backend import BackendSpec
    from hf_verl.parallel.dims import ParallelDims

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 8000) for _ in range(rng.randint(16, 256))] for _ in range(rows)]
    completions = [[rng.randrange(1, 8000) for _ in range(rng.randint(16, 1024))] for _ in range(rows)]
    batch = RolloutBatch.from_lists(prompts, completions, pad_token_id=0)
    engine = AccelerateEngine(_model(), role="actor", dims=ParallelDims(), backend=BackendSpec())
    tokens = sum(map(len, prompts)) + sum(map(len, completions))
    padded_tokens = batch.input_ids.numel()

    def padded():
        logp, _ = engine.logprobs(batch)
        (-logp.sum()).backward()

    def packed():
        logp = engine.rows_logprobs(prompts, completions)
        (-logp.sum()).backward()

    results = {}
    for name, fn in (("padded", padded), ("packed", packed)) * (repeats + 1):
        t = time.perf_counter()
        fn()
        engine.module.zero_grad(set_to_none=True)
        results.setdefault(name, []).append(time.perf_counter() - t)
    best = {k: min(v[1:]) for k, v in results.items()}
    print(f"{rows} rows, {tokens} real tokens, padded to {padded_tokens} ({padded_tokens / tokens:.2f}x): "
          f"padded {tokens / best['padded']:.0f} tok/s, packed {tokens / best['packed']:.0f} tok/s, "
          f"packed/padded x{best['padded'] / best['packed']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="lengths run at SP=1")
    p.add_argument("--sp2-lengths", default=None, help="lengths run at SP=2 (default: --lengths plus 1.5x, 2x the "
                                                        "longest)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cap-mib", type=float, default=None)
    p.add_argument("--backend", choices=["ddp", "fsdp2"], default="ddp",
                   help="the layout of the SP=2 runs (FSDP2 also shards weights, gradients and optimizer state over "
                        "the two ranks); SP=1 is one plain process either way")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--glibc-heap", action="store_true",
                   help=f"keep glibc's default dynamic mmap threshold (by default the runs set MALLOC_MMAP_THRESHOLD_="
                        f"{MMAP_THRESHOLD}: with glibc's default, freed blocks of up to 32 MiB stay in the heap and the "
                        "peak RSS depends on the order of allocations more than on what the step holds)")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        child(a.child, a.repeats, a.out, a.backend, a.optimizer, a.checkpointing)
        return
    if a.packing:
        packing(a.rows, a.repeats)
        return
    import tempfile

    lengths = [int(x) for x in a.lengths.split(",")]
    sp2 = [int(x) for x in a.sp2_lengths.split(",")] if a.sp2_lengths else sorted(
        set(lengths) | {int(lengths[-1] * 1.5), lengths[-1] * 2})
    extra = ["--backend", a.backend, "--optimizer", a.optimizer] + (["--checkpointing"] if a.checkpointing else [])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for sp, todo in ((1, lengths), (2, sp2)):
            for length in todo:
                r = run(length, sp, a.repeats, tmp, extra, a.glibc_heap)
                results.append(r)
                if "error" in r:
                    print(f"SP={sp} length {length}: failed: {r['error']}", flush=True)
                    continue
                print(f"SP={sp} length {length:6d}: step {r['step_s']:.3f} s (all-to-all "
                      f"{100 * r['all_to_all_s'] / r['step_s']:.0f}%), peak RSS per rank {r['peak_rss_mib']:.0f} MiB "
                      f"(before the step {r['rss_before_mib']:.0f} MiB)", flush=True)
    ok = [r for r in results if "error" not in r]
    cap = a.cap_mib or max(r["peak_rss_mib"] for r in ok if r["sp"] == 1 and r["length"] == max(lengths))

    def longest(sp):
        fits = [r["length"] for r in ok if r["sp"] == sp and r["peak_rss_mib"] <= cap]
        return max(fits) if fits else 0

    l1, l2 = longest(1), longest(2)
    print(f"memory cap {cap:.0f} MiB per rank: longest length SP=1 {l1}, SP=2 {l2}: x{l2 / max(l1, 1):.2f}")


if __name__ == "__main__":
    main()
