"""GRPO samples per second with long-tailed completion lengths: sync vs async vs async + in-flight updates with
rounds generated ahead (partial rollouts, continuous batching).

The policy is a tiny Llama (char tokenizer) first fine-tuned so that its completions are long-tailed, as RL
completions are: at temperature 1 about one in eight starts a pattern it never ends (it runs to the length limit)
and the rest answer in a few characters and stop. A synchronous round then decodes for the length limit while
most of its rows are done; asynchronous rollout overlaps that with training; in-flight updates with
`async_rollout_depth > 1` let the next rounds' rows join the running decode batch, so the tail of one round rides in
the same forwards as the bulk of the next.

Each run is a fresh process (one CPU thread for torch unless --threads), modes alternate pair by pair, the first
step is not timed; the printout has each run's samples/s, mean / max completion length and clipped ratio, then the
medians and the ratios to sync. Quiet machine only.

    python benchmarks/long_tail.py [--pairs 2] [--steps 16] [--depth 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKEN = "benchmark-token"
LONG = "xyz" * 100  # the pattern a long completion repeats (it has no end within the limit)
MODES = {
    "sync": {"use_async_rollout": False},
    "async": {"use_async_rollout": True, "max_staleness": 1},
    "async+in-flight": {"use_async_rollout": True, "in_flight_weight_updates": True, "max_staleness": 1},
    "async+in-flight+depth": {"use_async_rollout": True, "in_flight_weight_updates": True},  # depth set by --depth
}


def prompts(n: int) -> list[str]:
    return [f"q{i:02d}:" for i in range(n)]


def build_policy(out: Path, hidden: int, layers: int, long_fraction: float, seed: int = 0) -> None:
    """Fine-tune a tiny Llama to answer each prompt briefly, or (a `long_fraction` of the time) with a pattern it
    never ends; saved with its tokenizer to `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tok),
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    gen = torch.Generator().manual_seed(seed)
    letters = "abcdefgh"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    qs = prompts(64)
    for step in range(300):
        ids, labels = [], []
        for _ in range(32):
            q = qs[int(torch.randint(len(qs), (1,), generator=gen))]
            if float(torch.rand(1, generator=gen)) < long_fraction:
                answer, end = LONG[:140], []
            else:
                k = int(torch.randint(2, 6, (1,), generator=gen))
                answer = "".join(letters[int(i)] for i in torch.randint(len(letters), (k,), generator=gen))
                end = [tok.eos_token_id]
            p, c = tok.encode(q), tok.encode(answer) + end
            ids.append(p + c)
            labels.append([-100] * len(p) + c)
        width = max(map(len, ids))
        x = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in ids])
        y = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
        loss = model(input_ids=x, attention_mask=(y != -100) | (x != tok.pad_token_id), labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 100 == 0:
            print(f"  fine-tuning the long-tailed policy: step {step} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def start_server(a) -> tuple[subprocess.Popen, str]:
    """`hf-verl serve --continuous-batching` on the policy, one CPU thread, on a free port; returns it and its URL."""
    import os
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, HF_VERL_SERVE_TOKEN=TOKEN, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    server = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", a.model_dir, "--port", str(port),
                               "--continuous-batching"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ["HF_VERL_SERVE_TOKEN"] = TOKEN
    url = f"http://127.0.0.1:{port}"
    from hf_verl.rollout.remote import RemoteEngine

    RemoteEngine(url, max_retries=40, backoff_s=0.5).model  # noqa: B018 - waits until it serves
    return server, url


def run(mode: str, a) -> dict:
    """One GRPO run in this process; returns samples/s after the first step and the completion statistics."""
    from _common import StepTimer, count_a
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_verl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir)
    extra = dict(MODES[mode])
    if mode.endswith("+depth"):
        extra.update(async_rollout_depth=a.depth, max_staleness=a.depth)
    server = None
    if a.generator == "server":
        server, url = start_server(a)
        extra.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
    args = GRPOConfig(output_dir=f"{a.tmp}/{mode}", use_cpu=True, report_to=[], max_steps=a.steps + 1,
                      logging_steps=1, per_device_train_batch_size=a.batch, num_generations=a.group,
                      max_completion_length=a.tokens, learning_rate=1e-5, save_strategy="no", disable_tqdm=True,
                      seed=0, **extra)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=count_a, args=args, processing_class=tok, callbacks=[timer],
                          train_dataset=Dataset.from_dict({"prompt": prompts(64) * 8}))
    try:
        trainer.train()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    elapsed = time.perf_counter() - timer.t0
    logs = [h for h in trainer.state.log_history if "loss" in h][1:]
    mean = lambda k: statistics.fmean(h[k] for h in logs if k in h) if any(k in h for h in logs) else float("nan")
    return {"samples_s": timer.steps * a.batch / elapsed, "mean_length": mean("completions/mean_length"),
            "max_length": max(h["completions/max_length"] for h in logs), "clipped": mean("completions/clipped_ratio"),
            "staleness": mean("rollout/token_staleness_mean"), "reward": mean("reward"),
            "update_s": mean("timing_s/update"), "generate_s": mean("timing_s/generate"),
            "wait_s": mean("timing_s/rollout_wait")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=16, help="timed optimizer steps per run (after one warm-up step)")
    p.add_argument("--batch", type=int, default=32, help="completions per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--tokens", type=int, default=128, help="completion length limit")
    p.add_argument("--depth", type=int, default=4, help="async_rollout_depth of the last mode")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--long-fraction", type=float, default=0.12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--generator", default="local", choices=["local", "server"],
                   help="local: the trainer's transformers engine (async: its copy of the actor, on a thread); server: "
                        "`hf-verl serve --continuous-batching` in its own process, one thread (every mode)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--model-dir", default=None, help="a long-tailed policy saved by an earlier run (else built)")
    p.add_argument("--tmp", default="/tmp/hf_verl_long_tail")
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one run in this process (internal)
    a = p.parse_args()
    if a.run:
        print("RESULT " + json.dumps(run(a.run, a)), flush=True)
        return
    if a.model_dir is None:
        a.model_dir = f"{a.tmp}/policy-h{a.hidden}-l{a.layers}-f{a.long_fraction}"
        if not Path(a.model_dir, "config.json").exists():
            build_policy(Path(a.model_dir), a.hidden, a.layers, a.long_fraction)
    modes = a.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("run", "modes", "pairs")]
    for pair in range(a.pairs):
        for mode in modes:
            out = subprocess.run([sys.executable, __file__, f"--run={mode}", *passthrough], check=False, capture_output=True,
                                 text=True)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
            r = json.loads(line[-1][7:])
            results[mode].append(r)
            print(f"  pair {pair} {mode:22s} samples/s {r['samples_s']:7.2f}  completion mean {r['mean_length']:5.1f} "
                  f"max {r['max_length']:4.0f} clipped {r['clipped']:.2f}  token staleness {r['staleness']:.2f}  s/step: "
                  f"update {r['update_s']:.3f} generate {r['generate_s']:.3f} wait {r['wait_s']:.3f}",
                  flush=True)
    base = statistics.median(r["samples_s"] for r in results[modes[0]])
    print(f"\nbatch {a.batch} (groups of {a.group}), limit {a.tokens} tokens, {a.threads} trainer thread(s), "
          f"generator {a.generator}, depth {a.depth}; medians of {a.pairs} runs")
    for mode in modes:
        sps = [r["samples_s"] for r in results[mode]]
        print(f"{mode:22s} samples/s {statistics.median(sps):7.2f}  x{statistics.median(sps) / base:.2f} vs "
              f"{modes[0]}  (runs {', '.join(f'{s:.2f}' for s in sps)})")


if __name__ == "__main__":
    main()
