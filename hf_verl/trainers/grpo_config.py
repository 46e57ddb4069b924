"""`GRPOConfig`: TRL's GRPO field names and defaults, validated in `__post_init__`.

Fields shared with TRL keep TRL's names and defaults (learning_rate 1e-6, gradient
checkpointing on, loss_type "dapo", scale_rewards "group", ...). Additions: `max_prompt_length`
(prompts are left-truncated to it and the truncation is counted in a metric). One departure:
`bf16=None` resolves to True only where a bf16-capable CUDA device is visible (TRL turns it on
everywhere, which makes CPU runs several times slower).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from hf_verl.algorithms.policy_loss import LOSS_TYPES
from hf_verl.algorithms.registry import (
    advantage_estimator_names,
    get_advantage_estimator,
)
from hf_verl.data.batch import resolve_pad_to_multiple_of
from hf_verl.settings import check_settings, setting_field
from hf_verl.trainers.model_parallel_args import ModelParallelArguments
from hf_verl.trainers.parallel_args import ParallelArguments
from hf_verl.trainers.policy_args import (
    MULTI_OBJECTIVE_AGGREGATIONS,
    PolicyLossArguments,
)
from hf_verl.trainers.rollout_args import RolloutArguments
from hf_verl.trainers.vllm_args import VLLMArguments

logger = logging.getLogger(__name__)


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class GRPOConfig(VLLMArguments, RolloutArguments, ParallelArguments, ModelParallelArguments, PolicyLossArguments, TrainingArguments):
    """Configuration of :class:`~hf_verl.GRPOTrainer` (a `transformers.TrainingArguments`).

    Generation: `num_generations` completions per prompt, of at most `max_completion_length`
    tokens, sampled with `temperature`/`top_p`/`top_k`/`min_p`/`repetition_penalty`. One
    generation batch of `generation_batch_size` completions (default: per-device batch x
    data-parallel ranks x `steps_per_generation`) is scored, turned into advantages and consumed over
    `steps_per_generation` optimizer steps, `num_iterations` times. Loss: PPO clip with
    `epsilon`/`epsilon_high`, a k3 KL term weighted by `beta`, aggregated per `loss_type`.
    """

    _front_end = "grpo"  # the schema's name for this config (hf_verl.settings: defaults and names)

    _placement_roles = ("reference", "generator")  # what `placement` may place (a class attribute)

    learning_rate: float = setting_field("learning_rate", "grpo", "AdamW learning rate (TRL's default).")
    sequence_parallel_size: int = setting_field("sequence_parallel_size", "grpo", (
        "Ulysses sequence-parallel degree: each row's sequence is split over this many processes (padding-free packed"
        " batches; see docs/sequence_parallel.md). The launch's processes are data-parallel ranks x this."))
    logging_steps: float = field(default=10, metadata=_help("Log every N steps."))
    gradient_checkpointing: bool = field(default=True, metadata=_help("Activation checkpointing."))
    bf16: bool | None = field(default=None, metadata=_help("None: True on bf16-capable CUDA, else False."))
    remove_unused_columns: bool = field(default=False, metadata=_help("Keep extra columns for rewards."))

    model_init_kwargs: dict | None = field(default=None, metadata=_help("kwargs of from_pretrained for a model id."))
    disable_dropout: bool = field(default=False, metadata=_help("Set every dropout probability to 0."))
    max_prompt_length: int | None = setting_field("max_prompt_length", "grpo", (
        "Left-truncate prompts to this many tokens; None: no limit."))
    num_generations: int = setting_field("num_generations", "grpo", (
        "Completions per prompt (the GRPO group size), >= 2."))
    max_completion_length: int = setting_field("max_completion_length", "grpo", "Maximum tokens per completion.")
    generation_batch_size: int | None = field(default=None, metadata=_help("Completions per generation round (global)."))
    steps_per_generation: int | None = field(default=None, metadata=_help("Optimizer steps per generation round; default gradient_accumulation_steps."))
    shuffle_dataset: bool = field(default=True, metadata=_help("Shuffle the prompt dataset."))
    temperature: float = setting_field("temperature", "grpo", "Sampling temperature.")
    top_p: float = setting_field("top_p", "grpo", "Nucleus sampling mass.")
    top_k: int = setting_field("top_k", "grpo", "Top-k sampling; 0 disables.")
    min_p: float | None = setting_field("min_p", "grpo", "Min-p sampling; None disables.")
    repetition_penalty: float = setting_field("repetition_penalty", "grpo", "Repetition penalty; 1.0 disables.")
    stop: list[str] | None = setting_field("stop", "grpo", "Stop strings that end a completion.")
    beta: float = setting_field("beta", "grpo", "KL coefficient; > 0 creates a reference model.")
    kl_estimator: str = setting_field("kl_estimator", "grpo", (
        "Estimator of the KL loss term weighted by beta: 'k3' (TRL's), 'k2' or 'k1'."))
    num_iterations: int = field(default=1, metadata=_help("Passes over each generation batch (mu)."))
    epsilon: float = setting_field("epsilon", "grpo", "Lower clip range.")
    epsilon_high: float | None = setting_field("epsilon_high", "grpo", (
        "Upper clip range; default epsilon (clip-higher when larger)."))
    dual_clip: float | None = setting_field("dual_clip", "grpo", "Dual-clip constant c > 1; None disables.")
    reward_weights: list[float] | None = field(default=None, metadata=_help("One weight per reward function; default all 1."))
    scale_rewards: str = setting_field("scale_rewards", "grpo", (
        "'group', 'batch' or 'none' (True/False accepted as in TRL)."))
    loss_type: str = setting_field("loss_type", "grpo", f"One of {LOSS_TYPES}, or verl's loss_agg_mode names.")
    advantage_estimator: str = setting_field("advantage_estimator", "grpo", (
        "A registered critic-free estimator: grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, "
        "remax, gpg, grpo_passk, opo, gdpo, optimal_token_baseline, ..., or your own "
        "(hf_verl.algorithms.register_advantage_estimator)."))
    mask_truncated_completions: bool = field(default=False, metadata=_help("Exclude completions that hit max_completion_length from the loss."))
    log_completions: bool = field(default=False, metadata=_help(
        "Log a sample of completions at each log, and write every logged round to output_dir/completions/*.parquet."))
    num_completions_to_print: int | None = field(default=None, metadata=_help(
        "Completions shown per log with log_completions (None: all of the round; <= 0: none)."))
    log_unique_prompts: bool = field(default=False, metadata=_help("Show each prompt once in the logged sample."))
    log_multimodal: bool = field(default=True, metadata=_help(
        "Log images with completions (TRL); hf_verl trains on image columns but its completions table has no image "
        "column yet, so none are logged."))
    log_completions_hub_repo: str | None = field(default=None, metadata=_help(
        "Not supported: completions are written to output_dir/completions; upload that folder yourself."))

    # --- model loading and the forward
    trust_remote_code: bool = field(default=False, metadata=_help(
        "Allow custom model code when loading the policy, its tokenizer and reward models by id."))
    router_aux_loss_coef: float | None = field(default=None, metadata=_help(
        "Weight of a Mixture-of-Experts router load-balancing loss; None: the model config's own coefficient."))
    cast_lm_head_to_fp32: bool = field(default=False, metadata=_help(
        "Keep the LM head in float32 and compute the log-probs from float32 hidden states."))
    pad_to_multiple_of: int | str | None = field(default="auto", metadata=_help(
        "Pad rollout prompt and completion tensors to a multiple of this; 'auto': None (TRL: 128 on Neuron only)."))

    # --- generation
    generation_kwargs: dict | None = setting_field("generation_kwargs", "grpo", (
        "Sampling settings that override the fields above (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_tokens / max_new_tokens, stop); without vLLM, also any other transformers GenerationConfig field "
        "(num_beams, no_repeat_ngram_size, ...), passed to model.generate."))
    chat_template_kwargs: dict | None = setting_field("chat_template_kwargs", "grpo", (
        "Extra keyword arguments of apply_chat_template for conversational prompts (e.g. enable_thinking)."))
    cache_implementation: str | None = field(default=None, metadata=_help(
        "transformers generate's cache_implementation (e.g. 'static'); used by the transformers engine."))
    num_generations_eval: int | None = field(default=None, metadata=_help(
        "Completions per prompt in evaluate(); None: num_generations."))
    ds3_gather_for_generation: bool = field(default=True, metadata=_help(
        "ZeRO-3: generate on gathered weights (hf_verl always does, on a replica kept in step by weight sync)."))
    use_transformers_continuous_batching: bool = field(default=False, metadata=_help(
        "Not supported: use use_vllm=True for batched serving-style generation."))
    transformers_continuous_batching_config: dict | None = field(default=None, metadata=_help(
        "Only with use_transformers_continuous_batching (not supported)."))
    use_transformers_paged: bool = field(default=False, metadata=_help(
        "Deprecated alias of use_transformers_continuous_batching (not supported)."))
    max_tool_calling_iterations: int | None = setting_field("max_tool_calling_iterations", "grpo", (
        "Most tool-calling rounds per completion when tools are given; None: no limit but the token budget."))
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata=_help(
        "'sum_then_normalize': weight and sum the rewards, then normalise per group; 'normalize_then_sum' (GDPO): "
        "normalise each reward per group, then weight, sum and normalise over the batch."))
    sync_ref_model: bool = field(default=False, metadata=_help(
        "Mix the policy into the reference every ref_model_sync_steps steps (TR-DPO); needs beta > 0."))
    ref_model_mixup_alpha: float = field(default=0.6, metadata=_help("ref <- (1 - alpha) ref + alpha policy."))
    ref_model_sync_steps: int = field(default=512, metadata=_help("Optimizer steps between reference syncs."))

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        for name in ("generation_kwargs", "chat_template_kwargs", "transformers_continuous_batching_config"):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().startswith("{"):  # from the command line
                setattr(self, name, json.loads(value))
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        self._adopt_launch_cpu()
        self._resolve_model_parallel()
        super().__post_init__()
        self._take_over_deepspeed()
        self._check_sequence_parallel()
        self._validate()

    def _validate(self) -> None:
        check_settings(self)  # the schema's settings, checked as the facade checks them (hf_verl.settings)
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 for group-relative advantages, got {self.num_generations}."
            )
        if self.vllm_importance_sampling_cap is not None:
            logger.warning("vllm_importance_sampling_cap is deprecated (TRL): it sets vllm_importance_sampling_clip_max.")
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        if get_advantage_estimator(self.advantage_estimator).needs_critic:  # unknown names raise, listing them
            raise ValueError(f"advantage_estimator={self.advantage_estimator!r} needs a critic: use PPOTrainer with a "
                             f"value_model, or a critic-free estimator {advantage_estimator_names(critic=False)}.")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}.")
        self._validate_vllm()
        self._validate_rollout()
        self._validate_policy_loss()
        self._validate_trl_extras()
        self._resolve_generation_batch()

    def _validate_trl_extras(self) -> None:
        if self.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
            raise ValueError(f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}, got "
                             f"{self.multi_objective_aggregation!r}.")
        if self.log_completions_hub_repo is not None:
            raise ValueError("log_completions_hub_repo is not supported: with log_completions=True the completions are "
                             "written to <output_dir>/completions/*.parquet; push that folder with huggingface_hub.")
        if self.use_transformers_continuous_batching or self.use_transformers_paged:
            raise ValueError("use_transformers_continuous_batching / use_transformers_paged are not supported: hf_verl's "
                             "transformers engine decodes the whole round in one batched KV-cached loop; for "
                             "serving-style batching use use_vllm=True.")
        if self.transformers_continuous_batching_config is not None:
            raise ValueError("transformers_continuous_batching_config applies only to use_transformers_continuous_batching, "
                             "which hf_verl does not support; remove it.")
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("sync_ref_model=True needs a reference model: set beta > 0.")
        if self.sync_ref_model and not (0.0 <= self.ref_model_mixup_alpha <= 1.0 and self.ref_model_sync_steps >= 1):
            raise ValueError("ref_model_mixup_alpha must be in [0, 1] and ref_model_sync_steps >= 1.")
        if self.generation_kwargs is not None:
            self._check_generation_kwargs()
        if self.do_eval and self.eval_strategy != "no":
            g = self.num_generations_eval or self.num_generations
            if (self.per_device_eval_batch_size * self.data_parallel_size) % g:
                raise ValueError(f"per_device_eval_batch_size ({self.per_device_eval_batch_size}) x "
                                 f"{self.data_parallel_size} data-parallel ranks must be divisible by the evaluation "
                                 f"group size ({g}, num_generations_eval or num_generations).")

    def _check_generation_kwargs(self) -> None:
        """Every engine takes the sampling settings; the transformers engine also any other `GenerationConfig`
        field (TRL passes generation_kwargs to `GenerationConfig`), which vLLM and servers refuse."""
        from transformers import GenerationConfig

        from hf_verl.rollout.base import GENERATION_KWARGS, check_generation_kwargs

        if self.use_vllm:
            check_generation_kwargs(self.generation_kwargs)
            return
        fields = set(GenerationConfig().to_dict())
        unknown = sorted(k for k in self.generation_kwargs if k not in GENERATION_KWARGS and k not in fields)
        if unknown:
            raise ValueError(f"generation_kwargs keys {unknown} are neither sampling settings nor transformers "
                             f"GenerationConfig fields (the sampling settings: {sorted(GENERATION_KWARGS)}).")

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
