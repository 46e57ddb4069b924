"""Bytes per weight sync of a PEFT LoRA actor: adapter-only (`weight_sync="adapter"`) against merged (`"auto"`).

Counts what each sync hands the rollout engine, from the actor's own export (`export_weights(lora="adapter")` /
`lora="merged"`, the tensors :mod:`hf_verl.pipeline.sync` streams), at the actor's dtype. The model is built from a
config on the meta device (no weights are allocated), so the 0.5B shape costs nothing; bytes do not depend on the
machine, so this runs anywhere. Prints one JSON line per model.

    python benchmarks/adapter_sync_bytes.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_QWEN_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
SHAPES = {  # name -> (Qwen2Config fields, LoRA rank, target modules)
    "test model (tests/test_adapter_sync.py)": (
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 51}, 4, ["q_proj", "v_proj"]),
    "Qwen2.5-0.5B shape, r=16 on every linear layer": (
        _QWEN_05B, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "Qwen2.5-0.5B shape, r=16 on q_proj / v_proj": (_QWEN_05B, 16, ["q_proj", "v_proj"]),
}


def count(pairs_iter) -> int:
    return sum(t.numel() * t.element_size() for part in pairs_iter for _, t in part)


def main() -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_verl.parallel.weight_export import iter_weight_buckets

    for name, (fields, rank, targets) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            with torch.device("meta"):
                model = Qwen2ForCausalLM(Qwen2Config(**fields)).to(dtype)
                actor = get_peft_model(model, LoraConfig(r=rank, target_modules=targets))
            adapter = count(iter_weight_buckets(actor, lora="adapter"))
            merged = count(iter_weight_buckets(actor, lora="merged"))
            print(json.dumps({"model": name, "dtype": str(dtype).removeprefix("torch."), "adapter_bytes": adapter,
                              "merged_bytes": merged, "ratio": round(merged / adapter, 1)}))


if __name__ == "__main__":
    main()
