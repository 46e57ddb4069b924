"""The role-level facade: `Trainer(actor_model=..., critic_model=..., reward_model=..., reference_model=...)`
with `rollout` / `compute_loss` / `step`, for people who write the RL loop themselves."""

from hf_verl.facade.config import TrainerConfig
from hf_verl.facade.rollout import Rollout
from hf_verl.facade.trainer import Trainer

__all__ = ["Rollout", "Trainer", "TrainerConfig"]
