"""Loss aggregation modes (TRL's `loss_type`s and verl's `loss_agg_mode`s) and the PPO-clip loss.

Aggregation of a per-token loss `(B, T)` (or `(B, 1)`, broadcast over the tokens) under its 0/1 mask:

- ``grpo`` (verl ``seq-mean-token-mean``): average each sequence over its tokens, then over sequences.
- ``bnpo``: average over the tokens of the local (micro-)batch.
- ``dr_grpo`` (verl ``seq-mean-token-sum-norm``): the token sum divided by `B x max_completion_length`.
- ``dapo`` (verl ``token-mean``): the token sum divided by `normalizer`, the caller's count of completion
  tokens (the global batch's, per rank: averaging gradients over ranks then gives the global token mean).
- ``luspo`` (verl ``seq-mean-token-sum``): sum each sequence over its tokens, then average over sequences.

TRL's `loss_type` also picks the loss form (``cispo``, ``sapo``, ``vespo``); :data:`TRL_LOSS_TYPES` maps each
to `(policy loss, aggregation)`. The forms themselves are in :mod:`hf_verl.algorithms.policy_losses`.
"""

from __future__ import annotations

import torch

from hf_verl.algorithms.policy_losses import PolicyLossParams, clip_loss

AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
VERL_AGGREGATIONS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo",
                     "seq-mean-token-sum": "luspo"}
TRL_LOSS_TYPES = {"grpo": ("clip", "grpo"), "bnpo": ("clip", "bnpo"), "dr_grpo": ("clip", "dr_grpo"),
                  "dapo": ("clip", "dapo"), "luspo": ("clip", "luspo"), "cispo": ("cispo", "dapo"),
                  "sapo": ("sapo", "grpo"), "vespo": ("vespo", "dapo")}
LOSS_TYPES = tuple(TRL_LOSS_TYPES)


def resolve_aggregation(name: str) -> str:
    """An aggregation mode by hf_verl/TRL name or verl `loss_agg_mode`; a clear error otherwise."""
    if name in AGGREGATIONS:
        return name
    if name in VERL_AGGREGATIONS:
        return VERL_AGGREGATIONS[name]
    raise ValueError(f"unknown loss aggregation {name!r}; choose one of {AGGREGATIONS} (or verl's "
                     f"{tuple(VERL_AGGREGATIONS)}).")


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip loss and clip statistics (token-level `clip` of
    :mod:`~hf_verl.algorithms.policy_losses`, with clip-higher and dual clip).

    Returns:
        `(per_token_loss (B, T), stats)` where stats holds per-token float indicators
        `low_clip`, `high_clip`, `region_clip`, 0 off the mask.
    """
    params = PolicyLossParams(clip_low=epsilon_low, clip_high=epsilon_high, dual_clip=dual_clip)
    params.validate()
    loss, stats = clip_loss(logp, old_logp, advantages, mask, params)
    maskf = mask.to(loss.dtype)
    return loss, {k: v * maskf for k, v in stats.items()}


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int | None = None,
    normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce a `(B, T)` (or `(B, 1)`) per-token loss to a scalar per `loss_type`, one of `AGGREGATIONS` or
    TRL's loss types (see the module docstring)."""
    loss_type = TRL_LOSS_TYPES[loss_type][1] if loss_type in TRL_LOSS_TYPES else resolve_aggregation(loss_type)
    maskf = mask.to(per_token_loss.dtype)
    per_token_loss = per_token_loss.expand_as(maskf)
    total = (per_token_loss * maskf).sum()
    if loss_type == "grpo":
        per_seq = (per_token_loss * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)
        return per_seq.mean()
    if loss_type == "bnpo":
        return total / maskf.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length.")
        return total / (per_token_loss.shape[0] * max_completion_length)
    if loss_type == "dapo":
        if normalizer is None:
            raise ValueError("loss_type='dapo' needs the global completion-token count as normalizer.")
        return total / max(float(normalizer), 1.0)
    return (per_token_loss * maskf).sum(-1).mean()  # luspo


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1 (0 when the mask is empty)."""
    maskf = mask.to(values.dtype)
    return (values * maskf).sum() / maskf.sum().clamp(min=1.0)
