"""`RLOOAlgorithm`: REINFORCE leave-one-out as TRL 1.16's `RLOOTrainer` runs it, on the critic-free family.

What differs from GRPO (:class:`~hf_verl.pipeline.critic_free.CriticFreeAlgorithm`), per TRL:

- rewards: a completion every reward source left unscored (None) is NaN, takes no part in its siblings' baselines
  and gets advantage 0; `reward_clip_range` clamps the combined reward;
- the KL to the reference is a **reward penalty** of `beta x` the sequence's summed first-order estimate
  `sum_t (log pi_old - log pi_ref)` (Ahmadian et al., 2024), not a loss term;
- advantages: the leave-one-out baseline over each group (`rloo`), optionally whitened over the round
  (`normalize_advantages`), one per completion;
- the loss: PPO-clip on the sequence's ratio (`sequence_clip`, the product of its token ratios), averaged over
  sequences (the config's `policy_loss` / `loss_type`, which `RLOOConfig` defaults to these).

Metrics under TRL's RLOO names: `reward`, `reward_std` (the sources' weighted sum, before clipping and the KL
penalty), `frac_reward_zero_std` (of the rewards the baseline sees), `rewards/<source>/mean|std`, `kl`
(the token mean of the penalty's per-token estimate), and the family's `entropy`, `clip_ratio/*`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from hf_verl.algorithms.estimators import rloo_advantages
from hf_verl.data.batch import RolloutBatch
from hf_verl.parallel import comm
from hf_verl.pipeline.algorithm import Roles
from hf_verl.pipeline.critic_free import CriticFreeAlgorithm


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased std ignoring NaN (TRL's `nanstd`)."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    count = (~x.isnan()).sum(dim=dim) if dim is not None else (~x.isnan()).sum()
    var = torch.nansum((x - mean) ** 2, dim=dim) / (count - 1)
    return var.sqrt()


class RLOOAlgorithm(CriticFreeAlgorithm):
    """REINFORCE leave-one-out, TRL's semantics (see the module docstring)."""

    name = "rloo"
    normalizes_over_round = False

    def kl_coef(self) -> float:
        return 0.0  # the KL is in the reward, not the loss

    def kl_penalty(self) -> float:
        return float(self.config.beta)

    def _weighted(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """The weighted sum of the sources, NaN where no source scored (TRL's logged `reward`)."""
        weights = self.reward_weights
        w = rewards_per_func.new_ones(rewards_per_func.shape[1]) if weights is None else torch.as_tensor(
            list(weights), dtype=rewards_per_func.dtype, device=rewards_per_func.device)
        rewards = (rewards_per_func * w).nansum(dim=1)
        rewards[rewards_per_func.isnan().all(dim=1)] = float("nan")
        return rewards

    def _rewards(self, batch: RolloutBatch, rewards_per_func: torch.Tensor, roles: Roles) -> torch.Tensor:
        """This rank's rewards as the baseline sees them: NaN where no source scored, clipped, minus the KL penalty."""
        c = self.config
        rewards = self._weighted(rewards_per_func.to(batch.device))
        clip = getattr(c, "reward_clip_range", None)
        if clip:
            rewards = rewards.clamp(min=clip[0], max=clip[1])
        if self.kl_penalty() != 0.0:
            t0 = time.perf_counter()
            if batch.ref_logprobs is None:
                batch.ref_logprobs = self.reference_logprobs(batch, roles)
            t1 = time.perf_counter()
            if batch.old_logprobs is None:
                batch.old_logprobs = self.old_logprobs(batch, roles)
            self.timings = {"reference": t1 - t0, "old_logprobs": time.perf_counter() - t1}
            maskf = batch.completion_mask.to(rewards.dtype)
            per_token = (batch.old_logprobs - batch.ref_logprobs) * maskf
            rewards = rewards - self.kl_penalty() * per_token.sum(-1)
            totals = comm.reduce(roles.dims, torch.stack([per_token.sum(), maskf.sum()]).double().cpu(), "sum")
            self.metrics["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return rewards

    def _advantages(self, rewards: torch.Tensor, group: int) -> torch.Tensor:
        """Leave-one-out advantages of the round's rewards (NaN: unscorable), optionally whitened over the completions
        that have a baseline (TRL: scorable, with a scorable sibling); 0 for the others."""
        if group < 2:  # an evaluation with num_generations_eval=1: no baseline
            return torch.zeros_like(rewards)
        advantages = rloo_advantages(rewards, group)
        if getattr(self.config, "normalize_advantages", False):
            scorable = ~rewards.isnan()
            counted = scorable & (scorable.view(-1, group).sum(-1, keepdim=True) > 1).expand(-1, group).reshape(-1)
            values = advantages.masked_fill(~counted, float("nan"))
            advantages = torch.nan_to_num((values - torch.nanmean(values)) / (_nanstd(values) + 1e-4), nan=0.0)
        return advantages

    def finish_round(self, batch: RolloutBatch, rewards_per_func: torch.Tensor, roles: Roles, *,
                     rows: Sequence[dict], reference_now: bool = False, old_logprobs_now: bool = False) -> None:
        self.check_roles(roles)
        self.timings = {}
        c, dims = self.config, roles.dims
        if getattr(c, "mask_truncated_completions", False):
            batch.completion_mask = batch.completion_mask * (~batch.is_truncated).long().unsqueeze(1)
        local = self._rewards(batch, rewards_per_func, roles)
        rewards = comm.gather_rows(dims, local)  # groups may span ranks
        advantages = self._advantages(rewards, c.num_generations)
        batch.rewards = torch.nan_to_num(local, nan=0.0)
        batch.advantages = comm.local_rows(dims, advantages, local.shape[0])
        roles.record("advantages->rollout", {"advantages": batch.advantages})
        if old_logprobs_now and batch.old_logprobs is None:
            batch.old_logprobs = self.old_logprobs(batch, roles)
        grouped = rewards.view(-1, c.num_generations)
        group_std = _nanstd(grouped, dim=1) if c.num_generations > 1 else torch.zeros(grouped.shape[0])
        m, per_func = self.metrics, comm.gather_rows(dims, rewards_per_func)
        logged = self._weighted(per_func)  # TRL logs the sources' weighted sum: no clipping, no KL penalty
        m["reward"].append(torch.nanmean(logged).item())
        m["reward_std"].append(_nanstd(logged).item() if logged.numel() > 1 else 0.0)
        m["frac_reward_zero_std"].append(torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item())
        for i, name in enumerate(self.reward_names):
            col = per_func[:, i]
            m[f"rewards/{name}/mean"].append(torch.nanmean(col).item())
            m[f"rewards/{name}/std"].append(_nanstd(col).item() if (~col.isnan()).sum() > 1 else 0.0)

    @torch.no_grad()
    def eval_loss(self, batch: RolloutBatch, rewards_per_func: torch.Tensor, group_size: int, roles: Roles) -> float:
        """The RLOO loss on an evaluation batch at the current policy: its own groups' leave-one-out advantages (the
        KL penalty in the rewards when beta > 0; its metric is reduced over the ranks, which evaluate in lockstep)."""
        if getattr(self.config, "mask_truncated_completions", False):
            batch.completion_mask = batch.completion_mask * (~batch.is_truncated).long().unsqueeze(1)
        metrics = self.metrics
        self.metrics = type(metrics)(list)  # the evaluation's KL is not a training metric
        try:
            rewards = self._rewards(batch, rewards_per_func, roles)  # every rank evaluates in lockstep
        finally:
            self.metrics = metrics
        batch.advantages = self._advantages(rewards, group_size)
        batch.old_logprobs = None
        out = roles.actor.infer(batch, self.forward_request())
        loss, _ = self.policy_loss(out, batch)
        return loss.item()

