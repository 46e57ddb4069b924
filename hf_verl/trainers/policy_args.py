"""`PolicyLossArguments`: the policy-objective fields GRPOConfig and PPOConfig share (TRL 1.16's names and
defaults, plus verl's `policy_loss` names), validated once and turned into
:class:`~hf_verl.algorithms.policy_losses.PolicyLossParams`.

Which loss runs: TRL's `loss_type` (GRPO) picks a form and an aggregation (see
:data:`~hf_verl.algorithms.policy_loss.TRL_LOSS_TYPES`); `policy_loss`, when set, picks the form by verl's
name (``vanilla``, ``gspo``, ``cispo``, ``sapo``, ...) and keeps the aggregation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hf_verl.algorithms.policy_losses import (
    PolicyLossParams,
    resolve_policy_loss,
)
from hf_verl.pipeline.losses import loss_form, loss_params
from hf_verl.settings import setting_field

logger = logging.getLogger(__name__)

MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class PolicyLossArguments:
    policy_loss: str | None = setting_field("policy_loss", "grpo", (
        "Policy loss by verl's name (vanilla, gspo, cispo, sapo, vespo, geo_mean, clip_cov, kl_cov, gpg, dppo_tv, "
        "dppo_kl, ...); None: the form TRL's loss_type implies. The aggregation stays loss_type's."))
    importance_sampling_level: str = setting_field("importance_sampling_level", "grpo", (
        "'token': per-token ratios; 'sequence': one ratio per sequence, the exp of its mean log-ratio (GSPO)."))
    delta: float | None = setting_field("delta", "grpo", (
        "Two-sided clipping: cap the ratio at delta (> 1 + epsilon_high) in the unclipped branch; None disables."))
    sapo_temperature_neg: float = setting_field("sapo_temperature_neg", "grpo", (
        "SAPO gate temperature for negative advantages."))
    sapo_temperature_pos: float = setting_field("sapo_temperature_pos", "grpo", (
        "SAPO gate temperature for positive advantages."))
    vespo_k_pos: float = setting_field("vespo_k_pos", "grpo", "VESPO gamma-weight power for advantages >= 0.")
    vespo_lambda_pos: float = setting_field("vespo_lambda_pos", "grpo", "VESPO gamma-weight rate for advantages >= 0.")
    vespo_k_neg: float = setting_field("vespo_k_neg", "grpo", "VESPO gamma-weight power for negative advantages.")
    vespo_lambda_neg: float = setting_field("vespo_lambda_neg", "grpo", (
        "VESPO gamma-weight rate for negative advantages."))
    off_policy_mask_threshold: float | None = setting_field("off_policy_mask_threshold", "grpo", (
        "Drop negative-advantage sequences whose mean log-ratio sampling/current exceeds this (DeepSeek-V3.2 OPSM)."))
    use_bias_correction_kl: bool = setting_field("use_bias_correction_kl", "grpo", (
        "Multiply the KL term by the importance ratio current/old (TRL's default)."))
    top_entropy_quantile: float = setting_field("top_entropy_quantile", "grpo", (
        "Train only on the tokens whose entropy is in this top fraction over every rank (1.0: all tokens)."))
    entropy_coef: float = setting_field("entropy_coef", "grpo", "Weight of the entropy bonus (token mean).")
    use_adaptive_entropy: bool = field(default=False, metadata=_help(
        "Adapt entropy_coef once per optimizer step towards entropy_target (the bonus is on only while the "
        "last step's entropy is <= entropy_target)."))
    entropy_coef_min: float = field(default=0.0, metadata=_help("Lower bound of the adaptive entropy_coef."))
    entropy_coef_max: float = field(default=1.0, metadata=_help("Upper bound of the adaptive entropy_coef."))
    entropy_coef_delta: float = field(default=0.005, metadata=_help("Adaptive entropy_coef step per optimizer step."))
    entropy_target: float = field(default=0.2, metadata=_help("Adaptive entropy target (nats per token)."))

    def _validate_policy_loss(self) -> None:
        # the schema's settings (importance_sampling_level, policy_loss, top_entropy_quantile, ...) are checked by
        # hf_verl.settings.check_settings, as the facade checks them
        if self.policy_loss is not None:
            resolve_policy_loss(self.policy_loss)  # raises with the known names
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef_max:
            raise ValueError(f"entropy_coef_min ({self.entropy_coef_min}) must be <= entropy_coef_max "
                             f"({self.entropy_coef_max}).")
        if self.entropy_coef_delta < 0:
            raise ValueError(f"entropy_coef_delta must be >= 0, got {self.entropy_coef_delta}.")
        self.policy_loss_params().validate()
        # TRL's warnings on pairs that depart from the papers' setups
        form, level, loss_type = self.resolved_policy_loss(), self.importance_sampling_level, getattr(self, "loss_type", None)
        if form == "vespo" and level != "token":
            logger.warning("VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
                           "should be set to `'token'` (the default).")
        if loss_type == "luspo" and level != "sequence":
            logger.warning("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to "
                           "mirror the paper's setup.")
        if level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            logger.warning(f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums "
                           "per-token contributions, which effectively weights each sequence by its completion "
                           "length instead of optimizing the per-sequence objective. To reproduce the GSPO paper's "
                           "setup, set `loss_type='grpo'`.")

    def policy_loss_params(self) -> PolicyLossParams:
        """The :class:`PolicyLossParams` of this configuration."""
        return loss_params(self)

    def resolved_policy_loss(self) -> str:
        """The hf_verl name of the loss form: `policy_loss` (verl's names) when set, else `loss_type`'s form."""
        return loss_form(self)
