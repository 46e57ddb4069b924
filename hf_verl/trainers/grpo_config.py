"""`GRPOConfig`: TRL's GRPO field names and defaults, validated in `__post_init__`.

Fields shared with TRL keep TRL's names and defaults (learning_rate 1e-6, gradient
checkpointing on, loss_type "dapo", scale_rewards "group", ...). Additions: `max_prompt_length`
(prompts are left-truncated to it and the truncation is counted in a metric). One departure:
`bf16=None` resolves to True only where a bf16-capable CUDA device is visible (TRL turns it on
everywhere, which makes CPU runs several times slower).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from hf_verl.trainers.parallel_args import ParallelArguments

from hf_verl.algorithms.advantages import SCALE_REWARDS
from hf_verl.algorithms.estimators import ADVANTAGE_ESTIMATORS
from hf_verl.algorithms.policy_loss import LOSS_TYPES
from hf_verl.trainers.rollout_args import RolloutArguments
from hf_verl.trainers.vllm_args import VLLMArguments


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class GRPOConfig(TrainingArguments, VLLMArguments, RolloutArguments, ParallelArguments):
    """Configuration of :class:`~hf_verl.GRPOTrainer` (a `transformers.TrainingArguments`).

    Generation: `num_generations` completions per prompt, of at most `max_completion_length`
    tokens, sampled with `temperature`/`top_p`/`top_k`/`min_p`/`repetition_penalty`. One
    generation batch of `generation_batch_size` completions (default: per-device batch x
    data-parallel ranks x `steps_per_generation`) is scored, turned into advantages and consumed over
    `steps_per_generation` optimizer steps, `num_iterations` times. Loss: PPO clip with
    `epsilon`/`epsilon_high`, a k3 KL term weighted by `beta`, aggregated per `loss_type`.
    """

    learning_rate: float = field(default=1e-6, metadata=_help("AdamW learning rate (TRL's default)."))
    logging_steps: float = field(default=10, metadata=_help("Log every N steps."))
    gradient_checkpointing: bool = field(default=True, metadata=_help("Activation checkpointing."))
    bf16: bool | None = field(default=None, metadata=_help("None: True on bf16-capable CUDA, else False."))
    remove_unused_columns: bool = field(default=False, metadata=_help("Keep extra columns for rewards."))

    model_init_kwargs: dict | None = field(default=None, metadata=_help("kwargs of from_pretrained for a model id."))
    disable_dropout: bool = field(default=False, metadata=_help("Set every dropout probability to 0."))
    max_prompt_length: int | None = field(default=512, metadata=_help("Left-truncate prompts to this many tokens; None: no limit."))
    num_generations: int = field(default=8, metadata=_help("Completions per prompt (the GRPO group size), >= 2."))
    max_completion_length: int = field(default=512, metadata=_help("Maximum tokens per completion."))
    generation_batch_size: int | None = field(default=None, metadata=_help("Completions per generation round (global)."))
    steps_per_generation: int | None = field(default=None, metadata=_help("Optimizer steps per generation round; default gradient_accumulation_steps."))
    shuffle_dataset: bool = field(default=True, metadata=_help("Shuffle the prompt dataset."))
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature."))
    top_p: float = field(default=1.0, metadata=_help("Nucleus sampling mass."))
    top_k: int = field(default=0, metadata=_help("Top-k sampling; 0 disables."))
    min_p: float | None = field(default=None, metadata=_help("Min-p sampling; None disables."))
    repetition_penalty: float = field(default=1.0, metadata=_help("Repetition penalty; 1.0 disables."))
    stop: list[str] | None = field(default=None, metadata=_help("Stop strings that end a completion."))
    beta: float = field(default=0.0, metadata=_help("KL coefficient; > 0 creates a reference model."))
    num_iterations: int = field(default=1, metadata=_help("Passes over each generation batch (mu)."))
    epsilon: float = field(default=0.2, metadata=_help("Lower clip range."))
    epsilon_high: float | None = field(default=None, metadata=_help("Upper clip range; default epsilon (clip-higher when larger)."))
    dual_clip: float | None = field(default=None, metadata=_help("Dual-clip constant c > 1; None disables."))
    reward_weights: list[float] | None = field(default=None, metadata=_help("One weight per reward function; default all 1."))
    scale_rewards: str = field(default="group", metadata=_help("'group', 'batch' or 'none' (True/False accepted as in TRL)."))
    loss_type: str = field(default="dapo", metadata=_help(f"One of {LOSS_TYPES}."))
    advantage_estimator: str = field(default="grpo", metadata=_help(
        "Critic-free estimator: grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax."))
    mask_truncated_completions: bool = field(default=False, metadata=_help("Exclude completions that hit max_completion_length from the loss."))
    log_completions: bool = field(default=False, metadata=_help("Log a sample of completions."))

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        super().__post_init__()
        self._take_over_deepspeed()
        self._validate()

    def _validate(self) -> None:
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 for group-relative advantages, got {self.num_generations}."
            )
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; choose one of {LOSS_TYPES}.")
        if self.advantage_estimator == "gae":
            raise ValueError("advantage_estimator='gae' needs a critic: use PPOTrainer with a value_model.")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown advantage_estimator {self.advantage_estimator!r}; choose one of "
                             f"{tuple(e for e in ADVANTAGE_ESTIMATORS if e != 'gae')}.")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}.")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length}.")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {self.max_prompt_length}.")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}.")
        if self.epsilon <= 0 or (self.epsilon_high is not None and self.epsilon_high <= 0):
            raise ValueError("epsilon and epsilon_high must be > 0.")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}.")
        self._validate_vllm()
        self._validate_rollout()
        self._resolve_generation_batch()

    def _resolve_generation_batch(self) -> None:
        global_batch = self.per_device_train_batch_size * self.data_parallel_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("set generation_batch_size or steps_per_generation, not both.")
        if self.generation_batch_size is None:
            steps = self.steps_per_generation or self.gradient_accumulation_steps
            self.steps_per_generation = steps
            self.generation_batch_size = global_batch * steps
        else:
            if self.generation_batch_size % global_batch:
                raise ValueError(
                    f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                    f"per_device_train_batch_size x processes ({global_batch})."
                )
            self.steps_per_generation = self.generation_batch_size // global_batch
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"generation batch size {self.generation_batch_size} (per_device_train_batch_size="
                f"{self.per_device_train_batch_size} x {self.data_parallel_size} data-parallel ranks x "
                f"steps_per_generation={self.steps_per_generation}) is not divisible by "
                f"num_generations={self.num_generations}; change one of them."
            )
