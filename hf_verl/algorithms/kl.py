"""KL estimators between the policy and a reference, per token (Schulman, "Approximating KL").

With ``log_ratio = logp - ref_logp`` for tokens sampled from the policy:
``k1 = log_ratio`` (unbiased, can be negative), ``k2 = log_ratio**2 / 2`` (biased, low variance),
``k3 = exp(-log_ratio) - 1 + log_ratio`` (unbiased, non-negative; the one TRL's GRPO uses).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of `estimator` ("k1", "k2" or "k3"); same shape as the inputs."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}.")
