"""Weight sync from a sharded actor: extra trainer memory and time, bucketed vs gathering it whole.

Two processes (torchrun, gloo) hold a Qwen2 policy sharded by FSDP2 or partitioned by DeepSpeed
ZeRO-3, and push its full HF-named weights into the rollout engine every rank owns (a
`TransformersEngine` on an unsharded replica, which is what a sharded actor generates with). Two
ways, each in a fresh pair of processes:

- `bucketed`: hf_verl's `pipeline.sync.sync_weights`: the engine's export gathers one tensor at a
  time and the replica copies each bucket in place;
- `whole`: the baseline a simple implementation does: gather the whole state dict first (every
  tensor whole on every rank, all at once), then copy it in.

Measured per rank: wall time of the sync, and the extra resident memory it needed (peak RSS during
the sync, sampled every millisecond by a thread, minus RSS right before it; allocations over 64 KiB
are mmapped so that freed tensors leave RSS); the table shows the larger rank. A tensor is gathered
whole before it joins a bucket, so the bound is about one bucket being filled, the one being
consumed and the all-gather of the largest tensor (the embedding here).
Usage: python benchmarks/sharded_weight_sync.py [--sizes 50m,200m] [--backends fsdp2,zero3] [--bucket-mib 64]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import current_rss_mib  # noqa: E402

SIZES = {  # Qwen2 shapes (vocab 32000, untied head)
    "5m": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2),
    "50m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
    "200m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                 num_key_value_heads=8),
}


class PeakRss:
    """Samples RSS every millisecond in a thread while the block runs."""

    def __enter__(self):
        self.start, self.peak, self._stop = current_rss_mib(), 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_mib())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_mib())
        self.extra = self.peak - self.start


def child(backend: str, size: str, mode: str, bucket_mib: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_verl.engine.accelerate_engine import AccelerateEngine
    from hf_verl.parallel.backend import BackendSpec
    from hf_verl.parallel.dims import ParallelDims
    from hf_verl.pipeline.prefetch import frozen_copy
    from hf_verl.pipeline.sync import sync_weights
    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.parallel.weight_export import plain_state_items
    from tests.conftest import build_char_tokenizer

    if backend == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32000, tie_word_embeddings=False, **SIZES[size]))
    replica = TransformersEngine(frozen_copy(model), build_char_tokenizer())
    replica.bucket_bytes = bucket_mib * 2**20
    spec = BackendSpec("fsdp2") if backend == "fsdp2" else BackendSpec("deepspeed", zero_stage=3)
    dims = ParallelDims.data_parallel(dist.get_world_size(), dist.get_rank(), shard=True)
    engine = AccelerateEngine(model, role="actor", dims=dims, backend=spec, trainable=False)
    with torch.no_grad():  # the actor moves, so that the sync has something to carry
        for p in replica.model.parameters():
            p.zero_()
    dist.barrier()
    with PeakRss() as rss:
        t0 = time.perf_counter()
        if mode == "bucketed":
            sync_weights(engine, replica)
        else:  # every tensor gathered whole first (on every rank: each has an engine to fill), then copied
            whole = dict(plain_state_items(engine.model))
            replica.sync_weights(whole.items())
            del whole
        seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in replica.model.parameters())
    check = float(sum(p.double().sum() for p in replica.model.parameters()))
    result = {"seconds": seconds, "extra_mib": rss.extra, "params": params, "checksum": check,
              "model_mib": params * 4 / 2**20}
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()


def run(backend: str, size: str, mode: str, bucket_mib: int) -> dict:
    out = tempfile.mkdtemp()
    # allocations above 64 KiB are mmapped, so that freeing a tensor gives its pages back and RSS tracks
    # live memory (glibc's heap otherwise keeps freed chunks, and RSS shows a high-water mark)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29910",
           __file__, "--child", backend, size, mode, str(bucket_mib), out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["checksum"] == ranks[1]["checksum"], "ranks' replicas differ after the sync"
    return {"seconds": max(r["seconds"] for r in ranks), "extra_mib": max(r["extra_mib"] for r in ranks),
            "model_mib": ranks[0]["model_mib"], "checksum": ranks[0]["checksum"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="50m,200m")
    p.add_argument("--backends", default="fsdp2,zero3")
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        backend, size, mode, bucket, out = a.child
        child(backend, size, mode, int(bucket), out)
        return
    print(f"{'backend':8} {'size':6} {'model MiB':>9} {'mode':9} {'seconds':>8} {'extra MiB':>10} "
          f"{'extra/bucket':>12} {'extra/model':>11}")
    for backend in a.backends.split(","):
        for size in a.sizes.split(","):
            rows = {mode: run(backend, size, mode, a.bucket_mib) for mode in ("bucketed", "whole")}
            assert rows["bucketed"]["checksum"] == rows["whole"]["checksum"], "both ways must carry the same weights"
            for mode, r in rows.items():
                print(f"{backend:8} {size:6} {r['model_mib']:9.0f} {mode:9} {r['seconds']:8.2f} {r['extra_mib']:10.0f} "
                      f"{r['extra_mib'] / a.bucket_mib:12.2f} {r['extra_mib'] / r['model_mib']:11.2f}")
            b, w = rows["bucketed"], rows["whole"]
            print(f"{backend:8} {size:6} ratio bucketed/whole: time x{b['seconds'] / w['seconds']:.2f}, "
                  f"extra memory x{b['extra_mib'] / max(w['extra_mib'], 1e-9):.3f}")


if __name__ == "__main__":
    main()
