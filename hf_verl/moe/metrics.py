"""Routing metrics of a Mixture-of-Experts forward, as pure functions of routing records.

Logged names (stable; the trainers add them to the actor's step metrics when the actor is an MoE model):

- `moe/expert_load_cv`: the coefficient of variation (std / mean) of tokens per expert, averaged over layers
  (0 = perfectly balanced); `moe/expert_load_cv/layer_<i>` per layer.
- `moe/expert_load_max`: the busiest expert's tokens over the mean per expert, averaged over layers.
- `moe/routing_agreement`: of the (token, layer) pairs the rollout recorded, the fraction the training forward's
  router sends to the same experts on its own (1.0 = rollout and training route alike), whether or not replay
  then overrides it.
- `moe/routing_agreement_tokens`: the fraction of those tokens routed alike in every layer.
- `moe/replayed_tokens`: the fraction of the forward's tokens routed by the rollout's record (0 without replay).
"""

from __future__ import annotations

import torch

ROUTING_METRICS = ("moe/expert_load_cv", "moe/expert_load_max", "moe/routing_agreement",
                   "moe/routing_agreement_tokens", "moe/replayed_tokens")


def expert_load(routing: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert per layer, `(layers, num_experts)`, of the tokens `mask` selects from `routing`
    `(N, layers, top_k)`."""
    chosen = routing[mask.bool()]  # (n, L, k)
    layers = routing.shape[1]
    load = torch.zeros(layers, num_experts, dtype=torch.float64, device=routing.device)
    if chosen.numel():
        flat = chosen.permute(1, 0, 2).reshape(layers, -1).clamp(min=0)
        load.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float64))
    return load


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`(..., top_k)` x 2 -> `(...)` bool: the two choices name the same set of experts."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def routing_metrics(natural: torch.Tensor, mask: torch.Tensor, num_experts: int, *,
                    recorded: torch.Tensor | None = None, replayed: bool = False) -> dict[str, float]:
    """The metrics of the module docstring for one forward.

    Args:
        natural (`torch.Tensor` `(N, layers, top_k)`): the experts the forward's routers chose on their own.
        mask (`torch.Tensor` `(N,)`): the real tokens (padding excluded).
        num_experts (`int`): experts per layer.
        recorded (`torch.Tensor` `(N, layers, top_k)`, *optional*): the rollout's record (-1: none).
        replayed (`bool`): whether the forward routed by `recorded`.
    """
    mask = mask.bool().to(natural.device)
    used = natural
    out: dict[str, float] = {}
    if recorded is not None:
        recorded = recorded.to(device=natural.device, dtype=natural.dtype)
        has = (recorded >= 0).all(dim=-1) & mask[:, None]  # (N, L)
        if replayed:
            used = torch.where(has[..., None], recorded, natural)
        pairs = int(has.sum())
        if pairs:
            alike = same_experts(natural, recorded) & has
            out["moe/routing_agreement"] = float(alike.sum()) / pairs
            tokens = has.all(dim=-1) & mask
            if int(tokens.sum()):
                out["moe/routing_agreement_tokens"] = float((alike.all(dim=-1) & tokens).sum() / tokens.sum())
        out["moe/replayed_tokens"] = float(has.all(dim=-1).sum()) / max(int(mask.sum()), 1) if replayed else 0.0
    load = expert_load(used, mask, num_experts)
    mean = load.mean(dim=1)
    if bool((mean > 0).all()):
        cv = load.std(dim=1, unbiased=False) / mean
        out["moe/expert_load_cv"] = float(cv.mean())
        out["moe/expert_load_max"] = float((load.max(dim=1).values / mean).mean())
        for layer, value in enumerate(cv.tolist()):
            out[f"moe/expert_load_cv/layer_{layer}"] = value
    return out
