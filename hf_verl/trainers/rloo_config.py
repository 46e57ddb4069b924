"""`RLOOConfig`: TRL 1.16's RLOOConfig names and defaults, on GRPOConfig's fields (RLOO shares GRPO's rollout).

TRL's RLOO fields keep their names and defaults: `num_generations=2`, `beta=0.05` (a sequence-level k1 reward
penalty, not a loss term), `epsilon=0.2`, `normalize_advantages=False`, `reward_clip_range=None`; the loss is
PPO-clip on the sequence's ratio averaged over sequences (`policy_loss="sequence_clip"`, `loss_type="grpo"`), the
estimator the leave-one-out baseline (`advantage_estimator="rloo"`). Every GRPOConfig field is accepted too
(generation, vLLM, parallelism, placement, logging); GRPO's advantage settings (`scale_rewards`,
`multi_objective_aggregation`) do not apply to RLOO.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_verl.settings import setting_field
from hf_verl.trainers.grpo_config import GRPOConfig


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class RLOOConfig(GRPOConfig):
    """Configuration of :class:`~hf_verl.RLOOTrainer` (a `transformers.TrainingArguments`); see the module
    docstring."""

    _front_end = "rloo"  # the schema's name for this config (hf_verl.settings: defaults and names)
    _algorithm = "rloo"  # the algorithm family it runs (hf_verl.pipeline.rloo)

    num_generations: int = setting_field("num_generations", "rloo", "Completions per prompt (the RLOO group), >= 2.")
    beta: float = setting_field("beta", "rloo", (
        "Weight of the KL penalty in the reward (the sequence's summed log pi_old - log pi_ref); 0: no reference."))
    advantage_estimator: str = setting_field("advantage_estimator", "rloo", "RLOO's leave-one-out baseline.")
    loss_type: str = setting_field("loss_type", "rloo", "The per-sequence loss's aggregation: a mean over sequences.")
    policy_loss: str | None = setting_field("policy_loss", "rloo", "PPO-clip on the sequence's ratio (TRL's RLOO).")
    normalize_advantages: bool = field(default=False, metadata=_help(
        "Whiten the advantages over the round (the completions that have a baseline)."))
    reward_clip_range: tuple[float, float] | None = field(default=None, metadata=_help(
        "Clamp the combined reward to this (min, max) before the KL penalty and the baseline."))

    def _validate(self) -> None:
        super()._validate()
        if self.advantage_estimator != "rloo":
            raise ValueError(f"RLOOConfig.advantage_estimator={self.advantage_estimator!r}: RLOOTrainer runs the "
                             "leave-one-out baseline; for another estimator use GRPOTrainer(advantage_estimator=...).")
        if self.reward_clip_range is not None:
            low, high = (list(self.reward_clip_range) + [None, None])[:2]
            if len(self.reward_clip_range) != 2 or low is None or high is None or low > high:
                raise ValueError(f"reward_clip_range must be (min, max) with min <= max, got "
                                 f"{self.reward_clip_range!r}.")
            self.reward_clip_range = (float(low), float(high))
