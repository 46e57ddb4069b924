"""The critic role of the TRL-style PPO trainer: loading a value model, its optimizer, stepping, saving.

The value model is an `AutoModelForSequenceClassification`-style model with `num_labels=1`; it runs
in its own training engine (from :func:`~hf_verl.engine.registry.make_engine`, on the same layout as the
actor by default: DDP, FSDP2 or ZeRO), which gives per-token values `V(s_t)` of the state before
every completion token (as in TRL's and verl's PPO) and reduces its gradients across ranks. It has
its own AdamW, learning rate and schedule, and is stepped right after each policy optimizer step;
it is saved under `critic/` in every checkpoint and restored on resume.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import (
    AutoModelForSequenceClassification,
    PreTrainedModel,
    TrainerCallback,
)

from hf_verl.engine.base import TrainingEngine
from hf_verl.engine.step import OptimizerSpec
from hf_verl.trainers.engine_glue import scheduler_spec

logger = logging.getLogger(__name__)

CRITIC_DIR = "critic"


def load_value_model(model, *, model_init_kwargs: dict | None = None) -> PreTrainedModel:
    """A value model from an id, a path or a model object; checks it has one output per position."""
    if isinstance(model, (str, os.PathLike)):
        kwargs = dict(num_labels=1, use_safetensors=True, trust_remote_code=False)
        kwargs.update(model_init_kwargs or {})
        model = AutoModelForSequenceClassification.from_pretrained(str(model), **kwargs)
    prefix = getattr(model, "base_model_prefix", None)
    if not prefix or not hasattr(model, prefix) or not hasattr(model, "score"):
        raise TypeError(
            f"value_model must be an AutoModelForSequenceClassification-style model with a backbone and a "
            f"`score` head (num_labels=1); got {type(model).__name__}."
        )
    if model.config.num_labels != 1:
        raise ValueError(f"value_model must have num_labels=1, got {model.config.num_labels}.")
    return model


def critic_optimizer_spec(args, num_training_steps: int) -> OptimizerSpec:
    """AdamW (`critic_learning_rate`, else `learning_rate`; the run's betas, eps and weight decay over every
    parameter), clipping to `max_grad_norm`, and the run's LR schedule, for the critic's engine to build."""
    return OptimizerSpec(torch.optim.AdamW, {"lr": args.critic_learning_rate or args.learning_rate,
                                             "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon},
                         weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                         scheduler=scheduler_spec(args, num_training_steps))


def save_critic(critic: TrainingEngine, output_dir: str, *, with_optimizer: bool) -> None:
    """Weights under `<output_dir>/critic` (and, for resuming, optimizer and schedule); a collective."""
    path = os.path.join(output_dir, CRITIC_DIR)
    critic.save_pretrained(path)
    if with_optimizer and critic.has_optimizer:
        critic.save_checkpoint(path)


def load_critic(critic: TrainingEngine, checkpoint_dir: str) -> None:
    """Restore weights (and optimizer / schedule when saved) from a trainer checkpoint."""
    from safetensors.torch import load_file

    path = os.path.join(checkpoint_dir, CRITIC_DIR)
    weights = os.path.join(path, "model.safetensors")
    if not os.path.exists(weights):
        raise FileNotFoundError(f"no critic weights in {path}: was this checkpoint written by PPOTrainer?")
    state = load_file(weights)
    expected, tied = critic.state_dict_keys()
    missing = [k for k in expected - set(state) if k not in tied]
    unexpected = sorted(set(state) - expected)
    if unexpected or missing:
        raise ValueError(f"critic checkpoint does not match the value model: missing={missing}, "
                         f"unexpected={unexpected}.")
    critic.load_full_state_dict(state)
    saved = [os.path.join(path, name) for name in (f"{critic.role}_optimizer.pt", "optimizer_shards")]
    megatron = os.path.isdir(path) and any(n.startswith(f"megatron_{critic.role}_") for n in os.listdir(path))
    if critic.has_optimizer and (megatron or any(os.path.exists(p) for p in saved)):
        critic.load_checkpoint(path)


class CriticStepCallback(TrainerCallback):
    """Steps the critic's engine (global norm, clipping, AdamW, schedule) right after each policy optimizer step."""

    def __init__(self, critic: TrainingEngine) -> None:
        self.critic = critic

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.critic.optimizer_step()
        return control
