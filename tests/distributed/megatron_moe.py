"""The Megatron engine on Mixture-of-Experts models against the HF model, under `torchrun` (TP / PP / EP from the
environment: `MEGATRON_TP`, `MEGATRON_PP`, `MEGATRON_EP`; at PP > 1 without the aux loss, which needs every layer
on one stage).

For each bridged MoE family (Qwen3-MoE; Qwen2-MoE with a gated shared expert, q/k/v biases and top-k without
renormalisation; Mixtral), a tiny model built in code (2 layers, 4 experts, top-2) is converted into a
:class:`~hf_verl.engine.megatron.MegatronEngine` on the launch's layout, and on each data-parallel rank's own
rollout (EP spans data-parallel ranks: the all-to-all dispatcher sends tokens between them):

- the engine's log-probs and entropies of a left- and right-padded rollout are compared with the HF model's;
- the router load-balancing loss the engine returns (`LogProbs(with_aux_loss=True)`) with the HF model's
  `aux_loss` (transformers' `load_balancing_loss_func` over the attention mask) of every data-parallel rank's rows
  together: the global batch's loss, as the accelerate engines take it;
- the engine's HF export (experts gathered over EP and TP) with the original weights, bit for bit;
- a frozen MoE critic's values (`AutoModelForSequenceClassification`, one label) with the HF model's;
- one `forward_backward` + `optimizer_step` of `-mean log-prob + 0.1 x aux loss` with the same step in HF (each
  micro-batch of every rank's rows in one forward: the ranks' log-prob terms averaged, as DDP averages gradients,
  plus the global aux loss) (loss, weights); at
  TP > 1 the engine runs Megatron's sequence parallelism (Megatron-Core trains an MoE under TP only so).

Every rank writes `OUT/rank{k}.json` with its worst differences per family.
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
from hf_verl.parallel.dims import ParallelDims
from hf_verl.parallel.megatron.launch import ensure_process_group

VOCAB = 61
FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"num_experts": 4, "moe_intermediate_size": 16, "head_dim": 8,
                                                "norm_topk_prob": True}),
    "qwen2_moe": (transformers.Qwen2MoeConfig, {"num_experts": 4, "moe_intermediate_size": 16,
                                                "shared_expert_intermediate_size": 24, "norm_topk_prob": False}),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "intermediate_size": 16,
                                             "sliding_window": None}),
}
AUX_COEF = 0.1


def config(family: str):
    cls, extra = FAMILIES[family]
    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False,
              num_experts_per_tok=2, router_aux_loss_coef=AUX_COEF)
    kw.update(extra)
    return cls(**kw)


def model(family: str, seed: int = 0, kind: str = "causal_lm"):
    torch.manual_seed(seed)
    cfg = config(family)
    if kind == "value":
        cfg.num_labels = 1
        hf = transformers.AutoModelForSequenceClassification.from_config(cfg).eval()
    else:
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # routers drawn wider than the default init, so that routing differs token by token
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return hf


def batch(seed: int = 1) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    B, P, C = 4, 4, 6
    prompt, completion = torch.randint(1, VOCAB, (B, P), generator=g), torch.randint(1, VOCAB, (B, C), generator=g)
    prompt_mask, completion_mask = torch.ones(B, P, dtype=torch.long), torch.ones(B, C, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    completion_mask[1, 3:] = 0  # right padding
    prompt[prompt_mask == 0] = 0
    completion[completion_mask == 0] = 0
    return RolloutBatch(prompt_ids=prompt, prompt_mask=prompt_mask, completion_ids=completion,
                        completion_mask=completion_mask)


def cat_batches(parts: list[RolloutBatch]) -> RolloutBatch:
    """Rows of several rollouts of one shape, one after the other."""
    fields = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    return RolloutBatch(**{f: torch.cat([getattr(p, f) for p in parts]) for f in fields})


def hf_forward(hf, b: RolloutBatch):
    """`(logp, entropy, aux_loss)` of the HF model as the accelerate engines get them."""
    ids, mask, select, targets = rollout_positions(b)
    out = hf(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), output_router_logits=True)
    logp = torch.log_softmax(out.logits.float(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return (scatter_completion(b, logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)[select]),
            scatter_completion(b, entropy[select]), out.aux_loss)


def hf_values(hf, b: RolloutBatch):
    ids, mask, select, _ = rollout_positions(b)
    out = hf.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).last_hidden_state
    return scatter_completion(b, hf.score(out)[..., 0][select])


def main(out: str) -> None:
    from hf_verl.engine.megatron import MegatronEngine

    ensure_process_group()
    tp, ep = int(os.environ.get("MEGATRON_TP", "1")), int(os.environ.get("MEGATRON_EP", "1"))
    pp = int(os.environ.get("MEGATRON_PP", "1"))
    dims = ParallelDims.data_parallel(dist.get_world_size(), dist.get_rank(), shard=False, tp=tp, pp=pp, ep=ep)
    aux, coef = pp == 1, AUX_COEF if pp == 1 else 0.0
    batches = [batch(seed=1 + d) for d in range(dims.dp_size)]  # each data-parallel rank its own rows
    b, everyone = batches[dims.dp_rank], cat_batches(batches)
    result = {}
    for family in FAMILIES:
        hf, ref = model(family), model(family)
        engine = MegatronEngine(hf, role="actor", dims=dims, trainable=True)
        # Adam's eps at 1e-6: a first step moves an entry by lr x g / (|g| + eps), so at the default 1e-8 an entry whose
        # gradient averages to ~1e-9 over the data-parallel ranks shows float rounding as a visible step difference
        engine.configure_optimizer(OptimizerSpec(torch.optim.AdamW, {"lr": 1e-2, "eps": 1e-6}, max_grad_norm=None))
        r = {}
        with torch.no_grad():
            want_lp, want_h, _ = hf_forward(ref, b)
            want_aux = hf_forward(ref, everyone)[2]
            got = engine.infer(b, LogProbs(with_entropy=True, with_aux_loss=aux), micro_batch=2)
            whole = engine.infer(b, LogProbs(with_aux_loss=aux))
        r["logprob"] = (got.logp - want_lp).abs().max().item()
        r["entropy"] = (got.entropy - want_h).abs().max().item()
        r["aux_loss"] = abs(whole.aux_loss.item() - want_aux.item()) if aux else 0.0
        r["aux_value"] = want_aux.item()
        exported = engine.full_state_dict()
        original = ref.state_dict()
        r["export_names"] = sorted(exported) == sorted(original)
        r["export"] = max((exported[k] - original[k]).abs().max().item() for k in exported)

        # one step: -mean log-prob of the completion tokens + coef x aux loss, two micro-batches averaged
        micro = [b.select(slice(0, 2)), b.select(slice(2, 4))]
        tokens = float(b.completion_mask.sum())
        counts = [float(x.completion_mask.sum()) for x in batches]

        def loss_fn(o, mb):
            return -(o.logp * mb.completion_mask).sum() / tokens + (coef * o.aux_loss / len(micro) if aux else 0.0), {}

        step = engine.forward_backward(micro, loss_fn, forward=LogProbs(with_aux_loss=aux))
        engine.optimizer_step()
        ref.train()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.0)
        losses = []
        for i in range(len(micro)):
            parts = [x.select(slice(2 * i, 2 * i + 2)) for x in batches]  # micro-batch i of every rank
            lp, _, aux_hf = hf_forward(ref, cat_batches(parts))
            terms = [-(lp[2 * d : 2 * d + 2] * part.completion_mask).sum() / n
                     for d, (part, n) in enumerate(zip(parts, counts))]
            (sum(terms) / len(terms) + coef * aux_hf / len(micro)).backward()
            losses.append((terms[dims.dp_rank] + coef * aux_hf / len(micro)).item())
        opt.step()
        r["loss"] = max(abs(a.item() - w) for a, w in zip(step.losses, losses))
        trained = engine.full_state_dict()
        r["weights"] = max((trained[k] - ref.state_dict()[k]).abs().max().item() for k in trained)
        r["worst"] = max(trained, key=lambda k: (trained[k] - ref.state_dict()[k]).abs().max().item())
        critic, critic_ref = model(family, seed=3, kind="value"), model(family, seed=3, kind="value")
        value_engine = MegatronEngine(critic, role="critic", dims=dims, trainable=False)
        with torch.no_grad():
            got_v = value_engine.infer(b, Values(), micro_batch=4)
            r["values"] = (got_v - hf_values(critic_ref, b)).abs().max().item()
        result[family] = r
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"tp": tp, "pp": pp, "ep": ep, "world": dist.get_world_size(), "dp_size": dims.dp_size,
                   "families": result}, f)


if __name__ == "__main__":
    main(sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()
