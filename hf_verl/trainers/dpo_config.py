"""`DPOConfig`: the field names and defaults of TRL's DPOConfig (1.16), validated in `__post_init__`.

Shared with TRL: beta=0.1, loss_type (a list, with loss_weights), label_smoothing,
f_divergence_type / f_alpha_divergence_coef, discopop_tau, max_length=1024,
truncation_mode="keep_start", padding_free, precompute_ref_log_probs / precompute_ref_batch_size,
sync_ref_model / ref_model_mixup_alpha / ref_model_sync_steps, disable_dropout=True,
model_init_kwargs, learning_rate=1e-6, gradient_checkpointing=True, logging_steps=10. One
departure as in GRPOConfig: `bf16=None` turns on only on bf16-capable CUDA. Addition:
`logprob_chunk_size` (positions per chunk of the LM head when scoring log-probs).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from hf_verl.algorithms.dpo_losses import DPO_LOSS_TYPES, F_DIVERGENCE_TYPES
from hf_verl.data.batch import resolve_pad_to_multiple_of
from hf_verl.data.preference import TRUNCATION_MODES
from hf_verl.settings import check_settings, setting_field
from hf_verl.trainers.model_parallel_args import ModelParallelArguments
from hf_verl.trainers.parallel_args import ParallelArguments

logger = logging.getLogger(__name__)


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class DPOConfig(ModelParallelArguments, ParallelArguments, TrainingArguments):
    """Configuration of :class:`~hf_verl.DPOTrainer` (a `transformers.TrainingArguments`); see the module docstring."""

    _front_end = "dpo"  # the schema's name for this config (hf_verl.settings: defaults and names)

    _placement_roles = ("reference",)  # what `placement` may place (a class attribute)

    learning_rate: float = setting_field("learning_rate", "dpo", "AdamW learning rate (TRL's default).")
    logging_steps: float = field(default=10, metadata=_help("Log every N steps."))
    gradient_checkpointing: bool = field(default=True, metadata=_help("Activation checkpointing (TRL's default)."))
    bf16: bool | None = field(default=None, metadata=_help("None: True on bf16-capable CUDA, else False."))
    remove_unused_columns: bool = field(default=False, metadata=_help("Keep the tokenised columns."))

    model_init_kwargs: dict | None = field(default=None, metadata=_help("kwargs of from_pretrained for a model id."))
    trust_remote_code: bool = field(default=False, metadata=_help("Allow custom model code from the Hub."))
    disable_dropout: bool = field(default=True, metadata=_help("Set every dropout probability to 0."))
    dataset_num_proc: int | None = field(default=None, metadata=_help("Processes for tokenisation."))
    max_length: int | None = field(default=1024, metadata=_help("Maximum prompt+completion tokens; None: no limit."))
    truncation_mode: str = field(default="keep_start", metadata=_help("keep_start: cut completion ends; keep_end: cut the prompt start."))
    padding_free: bool = field(default=False, metadata=_help("Pack sequences without padding (position ids reset)."))
    shared_prefix: bool | None = field(default=None, metadata=_help(
        "Score a pair's chosen and rejected completions with the prompt laid out once (equal to the padded result to "
        "float rounding; not with padding_free, sequence parallelism or a router aux loss). None: when the layout's "
        "arithmetic is no more than the padded one's and the model attends with sdpa; True: always where it applies "
        "(an error when the model cannot); False: never."))
    pad_to_multiple_of: int | str | None = field(default="auto", metadata=_help(
        "Pad each batch's length to a multiple of this ('auto': None off Neuron devices, as in TRL)."))
    pad_token: str | None = field(default=None, metadata=_help(
        "Deprecated in TRL: the padding token (default: the tokenizer's pad, else its EOS)."))
    router_aux_loss_coef: float | None = field(default=None, metadata=_help(
        "Weight of a Mixture-of-Experts router load-balancing loss; None: the model config's own coefficient."))
    activation_offloading: bool = field(default=False, metadata=_help(
        "Keep saved activations in pinned host memory until the backward (CUDA only)."))
    precompute_ref_log_probs: bool = field(default=False, metadata=_help("Score the reference once over the dataset, cached."))
    precompute_ref_batch_size: int | None = field(default=None, metadata=_help("Batch size of that pass; default per_device_eval_batch_size."))
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"], metadata=_help(f"Any of {DPO_LOSS_TYPES}, combined."))
    loss_weights: list[float] | None = field(default=None, metadata=_help("One weight per loss_type; default all 1."))
    ld_alpha: float | None = field(default=None, metadata=_help(
        "LD-DPO: completion tokens past the shorter answer's length weigh ld_alpha in the log-probs (None: off)."))
    f_divergence_type: str = field(default="reverse_kl", metadata=_help(f"One of {F_DIVERGENCE_TYPES}."))
    f_alpha_divergence_coef: float = field(default=0.5, metadata=_help("alpha of the alpha-divergence."))
    label_smoothing: float = field(default=0.0, metadata=_help("robust / exo_pair / aot label smoothing."))
    beta: float = field(default=0.1, metadata=_help("Inverse temperature of the implicit reward."))
    sequence_parallel_size: int = setting_field("sequence_parallel_size", "dpo", (
        "Ulysses sequence-parallel degree: each row's sequence is split over this many processes (padding-free packed"
        " batches; see docs/sequence_parallel.md). The launch's processes are data-parallel ranks x this."))
    use_weighting: bool = field(default=False, metadata=_help(
        "WPO: weigh each pair's loss by the policy's aligned probability of both answers."))
    discopop_tau: float = field(default=0.05, metadata=_help("DiscoPOP temperature."))
    sync_ref_model: bool = field(default=False, metadata=_help("Mix the policy into the reference every ref_model_sync_steps (TR-DPO)."))
    ref_model_mixup_alpha: float = field(default=0.6, metadata=_help("ref <- alpha * policy + (1 - alpha) * ref."))
    ref_model_sync_steps: int = field(default=512, metadata=_help("Steps between reference syncs."))
    logprob_chunk_size: int = setting_field("logprob_chunk_size", "dpo", (
        "Positions per chunk when scoring log-probs, at most: fewer above a 64k vocabulary, where a chunk's fp32 "
        "logits stay within 256 MiB."))

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.pad_token is not None:
            logger.warning("pad_token is deprecated (TRL); set tokenizer.pad_token instead.")
        if self.truncation_mode == "keep_end":  # TRL 1.16's deprecation, in its words
            warnings.warn("The `'keep_end'` truncation mode is deprecated and will be removed in v2.0.0. Use "
                          "`truncation_mode='keep_start'` (the default) instead.", FutureWarning, stacklevel=3)
        self._adopt_launch_cpu()
        self._resolve_model_parallel()
        super().__post_init__()
        self._take_over_deepspeed()
        self._check_sequence_parallel()
        self._validate()

    def _validate(self) -> None:
        check_settings(self)  # the schema's settings DPO carries (its beta and loss_type are its own concepts)
        unknown = [t for t in self.loss_type if t not in DPO_LOSS_TYPES]
        if unknown:
            raise ValueError(f"unknown loss_type {unknown}; choose from {DPO_LOSS_TYPES}.")
        if not self.loss_type:
            raise ValueError("loss_type is empty; give at least one, e.g. ['sigmoid'].")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"got {len(self.loss_weights)} loss_weights for {len(self.loss_type)} loss types.")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {self.truncation_mode!r}.")
        if self.f_divergence_type not in F_DIVERGENCE_TYPES:
            raise ValueError(f"f_divergence_type must be one of {F_DIVERGENCE_TYPES}, got {self.f_divergence_type!r}.")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be >= 2 or None, got {self.max_length}.")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}.")
        if not 0 < self.ref_model_mixup_alpha <= 1 or self.ref_model_sync_steps < 1:
            raise ValueError("ref_model_mixup_alpha must be in (0, 1] and ref_model_sync_steps >= 1.")
        if self.use_weighting and any(t in ("aot", "aot_unpaired") for t in self.loss_type):
            raise ValueError("use_weighting (WPO) cannot combine with 'aot' / 'aot_unpaired' losses, which sort the "
                             "batch and would misalign the per-pair weights.")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must be in [0, 1], got {self.ld_alpha}.")
        if self.activation_offloading and not torch.cuda.is_available():
            raise ValueError("activation_offloading moves saved activations from the GPU to host memory; without a "
                             "CUDA device they are already there: remove activation_offloading.")
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError("sync_ref_model changes the reference during training, so its log-probs cannot be "
                             "precomputed: set precompute_ref_log_probs=False or sync_ref_model=False.")
