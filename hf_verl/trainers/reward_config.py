"""`RewardConfig`: the field names and defaults of TRL's RewardConfig (1.16), validated in `__post_init__`.

Shared with TRL: learning_rate=1e-4, logging_steps=10, gradient_checkpointing=True, model_init_kwargs,
trust_remote_code, chat_template_path, disable_dropout=True, dataset_num_proc, eos_token, max_length=1024 (pairs
with a longer chosen or rejected sequence are dropped, not truncated), pad_to_multiple_of="auto",
center_rewards_coefficient=None, activation_offloading=False, the deprecated pad_token; and TrainingArguments'
`remove_unused_columns=True` (the trainer keeps its token columns and `margin`). One departure as in the other
configs: `bf16=None` turns on only on bf16-capable CUDA (TRL turns it on everywhere). Reward modelling is
supervised, not RL: none of the RL settings of :mod:`hf_verl.settings` apply.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from hf_verl.data.batch import resolve_pad_to_multiple_of
from hf_verl.trainers.parallel_args import ParallelArguments

logger = logging.getLogger(__name__)


def _help(text: str) -> Any:
    return {"help": text}


@dataclass
class RewardConfig(ParallelArguments, TrainingArguments):
    """Configuration of :class:`~hf_verl.RewardTrainer` (a `transformers.TrainingArguments`); see the module
    docstring.

    Args:
        model_init_kwargs (`dict`, *optional*): keyword arguments of
            `AutoModelForSequenceClassification.from_pretrained` when the model is given by id or path (float32
            unless a `dtype` is named; `num_labels` is always 1).
        trust_remote_code (`bool`, defaults to `False`): allow model and tokenizer code from the Hub.
        chat_template_path (`str`, *optional*): a Jinja file (`.jinja` / `.j2`) or a tokenizer (path or id) whose
            chat template the tokenizer takes; a tokenizer's missing added tokens and its EOS come with it (the
            model's embeddings are resized).
        disable_dropout (`bool`, defaults to `True`): set every dropout probability to 0.
        dataset_num_proc (`int`, *optional*): processes for tokenisation.
        eos_token (`str`, *optional*): the token ending a text answer and a turn (default the tokenizer's).
        max_length (`int`, *optional*, defaults to `1024`): pairs whose chosen or rejected sequence is longer are
            dropped; None keeps every pair.
        pad_to_multiple_of (`int` or `str`, *optional*, defaults to `"auto"`): round each batch's length up to a
            multiple of this ("auto": None off Neuron devices).
        center_rewards_coefficient (`float`, *optional*): weight of the term keeping scores near zero (Eisenstein et
            al., 2023; 0.01 is the usual value); None: off.
        activation_offloading (`bool`, defaults to `False`): keep saved activations in pinned host memory until the
            backward (CUDA only).
        pad_token (`str`, *optional*): deprecated in TRL; set `tokenizer.pad_token` instead.
    """

    learning_rate: float = field(default=1e-4, metadata=_help("AdamW learning rate (TRL's default)."))
    logging_steps: float = field(default=10, metadata=_help("Log every N steps."))
    gradient_checkpointing: bool = field(default=True, metadata=_help("Activation checkpointing (TRL's default)."))
    bf16: bool | None = field(default=None, metadata=_help("None: True on bf16-capable CUDA, else False."))

    model_init_kwargs: dict | str | None = field(default=None, metadata=_help(
        "kwargs of AutoModelForSequenceClassification.from_pretrained for a model id."))
    trust_remote_code: bool = field(default=False, metadata=_help("Allow custom model and tokenizer code from the Hub."))
    chat_template_path: str | None = field(default=None, metadata=_help(
        "A Jinja template file, or a tokenizer (path or id) whose chat template to take."))
    disable_dropout: bool = field(default=True, metadata=_help("Set every dropout probability to 0."))
    dataset_num_proc: int | None = field(default=None, metadata=_help("Processes for tokenisation."))
    eos_token: str | None = field(default=None, metadata=_help(
        "The token ending a text answer or a turn; default the tokenizer's EOS."))
    max_length: int | None = field(default=1024, metadata=_help(
        "Pairs with a chosen or rejected sequence longer than this are dropped; None: no limit."))
    pad_to_multiple_of: int | str | None = field(default="auto", metadata=_help(
        "Pad each batch's length to a multiple of this ('auto': None off Neuron devices, as in TRL)."))
    center_rewards_coefficient: float | None = field(default=None, metadata=_help(
        "Weight of coef * mean((r_chosen + r_rejected)^2), keeping rewards near zero (0.01 recommended); None: off."))
    activation_offloading: bool = field(default=False, metadata=_help(
        "Keep saved activations in pinned host memory until the backward (CUDA only)."))
    pad_token: str | None = field(default=None, metadata=_help(
        "Deprecated in TRL: the padding token (default: the tokenizer's pad, else its EOS)."))

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()) and not self.fp16
        if isinstance(self.model_init_kwargs, str):  # the command line passes JSON
            import json

            self.model_init_kwargs = json.loads(self.model_init_kwargs)
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.pad_token is not None:
            logger.warning("pad_token is deprecated (TRL); set tokenizer.pad_token instead.")
        self._adopt_launch_cpu()
        super().__post_init__()
        self._take_over_deepspeed()
        self._validate()

    def _validate(self) -> None:
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {self.max_length}.")
        coef = self.center_rewards_coefficient
        if coef is not None and not (isinstance(coef, (int, float)) and coef >= 0):
            raise ValueError(f"center_rewards_coefficient must be a float >= 0 or None, got {coef!r}.")
        if self.activation_offloading and not torch.cuda.is_available():
            raise ValueError("activation_offloading moves saved activations from the GPU to host memory; without a "
                             "CUDA device they are already there: remove activation_offloading.")
