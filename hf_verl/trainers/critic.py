"""The critic role: a value model scored per token, with its own optimizer and schedule.

The value model is an `AutoModelForSequenceClassification`-style model with `num_labels=1`: its
backbone (`model.<base_model_prefix>`) gives hidden states and its `score` head maps every
position to a value, so one forward yields `V(s_t)` for every completion token (the value of the
state before token t, as in TRL's and verl's PPO). The critic is trained by the same backward as
the policy (its loss is part of the trainer's loss) and stepped right after the policy's
optimizer step; across processes its gradients are averaged explicitly before that step.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, TrainerCallback, get_scheduler

from hf_verl.data.batch import RolloutBatch

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


class Critic:
    """Per-token values, value-model optimizer and scheduler, save/load.

    Args:
        model: the value model (see `load_value_model`).
        learning_rate (`float`), weight_decay (`float`), max_grad_norm (`float`): optimizer knobs.
    """

    def __init__(self, model: PreTrainedModel, *, learning_rate: float, weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0, adam_betas=(0.9, 0.999), adam_epsilon: float = 1e-8) -> None:
        self.model = model
        self.learning_rate = learning_rate
        self.max_grad_norm = max_grad_norm
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay,
                                           betas=adam_betas, eps=adam_epsilon)
        self.scheduler = None
        self.last_grad_norm: float | None = None

    def to(self, device) -> Critic:
        self.model.to(device)
        return self

    def make_scheduler(self, name: str, num_training_steps: int, num_warmup_steps: int = 0) -> None:
        self.scheduler = get_scheduler(name, self.optimizer, num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps)

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """`(B, C)` values of the states before each completion token."""
        mask = batch.attention_mask
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        C = batch.completion_ids.shape[1]
        return self.model.score(hidden[:, -C - 1 : -1]).squeeze(-1).float()

    def step(self, world_size: int = 1) -> None:
        """Average gradients over processes, clip, step optimizer and scheduler, zero gradients."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return
        if world_size > 1:
            for p in params:
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world_size)
        if self.max_grad_norm and self.max_grad_norm > 0:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm).item()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, output_dir: str, with_optimizer: bool = False) -> None:
        path = os.path.join(output_dir, CRITIC_DIR)
        self.model.save_pretrained(path, safe_serialization=True)
        if with_optimizer:
            state = {"optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
            torch.save(state, os.path.join(path, CRITIC_OPTIMIZER))

    def load(self, checkpoint_dir: str) -> None:
        """Restore weights (and optimizer/scheduler state when saved) from a trainer checkpoint."""
        from safetensors.torch import load_file

        path = os.path.join(checkpoint_dir, CRITIC_DIR)
        weights = os.path.join(path, "model.safetensors")
        if not os.path.exists(weights):
            raise FileNotFoundError(f"no critic weights in {path}: was this checkpoint written by PPOTrainer?")
        missing, unexpected = self.model.load_state_dict(load_file(weights), strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if unexpected or [k for k in missing if k not in tied]:
            raise ValueError(f"critic checkpoint does not match the value model: missing={missing}, "
                             f"unexpected={unexpected}.")
        opt = os.path.join(path, CRITIC_OPTIMIZER)
        if os.path.exists(opt):
            state = torch.load(opt, map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None and state["scheduler"] is not None:
                self.scheduler.load_state_dict(state["scheduler"])


class CriticStepCallback(TrainerCallback):
    """Steps the critic right after each policy optimizer step."""

    def __init__(self, critic: Critic, world_size: int) -> None:
        self.critic, self.world_size = critic, world_size

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.critic.step(self.world_size)
        return control
