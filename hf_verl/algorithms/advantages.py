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
