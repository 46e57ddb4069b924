"""Megatron engine against the HF model, every bridged family, under `torchrun` (TP / PP from the environment).

For each family (Llama, Qwen2 with q/k/v biases and tied embeddings, Qwen3 with q/k norms, Mistral), a tiny
model built in code is converted into a :class:`~hf_verl.engine.megatron.MegatronEngine` on the launch's
layout (`MEGATRON_TP`, `MEGATRON_PP`), and:

- the engine's log-probs and entropies of a left- and right-padded rollout are compared with the HF model's
  (`log_softmax` of its logits), and a critic's values with `AutoModelForSequenceClassification`'s;
- the engine's HF export is compared with the original weights (names and values, bit for bit);
- one `forward_backward` + `optimizer_step` is compared with the same step in HF (loss, gradient norm, weights).

The main rank writes `OUT/result.json` with the worst differences per family.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import transformers

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.hf_layouts import position_ids_from_mask, rollout_positions, scatter_completion
from hf_verl.engine.step import LogProbs, OptimizerSpec, Values
from hf_verl.parallel.megatron.launch import ensure_process_group
from hf_verl.parallel.dims import ParallelDims

VOCAB = 61  # not a multiple of the padding unit: the padded rows must not count
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
}


def config(family: str):
    cls, extra = FAMILIES[family]
    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)
    kw.update(extra)
    return cls(**kw)


def model(family: str, kind: str = "causal_lm", seed: int = 0):
    torch.manual_seed(seed)
    cfg = config(family)
    if kind == "value":
        cfg.num_labels = 1
        return transformers.AutoModelForSequenceClassification.from_config(cfg).eval()
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    B, P, C = 4, 4, 6
    prompt, completion = torch.randint(1, VOCAB, (B, P), generator=g), torch.randint(1, VOCAB, (B, C), generator=g)
    prompt_mask, completion_mask = torch.ones(B, P, dtype=torch.long), torch.ones(B, C, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    completion_mask[1, 3:] = 0  # right padding
    prompt[prompt_mask == 0] = 0
    completion[completion_mask == 0] = 0
    return RolloutBatch(prompt_ids=prompt, prompt_mask=prompt_mask, completion_ids=completion,
                        completion_mask=completion_mask)


def hf_logprobs(hf, b: RolloutBatch):
    ids, mask, select, targets = rollout_positions(b)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits.float()
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return (scatter_completion(b, logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)[select]),
            scatter_completion(b, entropy[select]))


def hf_values(hf, b: RolloutBatch):
    ids, mask, select, _ = rollout_positions(b)
    out = hf.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).last_hidden_state
    return scatter_completion(b, hf.score(out)[..., 0][select])


def main(out: str) -> None:
    from hf_verl.engine.megatron import MegatronEngine

    ensure_process_group()
    tp, pp = int(os.environ.get("MEGATRON_TP", "1")), int(os.environ.get("MEGATRON_PP", "1"))
    dims = ParallelDims.data_parallel(dist.get_world_size(), dist.get_rank(), shard=False, tp=tp, pp=pp)
    b = batch()
    result = {}
    for family in FAMILIES:
        hf = model(family)
        ref = model(family)
        engine = MegatronEngine(hf, role="actor", dims=dims, trainable=True)
        engine.configure_optimizer(OptimizerSpec(torch.optim.AdamW, {"lr": 1e-2}, max_grad_norm=1.0))
        r = {}
        with torch.no_grad():
            want_lp, want_h = hf_logprobs(ref, b)
            got = engine.infer(b, LogProbs(with_entropy=True), micro_batch=2)
        r["logprob"] = (got.logp - want_lp).abs().max().item()
        r["entropy"] = (got.entropy - want_h).abs().max().item()
        exported = engine.full_state_dict()
        original = ref.state_dict()
        tied = {"lm_head.weight"} if ref.config.tie_word_embeddings else set()
        r["export_names"] = sorted(exported) == sorted(k for k in original if k not in tied)
        r["export"] = max((exported[k] - original[k]).abs().max().item() for k in exported)

        # one step: loss = -mean log-prob of the completion tokens, two micro-batches
        micro = [b.select(slice(0, 2)), b.select(slice(2, 4))]
        tokens = float(b.completion_mask.sum())

        def loss_fn(out, mb):
            return -(out.logp * mb.completion_mask).sum() / tokens, {}

        step = engine.forward_backward(micro, loss_fn, forward=LogProbs())
        norm = engine.optimizer_step()
        ref.train()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
        losses = []
        for mb in micro:
            lp, _ = hf_logprobs(ref, mb)
            loss = -(lp * mb.completion_mask).sum() / tokens
            loss.backward()
            losses.append(loss.item())
        want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
        opt.step()
        r["loss"] = max(abs(a.item() - w) for a, w in zip(step.losses, losses))
        r["grad_norm"] = abs(norm - want_norm)
        trained = engine.full_state_dict()
        r["weights"] = max((trained[k] - ref.state_dict()[k]).abs().max().item() for k in trained)

        critic, critic_ref = model(family, "value", seed=3), model(family, "value", seed=3)
        value_engine = MegatronEngine(critic, role="critic", dims=dims, trainable=False)
        with torch.no_grad():
            got_v = value_engine.infer(b, Values(), micro_batch=4)
            r["values"] = (got_v - hf_values(critic_ref, b)).abs().max().item()
        result[family] = r
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"tp": tp, "pp": pp, "world": dist.get_world_size(), "families": result}, f)


if __name__ == "__main__":
    main(sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()
