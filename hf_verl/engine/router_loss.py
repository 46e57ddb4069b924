"""The router load-balancing loss of a Mixture-of-Experts forward, taken over the tokens of every data-parallel rank.

transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE and the other families sharing Switch Transformer's
`load_balancing_loss_func`) return `aux_loss = num_experts * sum_e f_e * P_e` with `f_e` the share of the top-k
assignments of the (layer, token) pairs that go to expert `e` and `P_e` the mean router probability of `e`, both
over the forward's non-padding tokens. The product of two means is not linear in the tokens: the mean of each
rank's own loss, which is what data-parallel gradient averaging trains, is not the loss one process computes on the
global batch (measured on tiny Qwen3-MoE / Qwen2-MoE / Mixtral under DDP: aux losses off by up to 3e-2 and
weights by 5e-3 after 3 steps). :func:`global_load_balancing_loss` sums the counts, probability sums and token
counts over the data-parallel ranks (one all-reduce of `2 * num_experts + 1` numbers, without gradient), so every
rank gets the one-process value, and scales this rank's differentiable part by the number of ranks, so that the
gradient averaged over the ranks is the one-process gradient.

Departure from verl / TRL: both use each rank's (micro-batch's) own loss. Micro-batches of one rank are still
separate forwards, each with its own statistics, as on one process with gradient accumulation.
"""

from __future__ import annotations

import torch

from hf_verl.parallel import comm
from hf_verl.parallel.dims import ParallelDims


def expert_counts(config) -> tuple[int, int]:
    """`(num_experts, experts per token)` of a transformers MoE config (`num_experts` or Mixtral's
    `num_local_experts`, and `num_experts_per_tok`).

    Raises:
        ValueError: the config names neither.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        raise ValueError(f"{type(config).__name__} names no num_experts / num_local_experts and num_experts_per_tok: "
                         "hf_verl cannot average its router aux loss over data-parallel ranks; set "
                         "router_aux_loss_coef=0 or train on one process.")
    return int(experts), int(top_k)


def load_balancing_sums(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(assignments per expert, router probability per expert, token count)` summed over the layers' non-padding
    tokens, as transformers' `load_balancing_loss_func` accumulates them (float32); only the probabilities carry
    gradient."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        weights = torch.softmax(logits.to(device), dim=-1)
        selected = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        if mask is None:
            counts = counts + torch.bincount(selected, minlength=num_experts).float()
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            counts = counts.scatter_add(0, selected, mask.repeat_interleave(top_k))
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return counts, probs, rows


def global_load_balancing_loss(router_logits: tuple[torch.Tensor, ...], model_aux_loss: torch.Tensor, config,
                               attention_mask: torch.Tensor | None, dims: ParallelDims) -> torch.Tensor:
    """The load-balancing loss of the data-parallel ranks' tokens together (see the module docstring); a collective
    over the data-parallel group, so every rank calls it for the same forward.

    Args:
        router_logits (`tuple[torch.Tensor]`): the forward's `router_logits`, one `(tokens, num_experts)` per layer.
        model_aux_loss (`torch.Tensor`): the model's own `aux_loss` of this forward: this rank's loss recomputed
            from the sums must equal it (a family whose loss is another formula is refused, not averaged wrongly).
        config: the model's config (`num_experts` / `num_local_experts`, `num_experts_per_tok`).
        attention_mask (`torch.Tensor`, *optional*): the forward's `(B, S)` mask (padding excluded).
        dims ([`ParallelDims`]): the run's layout; with one data-parallel rank the model's loss is returned.

    Raises:
        ValueError: the model's `aux_loss` is not the load-balancing loss of its `router_logits`.
    """
    if dims.dp_size == 1:
        return model_aux_loss
    experts, top_k = expert_counts(config)
    counts, probs, rows = load_balancing_sums(router_logits, experts, top_k, attention_mask)
    local = experts * torch.sum(counts / rows * probs.detach() / rows)
    if not torch.allclose(local, model_aux_loss.detach().float(), rtol=1e-4, atol=1e-6):
        raise ValueError(f"{type(config).__name__}'s aux_loss ({model_aux_loss.item():.6g}) is not the load-balancing "
                         f"loss of its router_logits ({local.item():.6g}): hf_verl cannot average it over "
                         "data-parallel ranks as one process would; set router_aux_loss_coef=0 or train on one process.")
    total = comm.reduce(dims, torch.cat([counts, probs.detach(), rows.reshape(1)]), "sum")
    counts_all, probs_all, rows_all = total[:experts], total[experts:-1], total[-1]
    # the value is the global loss; the gradient is this rank's part times the ranks (averaged back by DP)
    probs_part = probs_all + dims.dp_size * (probs - probs.detach())
    return (experts * torch.sum(counts_all / rows_all * probs_part / rows_all)).to(model_aux_loss.dtype)
