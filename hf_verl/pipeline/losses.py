"""The losses of a micro-batch: the clipped policy loss (with KL, entropy and importance terms) and
the clipped value loss, composed from :mod:`hf_verl.algorithms` once for every front-end.

Both aggregate per-token terms with :func:`~hf_verl.algorithms.policy_loss.aggregate_loss`; the
`normalizer` of the token-mean modes is given by the caller (the trainers pass the global token count
of the step divided by the data-parallel size, so that averaging gradients over ranks gives the
token mean of the global batch, whatever the layout). Every term is linear in the per-token values,
so a KL or entropy term aggregated on its own equals the same term added per token.

Returned statistics are detached scalars; each front-end logs them under its own metric names.
"""

from __future__ import annotations

import torch

from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.policy_loss import aggregate_loss, masked_mean, ppo_clip_loss
from hf_verl.data.batch import RolloutBatch


def policy_loss(logp: torch.Tensor, batch: RolloutBatch, *, clip_low: float, clip_high: float | None = None,
                dual_clip: float | None = None, loss_type: str = "bnpo", normalizer: float | None = None,
                max_completion_length: int | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                entropy: torch.Tensor | None = None,
                entropy_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO-clip policy loss of a micro-batch (importance-weighted when `batch.meta["is_weights"]`),
    plus `kl_coef x` KL to `batch.ref_logprobs`, minus `entropy_coef x` entropy.

    Args:
        logp (`torch.Tensor` `(B, C)`): the actor's log-probs of the sampled tokens (with gradient).
        batch ([`RolloutBatch`]): old log-probs (None: on-policy, the ratio is 1), advantages, masks.
        clip_low / clip_high / dual_clip: the clip range (clip-higher, dual clip).
        loss_type (`str`): aggregation (see `aggregate_loss`); normalizer: its token count.
        kl_coef / kl_estimator: the KL term; entropy / entropy_coef: the entropy bonus.

    Returns:
        `(loss, stats)`: stats hold `policy`, `kl`, `entropy`, `clip_low`, `clip_high`, `clip_region`,
        `approx_kl` and `ratio` (masked means, detached).
    """
    mask = batch.completion_mask
    if normalizer is None:
        normalizer = float(mask.sum().item())

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(per_token, mask, loss_type, max_completion_length=max_completion_length,
                              normalizer=normalizer)

    old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
    per_token, clip = ppo_clip_loss(logp, old, batch.advantages, mask, clip_low, clip_high, dual_clip)
    if "is_weights" in batch.meta:
        per_token = per_token * batch.meta["is_weights"]
    pg = agg(per_token)
    loss = pg
    stats: dict[str, torch.Tensor] = {"policy": pg.detach()}
    if kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 but the rollout has no reference log-probs.")
        kl = kl_penalty(logp, batch.ref_logprobs, kl_estimator)
        loss = loss + kl_coef * agg(kl)
        stats["kl"] = masked_mean(kl.detach(), mask)
    if entropy is not None:
        if entropy_coef > 0:
            loss = loss - entropy_coef * agg(entropy)
        stats["entropy"] = masked_mean(entropy.detach(), mask)
    with torch.no_grad():
        diff = (logp - old) * mask.to(logp.dtype)
        stats.update(clip_low=masked_mean(clip["low_clip"], mask), clip_high=masked_mean(clip["high_clip"], mask),
                     clip_region=masked_mean(clip["region_clip"], mask),
                     approx_kl=0.5 * masked_mean(diff.square(), mask), ratio=masked_mean(diff.exp(), mask))
    return loss, stats


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
