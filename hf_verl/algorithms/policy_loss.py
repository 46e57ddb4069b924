"""PPO-clip policy loss (with clip-higher and dual-clip) and the loss aggregation modes.

PPO clip (Schulman et al., 2017) with an asymmetric range ``[1 - epsilon_low, 1 + epsilon_high]``
(clip-higher, DAPO: Yu et al., 2025) and, optionally, dual clip (Ye et al., 2020): for negative
advantages the loss is also capped at ``-dual_clip * A``.

Aggregation (`loss_type`, TRL's meanings): ``grpo`` averages each sequence over its tokens, then
over sequences; ``bnpo`` averages over the tokens of the local batch; ``dr_grpo`` divides the
token sum by ``batch_size * max_completion_length``; ``dapo`` divides by the number of
completion tokens of the whole global batch (passed as `normalizer`).
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip loss and clip statistics.

    Args:
        logp, old_logp (`torch.Tensor` `(B, T)`): current and behaviour log-probs of the tokens.
        advantages (`torch.Tensor` `(B,)` or `(B, T)`): per-sequence or per-token advantages.
        mask (`torch.Tensor` `(B, T)`): 1 on completion tokens.
        epsilon_low (`float`): lower clip range. epsilon_high (`float`, *optional*): upper clip
            range, defaults to `epsilon_low`.
        dual_clip (`float`, *optional*): dual-clip constant `c > 1`; `None` disables it.

    Returns:
        `(per_token_loss (B, T), stats)` where stats holds per-token float indicators
        `low_clip`, `high_clip`, `region_clip` (masked statistics are the caller's job).
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}.")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if dual_clip is not None:
        capped = torch.min(loss, -dual_clip * advantages)
        loss = torch.where(advantages < 0, capped, loss)
    maskf = mask.to(loss.dtype)
    low = ((ratio < 1.0 - epsilon_low) & (advantages < 0)).to(loss.dtype) * maskf
    high = ((ratio > 1.0 + epsilon_high) & (advantages > 0)).to(loss.dtype) * maskf
    return loss, {"low_clip": low, "high_clip": high, "region_clip": torch.clamp(low + high, max=1)}


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int | None = None,
    normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce a `(B, T)` per-token loss to a scalar per `loss_type` (see the module docstring)."""
    maskf = mask.to(per_token_loss.dtype)
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
    raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}.")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1 (0 when the mask is empty)."""
    maskf = mask.to(values.dtype)
    return (values * maskf).sum() / maskf.sum().clamp(min=1.0)
