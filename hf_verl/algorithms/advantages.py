"""Advantage estimators as pure tensor functions.

GRPO (Shao et al., 2024, "DeepSeekMath"): a completion's advantage is its reward minus the mean
reward of its group (the `num_generations` completions of one prompt), optionally divided by a
standard deviation. `scale_rewards` follows TRL: ``"group"`` divides by the group's std,
``"batch"`` by the std of the whole batch, ``"none"`` does not divide (Dr. GRPO, Liu et al., 2025).
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")


def grpo_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages.

    Args:
        rewards (`torch.Tensor` of shape `(N,)`): one reward per completion, groups contiguous
            (completions `g*G .. g*G+G-1` answer the same prompt).
        num_generations (`int`): group size `G`; `N` must be a multiple of it.
        scale_rewards (`str`): `"group"`, `"batch"` or `"none"`.
        eps (`float`): added to the std before dividing.

    Returns:
        `(advantages, group_std)`, both `(N,)`; `group_std` is each completion's group std
        (unbiased, as `torch.std`), used for the `frac_reward_zero_std` metric.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}.")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}."
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}.")
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    if num_generations > 1:
        group_std = grouped.std(dim=1).repeat_interleave(num_generations)
    else:
        group_std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (group_std + eps)
    elif scale_rewards == "batch":
        batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (batch_std + eps)
    return advantages, group_std


def gdpo_advantages(
    rewards_per_func: torch.Tensor, num_generations: int, weights=None, eps: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (TRL's `multi_objective_aggregation="normalize_then_sum"`): each reward function is normalised
    within its group, `z_k = (R_k - mean_group) / (std_group + eps)`; the weighted sum `r = sum_k w_k z_k`
    is then normalised over the batch, `A = (r - mean(r)) / (std(r) + eps)`. `scale_rewards` does not apply.

    Args:
        rewards_per_func (`torch.Tensor` `(N, K)`): rewards per function, NaN where a function returned None
            (ignored in the statistics); a row that is NaN for every function gets advantage 0.
        num_generations (`int`): group size; groups contiguous. weights (`Sequence[float]`, *optional*): one per
            function, default 1.

    Returns:
        `(advantages (N,), batch_std (N,))`: `batch_std` is the std of `r` broadcast (TRL's zero-std statistic).
    """
    n, k = rewards_per_func.shape
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"{n} rewards do not split into groups of num_generations={num_generations}.")
    w = rewards_per_func.new_ones(k) if weights is None else torch.as_tensor(
        list(weights), dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if w.numel() != k:
        raise ValueError(f"reward_weights has {w.numel()} entries but there are {k} reward functions.")
    grouped = rewards_per_func.view(-1, num_generations, k)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = _nanstd(grouped, dim=1) if num_generations > 1 else torch.zeros_like(mean)
    z = ((grouped - mean) / (std + eps)).view(n, k)
    unscorable = rewards_per_func.isnan().all(dim=1)
    r = (z * w).nansum(dim=1)
    r[unscorable] = float("nan")
    r_std = _nanstd(r.unsqueeze(0), dim=1).squeeze(0) if n > 1 else r.new_zeros(())
    advantages = torch.nan_to_num((r - torch.nanmean(r)) / (r_std + eps), nan=0.0)
    return advantages, r_std.expand(n)


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std over `dim` ignoring NaN (keepdim), NaN where fewer than 2 values."""
    count = (~x.isnan()).sum(dim=dim, keepdim=True)
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) / (count - 1)
    return var.sqrt()
