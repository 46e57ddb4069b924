"""End-to-end samples per second of GRPO with asynchronous vs synchronous rollout.

Generation runs in a separate server process (`hf-verl serve`, one CPU thread) and training in
this process (one CPU thread), so on a 2-core machine the two can overlap. The same tiny Llama,
prompts, reward and config are used for both modes; runs are interleaved and each mode is timed
after one warm-up step. The printout shows the measured generate and update times per step, so
the setting's balance (the regime async rollout is for: generation and update of similar cost)
can be checked. Usage: python benchmarks/async_rollout.py [--steps 12] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import StepTimer, count_a  # noqa: E402
from tests.conftest import build_char_tokenizer  # noqa: E402

TOKEN = "benchmark-token"




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(tok, hidden, layers):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))


def run(mode_async: bool, url: str, tok, a, out) -> tuple[float, float, float]:
    from hf_verl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=out, use_cpu=True, report_to=[], max_steps=a.steps + 1, logging_steps=1,
                      per_device_train_batch_size=a.batch, num_generations=8, max_completion_length=a.tokens,
                      learning_rate=1e-4, gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                      use_vllm=True, vllm_mode="server", vllm_server_base_url=url, use_async_rollout=mode_async)
    ds = Dataset.from_dict({"prompt": ["reverse abcde", "what is 2+2?", "hello there", "count to 5"] * 64})
    timer = StepTimer()
    trainer = GRPOTrainer(model=build(tok, a.hidden, a.layers), reward_funcs=count_a, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    elapsed = time.perf_counter() - timer.t0
    logs = [h for h in trainer.state.log_history if "loss" in h][1:]
    gen = [h["timing_s/generate"] for h in logs if "timing_s/generate" in h]
    upd = [h["timing_s/update"] for h in logs if "timing_s/update" in h]
    return timer.steps * a.batch / elapsed, sum(gen) / max(len(gen), 1), sum(upd) / max(len(upd), 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="completions per step")
    p.add_argument("--tokens", type=int, default=24, help="max completion tokens")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        build(tok, a.hidden, a.layers).save_pretrained(f"{tmp}/model")
        tok.save_pretrained(f"{tmp}/model")
        port = free_port()
        env = dict(os.environ, HF_VERL_SERVE_TOKEN=TOKEN, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        server = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", f"{tmp}/model", "--port", str(port)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.environ["HF_VERL_SERVE_TOKEN"] = TOKEN
        url = f"http://127.0.0.1:{port}"
        try:
            from hf_verl.rollout.remote import RemoteEngine

            RemoteEngine(url, max_retries=20, backoff_s=0.5).model  # wait until it serves
            best = {}
            for _ in range(a.repeats):
                for mode in (False, True):
                    sps, gen, upd = run(mode, url, tok, a, f"{tmp}/out")
                    name = "async" if mode else "sync"
                    print(f"  run {name:5s}  samples/s {sps:7.2f}   generate {gen:.3f} s/round   update {upd:.3f} s/step",
                          flush=True)
                    if sps > best.get(name, (0,))[0]:
                        best[name] = (sps, gen, upd)
        finally:
            server.terminate()
            server.wait(timeout=30)
    for name, (sps, gen, upd) in best.items():
        print(f"{name:5s}  samples/s {sps:7.2f}")
    print(f"ratio async/sync: samples/s x{best['async'][0] / best['sync'][0]:.2f}")


if __name__ == "__main__":
    main()
