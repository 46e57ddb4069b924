"""hf_verl: reinforcement-learning post-training of LLMs inside the Hugging Face ecosystem.

`import hf_verl` is light: the trainers, engines and reward sources (which import torch and
transformers) load on first attribute access through :func:`__getattr__`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from hf_verl import _notices  # noqa: E402

_notices.install()  # exact third-party notices that ask nothing of a user (see hf_verl/_notices.py)

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "DPOConfig": "hf_verl.trainers.dpo_config",
    "DPOTrainer": "hf_verl.trainers.dpo_trainer",
    "GKDConfig": "hf_verl.trainers.gkd_config",
    "GKDTrainer": "hf_verl.trainers.gkd_trainer",
    "GRPOConfig": "hf_verl.trainers.grpo_config",
    "GRPOTrainer": "hf_verl.trainers.grpo_trainer",
    "PPOConfig": "hf_verl.trainers.ppo_config",
    "PPOTrainer": "hf_verl.trainers.ppo_trainer",
    "RLOOConfig": "hf_verl.trainers.rloo_config",
    "RLOOTrainer": "hf_verl.trainers.rloo_trainer",
    "RewardConfig": "hf_verl.trainers.reward_config",
    "RewardTrainer": "hf_verl.trainers.reward_trainer",
    "Trainer": "hf_verl.facade.trainer",
    "RolloutBatch": "hf_verl.data.batch",
    "RolloutEngine": "hf_verl.rollout.base",
    "SamplingParams": "hf_verl.rollout.base",
    "GenerationOutput": "hf_verl.rollout.base",
    "TransformersEngine": "hf_verl.rollout.hf_engine",
    "RewardModelScorer": "hf_verl.rewards.reward_model",
    "math_accuracy": "hf_verl.rewards.rules",
    "gsm8k_accuracy": "hf_verl.rewards.rules",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from hf_verl.data.batch import RolloutBatch
    from hf_verl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
    from hf_verl.rollout.hf_engine import TransformersEngine
    from hf_verl.trainers.dpo_config import DPOConfig
    from hf_verl.trainers.dpo_trainer import DPOTrainer
    from hf_verl.trainers.gkd_config import GKDConfig
    from hf_verl.trainers.gkd_trainer import GKDTrainer
    from hf_verl.trainers.grpo_config import GRPOConfig
    from hf_verl.trainers.grpo_trainer import GRPOTrainer
    from hf_verl.trainers.ppo_config import PPOConfig
    from hf_verl.trainers.ppo_trainer import PPOTrainer
    from hf_verl.trainers.reward_config import RewardConfig
    from hf_verl.trainers.reward_trainer import RewardTrainer
    from hf_verl.trainers.rloo_config import RLOOConfig
    from hf_verl.trainers.rloo_trainer import RLOOTrainer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_verl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
