"""`PPOAlgorithm`: PPO with a critic and GAE (or any registered estimator), TRL's PPO semantics and metric names.

Per round (this rank's rows; whitening and group statistics over every data-parallel rank):

1. scores: the rewards combined (`reward_weights`), minus `missing_eos_penalty` for completions without EOS;
2. no-grad forwards: the generating policy's log-probs, the reference's (when a KL term is on) and the critic's
   per-token values;
3. token rewards: the score on the last completion token minus `kl_coef x KL` per token (TRL), or, with
   `use_kl_loss` (and always in the facade, where `beta` weighs it), the KL as a loss term instead; `kl_coef` fixed
   or from the adaptive controller; optional reward whitening; advantages by the registered estimator (GAE by
   default) and, for GAE, advantage whitening.

The step: the configured policy loss (with the KL loss term when asked) on the actor, unless the critic is still
warming up (`critic_warmup_steps`), and `vf_coef x` the clipped value loss on the critic.

Settings in either vocabulary (:func:`~hf_verl.pipeline.algorithm.policy_objective`): TRL PPO's (`kl_coef`,
`cliprange`, `loss_agg_mode`, `response_length`, `kl_estimator` for the reward penalty, `kl_loss_estimator` for the
loss term) or the facade's (`beta`, `epsilon`, `loss_type`, `max_completion_length`, `kl_estimator`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from hf_verl.algorithms.estimators import AdaptiveKLController, token_level_rewards
from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.policy_loss import masked_mean
from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.step import StepResult, Values
from hf_verl.parallel import comm
from hf_verl.pipeline import losses, phases
from hf_verl.pipeline.algorithm import Algorithm, Roles, _get
from hf_verl.rewards.callables import combine_rewards


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over the mask (1: perfect critic, <= 0: useless)."""
    m = mask.bool()
    ret, val = returns[m].float(), values[m].float()
    var = ret.var() if ret.numel() > 1 else ret.new_tensor(0.0)
    if var.item() == 0:
        return float("nan")
    return (1 - (ret - val).var() / var).item()


class PPOAlgorithm(Algorithm):
    """PPO with a critic (see the module docstring).

    Args:
        config: the front-end's live config.
        reward_names (`Sequence[str]`): the reward sources' names (`rewards/<name>/mean`).
        reward_weights (`Sequence[float]`, *optional*): one weight per source; default the config's.
        eos_token_id (`int`, *optional*): the end-of-sequence token (`missing_eos_penalty`, `val/num_eos_tokens`).
        kwargs: the base class's.
    """

    name = "ppo"
    policy_metric, value_metric = "loss/policy_avg", "loss/value_avg"
    trains_critic = True

    def __init__(self, config: Any, *, reward_names: Sequence[str] = (), reward_weights=None,
                 eos_token_id: int | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.reward_names, self._weights, self.eos_token_id = list(reward_names), reward_weights, eos_token_id
        adaptive = _get(config, "kl_controller", default="fixed") == "adaptive"
        self.kl_ctl = (AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
                       if adaptive else None)

    @property
    def reward_weights(self):
        return self._weights if self._weights is not None else getattr(self.config, "reward_weights", None)

    # ------------------------------------------------------------------ the KL term
    def kl_value(self) -> float:
        """The KL coefficient now: the adaptive controller's, else the config's (`kl_coef`, the facade's `beta`)."""
        return self.kl_ctl.value if self.kl_ctl is not None else float(_get(self.config, "kl_coef", "beta"))

    def kl_in_loss(self) -> bool:
        """Whether the KL is a loss term (`use_kl_loss`; the facade's default) rather than a reward penalty."""
        return bool(_get(self.config, "use_kl_loss", default=True))

    def needs_reference(self) -> bool:
        return self.kl_ctl is not None or self.kl_value() > 0

    def kl_coef(self) -> float:
        return self.kl_value() if self.kl_in_loss() else 0.0

    def kl_estimator(self) -> str:
        """The loss term's estimator (PPOConfig's `kl_loss_estimator`; the facade's `kl_estimator`)."""
        return _get(self.config, "kl_loss_estimator", "kl_estimator", default="k3")

    # ------------------------------------------------------------------ the round
    def finish_round(self, batch: RolloutBatch, rewards_per_func: torch.Tensor, roles: Roles, *,
                     rows: Sequence[dict], reference_now: bool = True, old_logprobs_now: bool = True) -> None:
        self.check_roles(roles)
        c, dims = self.config, roles.dims
        mask = batch.completion_mask
        scores = combine_rewards(rewards_per_func, self.reward_weights).float().to(batch.device)
        eos = self.eos_token_id
        has_eos = (batch.completion_ids.eq(eos) & mask.bool()).any(1) if eos is not None else None
        penalty = _get(c, "missing_eos_penalty")
        if penalty is not None:
            scores = torch.where(has_eos, scores, scores - penalty)
        batch.rewards = scores
        t0 = time.perf_counter()
        batch.old_logprobs = self.old_logprobs(batch, roles)
        if self.needs_reference():
            batch.ref_logprobs = self.reference_logprobs(batch, roles)
        t1 = time.perf_counter()
        if roles.critic is not None:
            batch.values = self.values(batch, roles) * mask
        self.timings = {"reference": t1 - t0, "critic": time.perf_counter() - t1}
        kl = None
        if batch.ref_logprobs is not None:
            kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, _get(c, "kl_estimator", default="k1")) * mask
        token_rewards, non_score = token_level_rewards(scores, mask, kl, 0.0 if self.kl_in_loss() else self.kl_value())
        if _get(c, "whiten_rewards", default=False):
            token_rewards = phases.global_masked_whiten(dims, token_rewards, mask, shift_mean=False) * mask
        batch.token_rewards = token_rewards
        inputs = self.advantage_inputs(batch, roles, rows)
        advantages, returns = phases.advantages(
            dims, self.estimator, scores=scores, mask=mask, num_generations=c.num_generations, gamma=c.gamma,
            lam=c.lam, values=batch.values, token_rewards=token_rewards,
            scale_rewards=_get(c, "scale_rewards", default="group"), **inputs)
        if self.estimator == "gae" and c.whiten_advantages:
            advantages = phases.global_masked_whiten(dims, advantages, mask) * mask.to(advantages.dtype)
        batch.advantages, batch.returns = advantages, returns
        roles.record("advantages->rollout", {"advantages": advantages, "returns": returns})
        self._record_round(batch, rewards_per_func, scores, kl, non_score, has_eos)
        if kl is not None and self.kl_ctl is not None:
            mean_kl = comm.gather_rows(dims, kl.sum(1)).mean().item()
            self.kl_ctl.update(mean_kl, _get(c, "batch_size", default=batch.batch_size * dims.dp_size))

    def values(self, batch: RolloutBatch, roles: Roles) -> torch.Tensor:
        """The critic's `(B, C)` values of `batch` (on the batch's device, float32)."""
        moved = roles.move("critic", roles.critic, batch)
        roles.record("actor->critic", {"input_ids": moved.input_ids, "attention_mask": moved.attention_mask})
        values = phases.critic_values(roles.critic, moved, micro_batch=self.scoring(batch.batch_size)["micro_batch"])
        roles.record("critic->rollout", {"values": values})
        return values.to(device=batch.device, dtype=torch.float32)

    def _record_round(self, batch, rewards_per_func, scores, kl, non_score, has_eos) -> None:
        m = self.metrics
        mask = batch.completion_mask
        if kl is not None:
            m["objective/kl"].append(kl.sum(1).mean().item())
        m["objective/entropy"].append((-batch.old_logprobs * mask).sum(1).mean().item())
        m["objective/non_score_reward"].append(non_score.sum(1).mean().item())
        m["objective/rlhf_reward"].append(non_score.sum(1).mean().item() + scores.mean().item())
        m["objective/scores"].append(scores.mean().item())
        m["objective/kl_coef"].append(self.kl_value())
        if has_eos is not None:
            m["val/num_eos_tokens"].append(float(has_eos.sum().item()))
        for i, name in enumerate(self.reward_names):
            m[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
        if batch.values is not None and batch.returns is not None:
            m["critic/vf_explained_var"].append(explained_variance(batch.values, batch.returns, mask))
            m["critic/values_mean"].append(masked_mean(batch.values, mask).item())

    # ------------------------------------------------------------------ the step
    def policy_metrics(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        metrics = {"loss/policy_avg": stats["policy"], "policy/approxkl_avg": stats["approx_kl"],
                   "policy/clipfrac_avg": stats["clip_region"], "policy/entropy_avg": stats["entropy"],
                   "val/ratio": stats["ratio"]}
        if self.kl_coef() > 0:
            metrics["loss/kl_avg"] = stats["kl"]
        if "aux_loss" in stats:
            metrics["aux_loss"] = stats["aux_loss"]
        return metrics

    def value_loss(self, values: torch.Tensor, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`(vf_coef x clipped value loss, metrics)` of one micro-batch from the critic's forward."""
        c = self.config
        vloss, st = losses.value_loss(values.to(batch.device), batch, clip=c.cliprange_value,
                                      normalizer=batch.loss_inputs.loss_normalizer)
        return c.vf_coef * vloss, {"loss/value_avg": st["value"], "val/clipfrac_avg": st["clip_frac"]}

    def trains_actor(self, roles: Roles, global_step: int) -> bool:
        warmup = _get(self.config, "critic_warmup_steps", default=0)
        return roles.critic is None or global_step >= warmup

    def critic_step(self, micro_batches: Sequence[RolloutBatch], roles: Roles, *, loss_scale: float | None
                    ) -> list[StepResult]:
        if roles.critic is None:
            return []
        moved = [roles.move("critic", roles.critic, mb) for mb in micro_batches]
        return [roles.critic.forward_backward(moved, self.value_loss, forward=Values(),
                                              forward_only=loss_scale is None, loss_scale=loss_scale or 1.0)]
