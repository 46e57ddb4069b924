"""`CriticFreeAlgorithm`: GRPO and every critic-free estimator, with TRL's GRPO semantics and metric names.

Per round (on this rank's rows, statistics over every data-parallel rank): completions cut at the length limit
leave the loss with `mask_truncated_completions`; the rewards are combined (`reward_weights`) and normalised per
group (`grpo`: `scale_rewards`; GDPO with `multi_objective_aggregation="normalize_then_sum"`), or handed to any
other registered estimator with the inputs it asks for (ReMax's greedy baseline, the sampling policy's token
statistics). Per micro-batch: the reference's log-probs when `beta > 0`, the generating policy's when the policy
moves within the round or the round is off-policy, and importance weights for an off-policy round. The loss: the
configured policy loss (TRL's `loss_type` form or a registered `policy_loss`) plus `beta x` the KL to the reference
(`kl_estimator`, k3 by default) and the entropy bonus, aggregated per `loss_type`.

Metrics: `reward`, `reward_std`, `frac_reward_zero_std`, `rewards/<source>/mean|std`, and per micro-batch
`entropy`, `kl` (beta > 0), the loss form's own (`clip_ratio/*`, `cispo_clip_ratio`, `vespo/phi_seq_mean`, or a
registered loss's), `policy_loss` (the policy term alone: no KL, no entropy bonus), `aux_loss` (a Mixture of
Experts).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from hf_verl.algorithms.advantages import gdpo_advantages, grpo_advantages
from hf_verl.algorithms.policy_losses import entropy_quantile
from hf_verl.data.batch import RolloutBatch
from hf_verl.parallel import comm
from hf_verl.pipeline import phases
from hf_verl.pipeline.algorithm import Algorithm, Roles, policy_loss_metric_names
from hf_verl.rewards.callables import combine_rewards


class CriticFreeAlgorithm(Algorithm):
    """GRPO and the critic-free estimators (see the module docstring).

    Args:
        config: the front-end's live config.
        reward_names (`Sequence[str]`): the reward sources' names, for the `rewards/<name>/...` metrics.
        reward_weights (`Sequence[float]`, *optional*): one weight per source; default the config's.
        kwargs: the base class's (`model`, `metrics`, `sampling_temperature`, `forward_batch_size`).
    """

    name = "critic_free"
    policy_metric = "policy_loss"
    normalizes_over_round = True  # TRL's dapo: the token mean over the generation round

    def __init__(self, config: Any, *, reward_names: Sequence[str] = (), reward_weights=None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.reward_names = list(reward_names)
        self._weights = reward_weights

    @property
    def reward_weights(self):
        return self._weights if self._weights is not None else getattr(self.config, "reward_weights", None)

    def kl_coef(self) -> float:
        return float(self.config.beta)

    # ------------------------------------------------------------------ the round
    def finish_round(self, batch: RolloutBatch, rewards_per_func: torch.Tensor, roles: Roles, *,
                     rows: Sequence[dict], reference_now: bool = False, old_logprobs_now: bool = False) -> None:
        self.check_roles(roles)
        c, dims = self.config, roles.dims
        if getattr(c, "mask_truncated_completions", False):
            batch.completion_mask = batch.completion_mask * (~batch.is_truncated).long().unsqueeze(1)
        local = combine_rewards(rewards_per_func, self.reward_weights).to(batch.device)
        all_rewards = comm.gather_rows(dims, local)  # group normalisation over the global round
        all_per_func = comm.gather_rows(dims, rewards_per_func)
        G = c.num_generations
        if getattr(c, "multi_objective_aggregation", "sum_then_normalize") == "normalize_then_sum":  # GDPO
            advantages, group_std = gdpo_advantages(all_per_func, G, self.reward_weights)
        else:
            advantages, group_std = grpo_advantages(all_rewards, G, c.scale_rewards)
        batch.rewards = local
        if self.estimator == "grpo":
            batch.advantages = comm.local_rows(dims, advantages, local.shape[0])
        else:  # another registered estimator, token-level (B, C)
            inputs = self.advantage_inputs(batch, roles, rows)
            batch.advantages, _ = phases.advantages(
                dims, self.estimator, scores=local, mask=batch.completion_mask, num_generations=G,
                scale_rewards=c.scale_rewards, gamma=getattr(c, "gamma", 1.0), lam=getattr(c, "lam", 0.95),
                scores_per_func=torch.nan_to_num(rewards_per_func), reward_weights=self.reward_weights, **inputs)
        roles.record("advantages->rollout", {"advantages": batch.advantages})
        t0 = time.perf_counter()
        if reference_now and self.kl_coef() > 0:
            batch.ref_logprobs = self.reference_logprobs(batch, roles)
        t1 = time.perf_counter()
        if old_logprobs_now and batch.old_logprobs is None:
            batch.old_logprobs = self.old_logprobs(batch, roles)
        self.timings = {"reference": t1 - t0, "old_logprobs": time.perf_counter() - t1} if reference_now else {}
        self._record_rewards(all_per_func, all_rewards, group_std)

    def _record_rewards(self, rewards_per_func: torch.Tensor, rewards: torch.Tensor, group_std: torch.Tensor) -> None:
        """Reward metrics over the global round (gathered)."""
        m = self.metrics
        m["reward"].append(rewards.mean().item())
        m["reward_std"].append(rewards.std().item() if rewards.numel() > 1 else 0.0)
        m["frac_reward_zero_std"].append(torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item())
        for i, name in enumerate(self.reward_names):
            col = rewards_per_func[:, i]
            m[f"rewards/{name}/mean"].append(torch.nanmean(col).item())
            m[f"rewards/{name}/std"].append(col[~col.isnan()].std().item() if (~col.isnan()).sum() > 1 else 0.0)

    # ------------------------------------------------------------------ the loss
    def policy_metrics(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        metrics = {"entropy": stats["entropy"]}
        if self.kl_coef() > 0:
            metrics["kl"] = stats["kl"]
        names = policy_loss_metric_names(self.objective().form)
        if names is None:  # a registered loss without a metric table: its own statistics by their names
            names = {k: k for k in stats if k not in _COMMON_STATS}
        metrics.update({logged: stats[stat] for stat, logged in names.items() if stat in stats})
        metrics["policy_loss"] = stats["policy"]
        if "aux_loss" in stats:
            metrics["aux_loss"] = stats["aux_loss"]
        return metrics

    @torch.no_grad()
    def eval_loss(self, batch: RolloutBatch, rewards_per_func: torch.Tensor, group_size: int, roles: Roles) -> float:
        """The loss on an evaluation batch at the current policy (TRL's `eval_loss`): advantages normalised within
        each of its groups, the KL to the reference when beta > 0, the batch's own token count as the normaliser and
        its own entropy threshold; nothing is gathered across ranks."""
        c = self.config
        per_func = rewards_per_func.to(batch.device)
        if getattr(c, "mask_truncated_completions", False):
            batch.completion_mask = batch.completion_mask * (~batch.is_truncated).long().unsqueeze(1)
        if getattr(c, "multi_objective_aggregation", "sum_then_normalize") == "normalize_then_sum":
            batch.advantages, _ = gdpo_advantages(per_func, group_size, self.reward_weights)
        else:
            batch.advantages, _ = grpo_advantages(combine_rewards(per_func, self.reward_weights), group_size,
                                                  c.scale_rewards)
        if self.kl_coef() > 0:
            batch.ref_logprobs = self.reference_logprobs(batch, roles)
        out = roles.actor.infer(batch, self.forward_request())
        q = c.top_entropy_quantile
        if q < 1.0:
            threshold = entropy_quantile(out.entropy[batch.completion_mask.bool()], 1.0 - q)
            batch.loss_inputs = dataclasses.replace(batch.loss_inputs, entropy_threshold=threshold)
        loss, _ = self.policy_loss(out, batch)
        return loss.item()


# statistics every policy loss reports (logged under the family's names, not as a loss's own)
_COMMON_STATS = ("policy", "kl", "entropy", "clip_low", "clip_high", "clip_region", "approx_kl", "ratio",
                 "off_policy_masked", "aux_loss")
