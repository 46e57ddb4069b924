"""The algorithm families by name, and the choice of one for a front-end's config (:func:`make_algorithm`).

| family | object | run by |
|---|---|---|
| `critic_free` | :class:`~hf_verl.pipeline.critic_free.CriticFreeAlgorithm` | GRPOTrainer; the facade without a critic |
| `ppo` | :class:`~hf_verl.pipeline.ppo.PPOAlgorithm` | PPOTrainer; the facade with a critic |
| `rloo` | :class:`~hf_verl.pipeline.rloo.RLOOAlgorithm` | RLOOTrainer (its config names it) |
"""

from __future__ import annotations

from typing import Any

from hf_verl.pipeline.algorithm import Algorithm, is_ppo_config
from hf_verl.pipeline.critic_free import CriticFreeAlgorithm
from hf_verl.pipeline.ppo import PPOAlgorithm
from hf_verl.pipeline.rloo import RLOOAlgorithm

FAMILIES: dict[str, type[Algorithm]] = {"critic_free": CriticFreeAlgorithm, "ppo": PPOAlgorithm, "rloo": RLOOAlgorithm}


def make_algorithm(config: Any, *, critic: bool, **kwargs: Any) -> Algorithm:
    """The algorithm a config runs: the family it names (`RLOOConfig`: TRL's RLOO), PPO (a critic, a KL penalty,
    GAE) for a `PPOConfig` or roles with a critic, else the critic-free family.

    Args:
        config: the front-end's config.
        critic (`bool`): whether a critic is trained (a value model was given).
        kwargs: passed to the algorithm (`reward_names`, `model`, `metrics`, `sampling_temperature`, ...).
    """
    family = getattr(config, "_algorithm", None) or ("ppo" if is_ppo_config(config) or critic else "critic_free")
    if family != "ppo":
        kwargs.pop("eos_token_id", None)
    return FAMILIES[family](config, **kwargs)
