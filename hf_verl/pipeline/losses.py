"""The losses of a micro-batch: the clipped policy loss (with KL, entropy and importance terms) and
the clipped value loss, composed from :mod:`hf_verl.algorithms` once for every front-end.

Both aggregate per-token terms with :func:`~hf_verl.algorithms.policy_loss.aggregate_loss`; the
`normalizer` of the token-mean modes is given by the caller (the trainers pass the global token count
of the step divided by the data-parallel size, so that averaging gradients over ranks gives the
token mean of the global batch, whatever the layout). Every term is linear in the per-token values,
so a KL term aggregated on its own equals the same term added per token (TRL's order). The entropy bonus
is a token mean whatever the aggregation (TRL's), over `entropy_normalizer` tokens.

Returned statistics are detached scalars; each front-end logs them under its own metric names.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.policy_loss import TRL_LOSS_TYPES, aggregate_loss, masked_mean
from hf_verl.algorithms.policy_losses import (
    PolicyLossParams,
    high_entropy_mask,
    log_importance_weights,
    off_policy_sequence_mask,
)
from hf_verl.algorithms.registry import POLICY_LOSSES, resolve_policy_loss
from hf_verl.data.batch import RolloutBatch


def loss_form(config: Any) -> str:
    """The loss form a config asks for: `policy_loss` (hf_verl's or verl's name) when set, else the form TRL's
    `loss_type` implies (``clip`` for the aggregation-only types)."""
    if getattr(config, "policy_loss", None) is not None:
        return resolve_policy_loss(config.policy_loss)
    loss_type = getattr(config, "loss_type", "dapo")
    return TRL_LOSS_TYPES[loss_type][0] if loss_type in TRL_LOSS_TYPES else "clip"


def loss_params(config: Any) -> PolicyLossParams:
    """The :class:`PolicyLossParams` of a config, GRPO-style (`epsilon`, `epsilon_high`) or PPO-style
    (`cliprange`, `cliprange_high`); fields a config lacks keep their defaults."""
    if hasattr(config, "epsilon"):
        low, high = config.epsilon, getattr(config, "epsilon_high", None)
    else:
        low, high = config.cliprange, getattr(config, "cliprange_high", None)
    defaults = PolicyLossParams()
    names = ("dual_clip", "delta", "importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg",
             "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    return PolicyLossParams(clip_low=low, clip_high=high,
                            **{n: getattr(config, n, getattr(defaults, n)) for n in names})


def policy_loss(logp: torch.Tensor, batch: RolloutBatch, *, loss: str = "clip",
                params: PolicyLossParams | None = None, loss_type: str = "bnpo", normalizer: float | None = None,
                max_completion_length: int | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                kl_bias_correction: bool = False, entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                entropy_normalizer: float | None = None, entropy_threshold: float | None = None,
                off_policy_threshold: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of a micro-batch: the per-token loss `loss` (a name of
    :data:`~hf_verl.algorithms.policy_losses.POLICY_LOSSES`), masked and importance-weighted, plus
    `kl_coef x` KL to `batch.ref_logprobs`, aggregated per `loss_type`, minus `entropy_coef x` the token-mean
    entropy. The order of the terms is TRL's.

    Args:
        logp (`torch.Tensor` `(B, C)`): the actor's log-probs of the sampled tokens (with gradient).
        batch ([`RolloutBatch`]): old log-probs (None: on-policy, the ratio is 1), advantages, masks; the
            engine/trainer importance weights in `batch.is_weights` multiply the loss (VESPO folds them
            into its sequence ratio instead).
        loss (`str`): the loss form; params ([`PolicyLossParams`]): its clip ranges and knobs.
        loss_type (`str`): the aggregation (see `aggregate_loss`); normalizer: its token count.
        kl_coef / kl_estimator: the KL term; kl_bias_correction: multiply it by the importance ratio
            (TRL's `use_bias_correction_kl`).
        entropy / entropy_coef: the entropy bonus, a token mean over `entropy_normalizer` tokens (default:
            this micro-batch's); entropy_threshold: keep only tokens whose entropy is at least this value
            (TRL's `top_entropy_quantile`, the threshold already taken over every rank).
        off_policy_threshold (`float`, *optional*): drop negative-advantage sequences whose mean KL from the
            sampling policy exceeds it (TRL's `off_policy_mask_threshold`).

    Returns:
        `(loss, stats)`: stats hold `policy`, `kl`, `entropy`, `clip_low`, `clip_high`, `clip_region`,
        `approx_kl`, `ratio` and the loss's own statistics (masked means, detached).
    """
    params = params or PolicyLossParams()
    spec = POLICY_LOSSES.get(loss)
    if spec is None:  # a resolved name (an alias resolves elsewhere: "cispo" here is TRL's capped form)
        raise ValueError(f"unknown policy loss {loss!r}; choose one of {tuple(POLICY_LOSSES)}.")
    mask = batch.completion_mask
    if normalizer is None:
        normalizer = float(mask.sum().item())
    old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
    is_weights = batch.is_weights
    if spec.behaviour == "sampling":  # against the engine's own log-probs; its weights replace the IS correction
        if batch.sampling_logprobs is None:
            raise ValueError(f"policy loss {spec.name!r} needs the rollout engine's log-probs (sampling_logprobs).")
        old, is_weights = batch.sampling_logprobs, None
    if spec.importance_weights == "argument":  # the loss folds the weights in itself (VESPO's sequence ratio)
        per_token, extra = spec(logp, old, batch.advantages, mask, params, is_weights=is_weights)
    else:
        per_token, extra = spec(logp, old, batch.advantages, mask, params)
        if is_weights is not None and spec.importance_weights == "geometric_mean":  # the sequence's geometric mean
            maskf = mask.to(per_token.dtype)
            log_w = (torch.log(is_weights.expand_as(maskf) + 1e-10) * maskf).sum(-1, keepdim=True)
            per_token = per_token * torch.exp(log_w / (maskf.sum(-1, keepdim=True) + 1e-8))
        elif is_weights is not None:
            per_token = per_token * is_weights
    stats: dict[str, torch.Tensor] = {}
    if off_policy_threshold is not None:
        sampling = batch.sampling_logprobs if batch.sampling_logprobs is not None else old
        keep = off_policy_sequence_mask(batch.advantages, logp, sampling, mask, off_policy_threshold)
        per_token = per_token * keep
        stats["off_policy_masked"] = 1.0 - keep.mean()
    loss_mask = mask
    if entropy_threshold is not None and entropy is not None:
        loss_mask = mask * high_entropy_mask(entropy.detach(), mask, entropy_threshold).to(mask.dtype)
        per_token = per_token * loss_mask.to(per_token.dtype)

    def agg(per_token_values: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(per_token_values, mask, loss_type, max_completion_length=max_completion_length,
                              normalizer=normalizer)

    total = agg(per_token)
    stats["policy"] = total.detach()
    if kl_coef > 0:  # aggregation is linear: the same as adding the term per token (TRL)
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 but the rollout has no reference log-probs.")
        kl = kl_penalty(logp, batch.ref_logprobs, kl_estimator)
        stats["kl"] = masked_mean(kl.detach(), mask)
        if kl_bias_correction:
            ratio = torch.exp(log_importance_weights(logp, old, mask, params.importance_sampling_level))
            kl = kl * ratio
        total = total + kl_coef * agg(kl)
    if entropy is not None:
        stats["entropy"] = masked_mean(entropy.detach(), mask)
        if entropy_coef != 0:
            count = entropy_normalizer if entropy_normalizer is not None else float(loss_mask.sum().item())
            total = total - entropy_coef * (entropy * loss_mask.to(entropy.dtype)).sum() / max(count, 1.0)
    with torch.no_grad():
        diff = (logp - old) * mask.to(logp.dtype)
        clip = {k: extra.get(k, torch.zeros_like(logp)) for k in ("low_clip", "high_clip", "region_clip")}
        stats.update(clip_low=_mean(clip["low_clip"], mask), clip_high=_mean(clip["high_clip"], mask),
                     clip_region=_mean(clip["region_clip"], mask),
                     approx_kl=0.5 * masked_mean(diff.square(), mask), ratio=masked_mean(diff.exp(), mask))
        stats.update({k: _mean(v, mask) for k, v in extra.items() if k not in clip})
    return total, stats


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean of per-token `(B, T)` or per-sequence `(B, 1)` statistics."""
    return masked_mean(values.expand_as(mask).to(torch.float32), mask)


def value_loss(values: torch.Tensor, batch: RolloutBatch, *, clip: float, normalizer: float | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss `0.5 x max((V - R)^2, (clip(V, V_old +- clip) - R)^2)`, token mean.

    Args:
        values (`torch.Tensor` `(B, C)`): the critic's current values (with gradient).
        batch ([`RolloutBatch`]): `values` (the rollout's, V_old) and `returns` (R), masks.
        clip (`float`): the clip range around V_old. normalizer: the token count of the mean
            (default: this micro-batch's).

    Returns:
        `(loss, stats)`: stats hold `value` (the loss) and `clip_frac` (detached).
    """
    mask = batch.completion_mask
    if batch.values is None or batch.returns is None:
        raise ValueError("the value loss needs the rollout's values and returns (a critic and GAE).")
    old, returns = batch.values, batch.returns
    clipped = old + (values - old).clamp(-clip, clip)
    unclipped_sq, clipped_sq = (values - returns).square(), (clipped - returns).square()
    per_token = 0.5 * torch.max(unclipped_sq, clipped_sq)
    if normalizer is None:
        normalizer = float(mask.sum().item())
    loss = aggregate_loss(per_token, mask, "dapo", normalizer=normalizer)
    frac = masked_mean((clipped_sq > unclipped_sq).float(), mask)
    return loss, {"value": loss.detach(), "clip_frac": frac}
