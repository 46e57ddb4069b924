"""Peak host memory (RSS) per rank while loading a >= 200M-parameter model: sharded at 2 ranks against whole.

    python benchmarks/sharded_load.py                  # FSDP2 and ZeRO-3, a 220M-parameter Llama in fp32
    python benchmarks/sharded_load.py --backends fsdp2 --layers 24

Memory only (nothing is timed). A Llama config built in code is saved once with
`save_pretrained(safe_serialization=True)` under `--dir` (default /tmp/hf_verl_sharded_load_bench). Then, each
in fresh processes that import the same modules first:

- whole: one process, `AutoModelForCausalLM.from_pretrained(dir)`;
- today: 2 ranks (torchrun, gloo), each loads whole and the engine shards it (FSDP2 / ZeRO-3);
- sharded: 2 ranks, `load_sharded(dir, layout)` then the engine (the rank's shards read from the files).

After loading, each process reads every element of the weights it holds once (its shards, its partitions,
or the whole model): `from_pretrained` memory-maps the safetensors files and a page counts in RSS only once it
is read, so a whole load that is never used would show almost nothing. No forward runs (its gathered blocks
and activations are not loading). Each process reports its peak RSS (`VmHWM`) over its whole
life, and the peak above its RSS once the imports are done (the high-water mark is reset there through
/proc/self/clear_refs). The ratios compare the largest rank's peak with the whole load's. The model role is
the frozen reference (no optimizer, whose state would be allocated after loading).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

GIB = 1024**3


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _read_held_weights(model) -> float:
    """Read every element of the weights this process holds (its FSDP2 shards, its ZeRO-3 partitions, or the
    whole model): a memory-mapped load counts in RSS only once its pages are read."""
    from torch.distributed.tensor import DTensor

    total = 0.0
    for p in {id(p): p for p in model.parameters()}.values():
        held = p.to_local() if isinstance(p, DTensor) else getattr(p, "ds_tensor", p)
        total += float(held.detach().sum())  # no copy: a reduction in place
    return total


def child(mode: str, directory: str, backend: str, results: str) -> None:
    """One measured process: imports, reset the peak, load, report."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_verl.engine.registry import RoleLayout, make_engine
    from hf_verl.parallel.backend import BackendSpec
    from hf_verl.parallel.dims import ParallelDims
    from hf_verl.parallel.sharded_load import load_sharded

    if backend == "zero3":
        import deepspeed  # noqa: F401  (imported before measuring, in every mode)
    distributed = mode != "whole"
    if distributed:
        dist.init_process_group("gloo")
    _reset_peak()
    base = _status_kib("VmRSS")
    if distributed:
        spec = BackendSpec(kind="fsdp2") if backend == "fsdp2" else BackendSpec(kind="deepspeed", zero_stage=3)
        layout = RoleLayout(spec, ParallelDims.data_parallel(dist.get_world_size(), dist.get_rank(), shard=True))
        if mode == "sharded":
            model = load_sharded(directory, layout)
        else:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        model = make_engine(model, "reference", layout, trainable=False).model
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    checksum = _read_held_weights(model)
    if distributed:
        dist.barrier()
    peak = _status_kib("VmHWM")
    rss = _status_kib("VmRSS")
    rank = dist.get_rank() if distributed else 0
    with open(os.path.join(results, f"{mode}-{rank}.json"), "w") as f:
        json.dump({"mode": mode, "rank": rank, "peak": peak * 1024, "base": base * 1024, "after": rss * 1024,
                   "checksum": checksum}, f)
    if distributed:
        dist.destroy_process_group()


def save_model(directory: str, layers: int) -> int:
    """Save the benchmark Llama (hidden 1024, 16 heads, vocab 32000, untied) unless it is there; its parameters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False)
    marker = os.path.join(directory, "config.json")
    if os.path.exists(marker) and LlamaConfig.from_pretrained(directory).num_hidden_layers == layers:
        with torch.device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MMAP_THRESHOLD = 65536


def _run(cmd: list[str], results: str, mode: str, glibc_heap: bool = False) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not glibc_heap:
        # every block of 64 KiB or more is its own mapping, returned to the system when freed, so that the peak RSS
        # is the memory held at once (as benchmarks/sequence_parallel.py measures), not glibc's heap history
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    out = []
    for name in sorted(glob.glob(os.path.join(results, f"{mode}-*.json"))):
        with open(name) as f:
            out.append(json.load(f))
    return out


def measure(directory: str, backend: str, glibc_heap: bool = False) -> dict[str, dict]:
    me = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as results:
        common = ["--dir", directory, "--backends", backend, "--results", results]
        out = {"whole": _run([sys.executable, me, "--child", "whole", *common], results, "whole", glibc_heap)}
        for mode in ("today", "sharded"):
            out[mode] = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(_free_port()), me, "--child", mode, *common], results, mode,
                             glibc_heap)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/hf_verl_sharded_load_bench")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--backends", default="fsdp2,zero3")
    parser.add_argument("--child", choices=["whole", "today", "sharded"])
    parser.add_argument("--glibc-heap", action="store_true",
                        help=f"keep glibc's dynamic mmap threshold (by default MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}: "
                             "freed blocks go back to the system, so the peak is what is held at once)")
    parser.add_argument("--results", help="(internal) where a measured process writes its figures")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.dir, args.backends, args.results)
    params = save_model(args.dir, args.layers)
    print(f"model: Llama, {params / 1e6:.1f}M parameters, fp32 ({params * 4 / GIB:.2f} GiB of weights), "
          f"safetensors in {args.dir}; 2 ranks on gloo; "
          + ("glibc's default heap" if args.glibc_heap else f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"))
    print(f"{'backend':8} {'load':38} {'peak RSS GiB':>13} {'above imports GiB':>18}")
    for backend in args.backends.split(","):
        runs = measure(args.dir, backend, args.glibc_heap)
        rows = {}
        for mode, label in (("whole", "whole, one process"), ("today", "whole, then sharded (max of 2 ranks)"),
                            ("sharded", "sharded (max of 2 ranks)")):
            peak = max(r["peak"] for r in runs[mode])
            above = max(r["peak"] - r["base"] for r in runs[mode])
            rows[mode] = (peak, above)
            print(f"{backend:8} {label:38} {peak / GIB:13.2f} {above / GIB:18.2f}")
        ratio, ratio_above = (rows["sharded"][i] / rows["whole"][i] for i in (0, 1))
        print(f"{backend:8} {'ratio sharded / whole':38} {ratio:13.2f} {ratio_above:18.2f}")


if __name__ == "__main__":
    main()
