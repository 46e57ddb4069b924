"""Truncated / masked importance sampling between the rollout engine and the trainer.

An engine (vLLM, a remote server) samples with numerics that differ from the trainer's forward,
so the behaviour policy is not exactly the policy the trainer scores. With `old` the trainer's
log-probs of the sampled tokens and `sampling` the engine's, the per-token ratio is
`exp(old - sampling)`; sequence modes use the product over the sequence. `*_truncate` clamps the
ratio to `[clip_min, clip_max]` (truncated IS, Ionides 2008; as in TRL), `*_mask` zeroes it
outside that range (the sample leaves the loss).
"""

from __future__ import annotations

import math

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                       mode: str = "sequence_mask", clip_min: float | None = None, clip_max: float | None = 3.0,
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Weights for the per-token loss, `(B, T)` (token modes) or `(B, 1)` (sequence modes), and stats.

    Returns:
        `(weights, stats)` with TRL's metric names: `sampling/sampling_logp_difference/{mean,max}` (over
        masked tokens, absolute) and `sampling/importance_sampling_ratio/{min,mean,max}` (after clipping).
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; choose one of {IS_MODES}.")
    maskf = mask.to(old_logps.dtype)
    diff = torch.nan_to_num((old_logps - sampling_logps) * maskf, nan=0.0)
    log_ratio = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(log_ratio)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=None if clip_min is None else clip_min, max=None if clip_max is None else clip_max)
    else:
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    valid = mask.bool() if ratio.shape == mask.shape else mask.bool().any(-1, keepdim=True)
    abs_diff = diff.abs()[mask.bool()]
    r = ratio[valid] if valid.any() else ratio.new_ones(1)
    stats = {
        "sampling/sampling_logp_difference/mean": abs_diff.mean().item() if abs_diff.numel() else 0.0,
        "sampling/sampling_logp_difference/max": abs_diff.max().item() if abs_diff.numel() else 0.0,
        "sampling/importance_sampling_ratio/min": r.min().item(),
        "sampling/importance_sampling_ratio/mean": r.mean().item(),
        "sampling/importance_sampling_ratio/max": r.max().item(),
    }
    return ratio, stats
