"""`PPOConfig`: the field names and defaults of TRL's (experimental, <= 1.10) PPOConfig, validated.

Batch sizes follow TRL: each data-parallel rank rolls out `local_batch_size =
per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches` completions per
update, split into `num_mini_batches` mini-batches of `per_device_train_batch_size x
gradient_accumulation_steps` and passed over `num_ppo_epochs` times; one mini-batch is one
optimizer step (its `gradient_accumulation_steps` micro-batches accumulate), so `max_steps` and
`logging_steps` count optimizer steps. `__post_init__` records the micro-batches per rollout in
`rollout_accumulation_steps`. `total_episodes` (TRL's run length, in completions) is turned into
`max_steps` when `max_steps` is not given.

Additions (verl's knobs under PPO names): `advantage_estimator`, `num_generations`,
`critic_learning_rate`, `critic_warmup_steps`, `use_kl_loss`, `kl_controller` / `kl_target` /
`kl_horizon`, `whiten_advantages`, `max_prompt_length`, `reward_weights`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from hf_verl.algorithms.policy_loss import resolve_aggregation
from hf_verl.algorithms.registry import get_advantage_estimator
from hf_verl.settings import check_settings, setting_field
from hf_verl.trainers.model_parallel_args import ModelParallelArguments
from hf_verl.trainers.parallel_args import ParallelArguments
from hf_verl.trainers.policy_args import PolicyLossArguments
from hf_verl.trainers.rollout_args import RolloutArguments
from hf_verl.trainers.vllm_args import VLLMArguments

logger = logging.getLogger(__name__)

KL_ESTIMATORS = ("k1", "k3")  # TRL's, for the reward penalty
KL_CONTROLLERS = ("fixed", "adaptive")


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class PPOConfig(VLLMArguments, RolloutArguments, ParallelArguments, ModelParallelArguments, PolicyLossArguments, TrainingArguments):
    """Configuration of :class:`~hf_verl.PPOTrainer` (a `transformers.TrainingArguments`).

    TRL's fields keep their names and defaults: `num_ppo_epochs=4`, `num_mini_batches=1`,
    `kl_coef=0.05`, `kl_estimator="k1"`, `cliprange=0.2`, `vf_coef=0.1`, `cliprange_value=0.2`,
    `gamma=1.0`, `lam=0.95`, `response_length=53`, `temperature=0.7`, `whiten_rewards=False`,
    `missing_eos_penalty=None`, `learning_rate=3e-6`. See the module docstring for batch sizes.
    """

    _front_end = "ppo"  # the schema's name for this config (hf_verl.settings: defaults and names)

    learning_rate: float = setting_field("learning_rate", "ppo", "AdamW learning rate of the policy (TRL's default).")
    bf16: bool | None = field(default=None, metadata=_help("None: True on bf16-capable CUDA, else False."))
    remove_unused_columns: bool = field(default=False, metadata=_help("Keep extra columns for rewards."))
    logging_steps: float = field(default=10, metadata=_help("Log every N optimizer steps."))

    # --- TRL PPOConfig fields
    dataset_num_proc: int | None = field(default=None, metadata=_help("Processes for dataset preprocessing."))
    num_mini_batches: int = field(default=1, metadata=_help("Mini-batches (optimizer steps) per rollout and epoch."))
    sequence_parallel_size: int = setting_field("sequence_parallel_size", "ppo", (
        "Ulysses sequence-parallel degree: each row's sequence is split over this many processes (padding-free packed"
        " batches; see docs/sequence_parallel.md). The launch's processes are data-parallel ranks x this."))
    total_episodes: int | None = field(default=None, metadata=_help("Completions to train on; sets max_steps."))
    local_rollout_forward_batch_size: int = field(default=64, metadata=_help("Per-process batch of the no-grad rollout forwards."))
    num_sample_generations: int = field(default=10, metadata=_help("Log a sample completion this many times per run (0: never)."))
    response_length: int = setting_field("max_completion_length", "ppo", "Maximum tokens per completion.")
    stop_token: str | None = field(default=None, metadata=_help("'eos' to stop at EOS; None: the generation config's EOS."))
    stop_token_id: int | None = field(default=None, metadata=_help("Token id that ends a completion."))
    temperature: float = setting_field("temperature", "ppo", "Sampling temperature.")
    missing_eos_penalty: float | None = field(default=None, metadata=_help("Subtracted from the score of completions without EOS."))
    sft_model_path: str = field(default="EleutherAI/pythia-160m", metadata=_help("Policy path used by TRL-style scripts."))
    reward_model_path: str = field(default="EleutherAI/pythia-160m", metadata=_help("Reward model path used by TRL-style scripts."))
    model_adapter_name: str | None = field(default=None, metadata=_help("PEFT adapter to train (multi-adapter models)."))
    ref_adapter_name: str | None = field(default=None, metadata=_help("PEFT adapter serving as reference."))
    num_ppo_epochs: int = field(default=4, metadata=_help("Passes over each rollout."))
    whiten_rewards: bool = field(default=False, metadata=_help("Whiten token rewards (no mean shift) before GAE."))
    kl_coef: float = setting_field("beta", "ppo", "KL coefficient (initial value for the adaptive controller).")
    kl_estimator: str = field(default="k1", metadata=_help("The KL estimator of the reward penalty (TRL's): 'k1' or 'k3'."))
    kl_loss_estimator: str = setting_field("kl_estimator", "ppo", (
        "The KL estimator of the loss term with use_kl_loss (verl's kl_loss_type): 'k1', 'k2' or 'k3'."))
    cliprange: float = setting_field("epsilon", "ppo", "Policy ratio clip range.")
    cliprange_high: float | None = setting_field("epsilon_high", "ppo", (
        "Upper policy clip range (clip-higher, verl clip_ratio_high); None: cliprange."))
    loss_agg_mode: str = setting_field("loss_type", "ppo", (
        "Loss aggregation, verl's names (token-mean, seq-mean-token-mean, seq-mean-token-sum, "
        "seq-mean-token-sum-norm) or hf_verl/TRL's (dapo, grpo, luspo, dr_grpo, bnpo)."))
    use_bias_correction_kl: bool = setting_field("use_bias_correction_kl", "ppo", (
        "With use_kl_loss: multiply the KL loss by the importance ratio current/old (TRL GRPO's correction)."))
    vf_coef: float = setting_field("vf_coef", "ppo", "Value loss coefficient.")
    cliprange_value: float = setting_field("cliprange_value", "ppo", "Value clip range around the rollout values.")
    gamma: float = setting_field("gamma", "ppo", "Discount factor.")
    lam: float = setting_field("lam", "ppo", "GAE lambda.")
    ds3_gather_for_generation: bool = field(default=True, metadata=_help("ZeRO-3: gather weights for generation."))

    # --- hf_verl additions
    advantage_estimator: str = setting_field("advantage_estimator", "ppo", (
        "A registered estimator (gae, grpo, rloo, ..., or your own: hf_verl.algorithms.register_advantage_estimator);"
        " gae needs a value model, the others run without one."))
    num_generations: int = setting_field("num_generations", "ppo", "Completions per prompt (> 1 for group estimators).")
    scale_rewards: str = setting_field("scale_rewards", "ppo", "std scaling of the grpo estimator.")
    whiten_advantages: bool = setting_field("whiten_advantages", "ppo", (
        "Whiten GAE advantages over the rollout (TRL: always)."))
    critic_learning_rate: float | None = setting_field("critic_learning_rate", "ppo", (
        "Value model learning rate; default learning_rate."))
    critic_warmup_steps: int = field(default=0, metadata=_help("Optimizer steps that train only the critic."))
    use_kl_loss: bool = field(default=False, metadata=_help("KL as a loss term (k3, weight kl_coef) instead of a reward penalty."))
    kl_controller: str = field(default="fixed", metadata=_help("'fixed' or 'adaptive' (Ziegler et al.) kl_coef."))
    kl_target: float = field(default=6.0, metadata=_help("Adaptive controller: target KL per completion."))
    kl_horizon: int = field(default=10000, metadata=_help("Adaptive controller: horizon in completions."))
    max_prompt_length: int | None = setting_field("max_prompt_length", "ppo", (
        "Left-truncate prompts to this many tokens."))
    reward_weights: list[float] | None = field(default=None, metadata=_help("Weights of reward functions."))
    shuffle_dataset: bool = field(default=True, metadata=_help("Shuffle the prompt dataset."))
    rollout_accumulation_steps: int | None = field(
        default=None, metadata=_help("Set by __post_init__: micro-batches per rollout, gradient_accumulation_steps x "
                                     "num_mini_batches.")
    )

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        self._adopt_launch_cpu()
        self._resolve_model_parallel()
        super().__post_init__()
        self._take_over_deepspeed()
        self._check_sequence_parallel()
        self._validate()
        if self.rollout_accumulation_steps is None:  # first resolution (not a reload of a resolved config)
            # TRL's meaning: a mini-batch (one optimizer step) is gradient_accumulation_steps micro-batches of
            # per_device_train_batch_size, and a rollout holds num_mini_batches of them
            self.rollout_accumulation_steps = self.gradient_accumulation_steps * self.num_mini_batches
        if self.total_episodes is not None and self.max_steps <= 0:
            updates = math.ceil(self.total_episodes / self.batch_size)
            self.max_steps = updates * self.num_ppo_epochs * self.num_mini_batches

    # TRL's derived sizes, as read-only views
    @property
    def local_batch_size(self) -> int:
        """Completions rolled out per process per update."""
        return self.per_device_train_batch_size * self.rollout_accumulation_steps

    @property
    def batch_size(self) -> int:
        return self.local_batch_size * self.data_parallel_size

    @property
    def local_mini_batch_size(self) -> int:
        return self.local_batch_size // self.num_mini_batches

    @property
    def mini_batch_size(self) -> int:
        return self.local_mini_batch_size * self.data_parallel_size

    @property
    def micro_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.data_parallel_size

    # names the shared on-policy machinery reads
    @property
    def steps_per_generation(self) -> int:
        return self.rollout_accumulation_steps

    @property
    def num_iterations(self) -> int:
        return self.num_ppo_epochs

    def _validate(self) -> None:
        check_settings(self)  # the schema's settings, checked as the facade checks them (hf_verl.settings)
        get_advantage_estimator(self.advantage_estimator)  # an unknown name raises, listing the registered ones
        checks = [
            (self.kl_estimator in KL_ESTIMATORS, f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}."),
            (self.kl_controller in KL_CONTROLLERS, f"kl_controller must be one of {KL_CONTROLLERS}, got {self.kl_controller!r}."),
            (self.num_ppo_epochs >= 1, f"num_ppo_epochs must be >= 1, got {self.num_ppo_epochs}."),
            (self.num_mini_batches >= 1, f"num_mini_batches must be >= 1, got {self.num_mini_batches}."),
            (self.temperature > 0, f"temperature must be > 0 for PPO sampling, got {self.temperature}."),
            (self.stop_token in (None, "eos"), f"stop_token must be 'eos' or None, got {self.stop_token!r}."),
            (not (self.stop_token and self.stop_token_id is not None), "set stop_token or stop_token_id, not both."),
            (self.critic_warmup_steps >= 0, f"critic_warmup_steps must be >= 0, got {self.critic_warmup_steps}."),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._validate_vllm()
        self._validate_rollout()
        self._validate_policy_loss()
        resolve_aggregation(self.loss_agg_mode)
        if self.use_adaptive_entropy:
            raise ValueError("use_adaptive_entropy is a GRPO option (TRL); PPOTrainer takes a fixed entropy_coef.")
        if get_advantage_estimator(self.advantage_estimator).uses_groups and self.num_generations < 2:
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} compares completions of one prompt: "
                "set num_generations >= 2."
            )
