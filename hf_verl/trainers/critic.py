"""The critic role of the TRL-style PPO trainer: loading a value model, its optimizer, stepping, saving.

The value model is an `AutoModelForSequenceClassification`-style model with `num_labels=1`; it runs
in its own training engine (:class:`~hf_verl.engine.accelerate_engine.AccelerateEngine`, the same
layout as the actor: DDP, FSDP2 or ZeRO), which gives per-token values `V(s_t)` of the state before
every completion token (as in TRL's and verl's PPO) and reduces its gradients across ranks. It has
its own AdamW, learning rate and schedule, and is stepped right after each policy optimizer step;
it is saved under `critic/` in every checkpoint and restored on resume.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, TrainerCallback, get_scheduler

from hf_verl.engine.accelerate_engine import AccelerateEngine

logger = logging.getLogger(__name__)

CRITIC_DIR = "critic"
CRITIC_OPTIMIZER = "critic_optimizer.pt"


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


def attach_critic_optimizer(critic: AccelerateEngine, args, num_training_steps: int) -> None:
    """AdamW (`critic_learning_rate`, else `learning_rate`) and the run's LR schedule for the critic."""
    params = [p for p in critic.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.critic_learning_rate or args.learning_rate,
                                  weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_epsilon)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                              num_warmup_steps=args.get_warmup_steps(num_training_steps),
                              num_training_steps=num_training_steps)
    critic.attach_optimizer(optimizer, scheduler)


def save_critic(critic: AccelerateEngine, output_dir: str, *, with_optimizer: bool) -> None:
    """Weights under `<output_dir>/critic` (and, for resuming, optimizer and schedule); a collective."""
    path = os.path.join(output_dir, CRITIC_DIR)
    critic.save_pretrained(path)
    if not with_optimizer or critic.optimizer is None:
        return
    if critic.backend.shards:
        critic.save_state(path)
        if critic.dims.is_main and critic.scheduler is not None:
            torch.save({"scheduler": critic.scheduler.state_dict()}, os.path.join(path, CRITIC_OPTIMIZER))
    elif critic.dims.is_main:
        state = {"optimizer": critic.optimizer.state_dict(),
                 "scheduler": critic.scheduler.state_dict() if critic.scheduler is not None else None}
        torch.save(state, os.path.join(path, CRITIC_OPTIMIZER))


def load_critic(critic: AccelerateEngine, checkpoint_dir: str) -> None:
    """Restore weights (and optimizer / schedule when saved) from a trainer checkpoint."""
    from safetensors.torch import load_file

    path = os.path.join(checkpoint_dir, CRITIC_DIR)
    weights = os.path.join(path, "model.safetensors")
    if not os.path.exists(weights):
        raise FileNotFoundError(f"no critic weights in {path}: was this checkpoint written by PPOTrainer?")
    state = load_file(weights)
    model = critic.model
    expected = set(model.state_dict().keys())
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in expected - set(state) if k not in tied]
    unexpected = sorted(set(state) - expected)
    if unexpected or missing:
        raise ValueError(f"critic checkpoint does not match the value model: missing={missing}, "
                         f"unexpected={unexpected}.")
    critic.load_full_state_dict(state)
    opt = os.path.join(path, CRITIC_OPTIMIZER)
    if critic.backend.shards and critic.optimizer is not None:
        critic.load_state(path)
    if os.path.exists(opt) and critic.optimizer is not None:
        saved = torch.load(opt, map_location="cpu", weights_only=True)
        if saved.get("optimizer") is not None and not critic.backend.shards:
            critic.optimizer.load_state_dict(saved["optimizer"])
        if critic.scheduler is not None and saved.get("scheduler") is not None:
            critic.scheduler.load_state_dict(saved["scheduler"])


class CriticStepCallback(TrainerCallback):
    """Steps the critic (clip, AdamW, schedule) right after each policy optimizer step."""

    def __init__(self, critic: AccelerateEngine, max_grad_norm: float | None) -> None:
        self.critic, self.max_grad_norm = critic, max_grad_norm

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.critic.step(self.max_grad_norm)
        return control
