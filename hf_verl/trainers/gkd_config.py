"""`GKDConfig`: the field names and defaults of TRL 1.16's `trl.experimental.gkd.GKDConfig`, validated in
`__post_init__`.

TRL's GKDConfig is an SFTConfig; every SFTConfig field is accepted here with TRL's default (learning_rate=2e-5,
logging_steps=10, gradient_checkpointing=True, max_length=1024, ...). GKD skips SFT's dataset preparation (TRL sets
`skip_prepare_dataset`), so the SFT fields that only that preparation reads (`dataset_text_field`, `packing`,
`completion_only_loss`, `loss_type`, ...) are accepted and unused, as in TRL. GKD's own: `temperature=0.9` (of the
student's / teacher's sampling; the loss is at temperature 1, as in TRL), `lmbda=0.5`, `beta=0.5`,
`max_new_tokens=128`, `teacher_model_name_or_path`, `teacher_model_init_kwargs`, `disable_dropout=True`,
`seq_kd=False`.

hf_verl's additions: `placement` (`{"teacher": "colocated" | a backend | a server URL}`, docs/placement.md) and
`teacher_tokenizer_name_or_path` (GOLD's field: the teacher's tokenizer when it is not the student's, which turns on
the cross-tokenizer mode, docs/distillation.md). One departure as in the other configs: `bf16=None` turns on only on
bf16-capable CUDA.
"""

from __future__ import annotations

import json
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
class GKDConfig(ParallelArguments, TrainingArguments):
    """Configuration of :class:`~hf_verl.GKDTrainer` (a `transformers.TrainingArguments`); see the module docstring.

    Args:
        temperature (`float`, defaults to `0.9`): sampling temperature of on-policy (and `seq_kd`) completions.
        lmbda (`float`, defaults to `0.5`): the probability that a step trains on the student's own completions
            (else on the dataset's, or the teacher's with `seq_kd`).
        beta (`float`, defaults to `0.5`): the generalized JSD's interpolation, in [0, 1]; 0: forward KL
            `KL(teacher || student)`, 1: reverse KL `KL(student || teacher)`. Unused in the cross-tokenizer mode.
        max_new_tokens (`int`, defaults to `128`): tokens generated per completion.
        teacher_model_name_or_path (`str`, *optional*): the teacher's id or path (TRL's field; the trainer's
            `teacher_model` argument takes precedence).
        teacher_model_init_kwargs (`dict`, *optional*): keyword arguments of `from_pretrained` for a teacher given
            by id (`dtype` as a string or `torch.dtype`).
        disable_dropout (`bool`, defaults to `True`): set the student's dropout probabilities to 0.
        seq_kd (`bool`, defaults to `False`): on steps that are not on-policy, train on the teacher's own
            completions (sequence-level KD) instead of the dataset's.
        teacher_tokenizer_name_or_path (`str`, *optional*): the teacher's tokenizer when it is not the student's
            (cross-tokenizer mode).
        placement (`dict`, *optional*): `{"teacher": choice}`: `"colocated"` (default), a backend name (`"ddp"`,
            `"fsdp2"`, `"zero1"`-`"zero3"`) or the URL of a server that serves the teacher's prompt log-probs.
        model_init_kwargs, trust_remote_code, chat_template_path, dataset_text_field, dataset_kwargs,
        dataset_num_proc, eos_token, max_length, truncation_mode, shuffle_dataset, packing, packing_strategy,
        padding_free, pad_to_multiple_of, eval_packing, completion_only_loss, assistant_only_loss, loss_type,
        activation_offloading, pad_token, router_aux_loss_coef: TRL's SFTConfig fields (see the module docstring).
    """

    _front_end = "gkd"
    _placement_roles = ("teacher",)

    # TrainingArguments defaults SFTConfig overrides
    learning_rate: float = field(default=2e-5, metadata=_help("AdamW learning rate (TRL's SFT default)."))
    logging_steps: float = field(default=10, metadata=_help("Log every N steps."))
    gradient_checkpointing: bool = field(default=True, metadata=_help("Activation checkpointing (TRL's default)."))
    bf16: bool | None = field(default=None, metadata=_help("None: True on bf16-capable CUDA, else False."))

    # SFTConfig's fields
    model_init_kwargs: dict | str | None = field(default=None, metadata=_help(
        "kwargs of AutoModelForCausalLM.from_pretrained for a student given by id."))
    trust_remote_code: bool = field(default=False, metadata=_help("Allow custom model and tokenizer code from the Hub."))
    router_aux_loss_coef: float | None = field(default=None, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    chat_template_path: str | None = field(default=None, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    dataset_text_field: str = field(default="text", metadata=_help("SFT's; unused by GKD (as in TRL)."))
    dataset_kwargs: dict | str | None = field(default=None, metadata=_help(
        "SFT's dataset options; GKD sets skip_prepare_dataset=True (as TRL)."))
    dataset_num_proc: int | None = field(default=None, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    eos_token: str | None = field(default=None, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    max_length: int | None = field(default=1024, metadata=_help(
        "Longest prompt + completion of a dataset row (the oldest prompt tokens are dropped first)."))
    truncation_mode: str = field(default="keep_start", metadata=_help("SFT's; unused by GKD (as in TRL)."))
    shuffle_dataset: bool = field(default=False, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    packing: bool = field(default=False, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    packing_strategy: str = field(default="bfd", metadata=_help("SFT's; unused by GKD (as in TRL)."))
    padding_free: bool = field(default=False, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    pad_to_multiple_of: int | str | None = field(default="auto", metadata=_help(
        "SFT's; unused by GKD (as in TRL) ('auto': None off Neuron devices)."))
    eval_packing: bool | None = field(default=None, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    completion_only_loss: bool | None = field(default=None, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    assistant_only_loss: bool = field(default=False, metadata=_help("SFT's; unused by GKD (as in TRL)."))
    loss_type: str = field(default="nll", metadata=_help("SFT's; unused by GKD (as in TRL)."))
    activation_offloading: bool = field(default=False, metadata=_help(
        "Keep saved activations in pinned host memory until the backward (CUDA only)."))
    pad_token: str | None = field(default=None, metadata=_help(
        "Deprecated in TRL: the padding token (default: the tokenizer's pad, else its EOS)."))

    # GKDConfig's fields
    temperature: float = field(default=0.9, metadata=_help(
        "Temperature for sampling. The higher the temperature, the more random the completions."))
    lmbda: float = field(default=0.5, metadata=_help(
        "The probability that a step trains on the student's own (on-policy) completions."))
    beta: float = field(default=0.5, metadata=_help(
        "Interpolation of the generalized JSD in [0, 1]: 0 is KL(teacher || student), 1 is KL(student || teacher)."))
    max_new_tokens: int = field(default=128, metadata=_help("Maximum number of tokens to generate per completion."))
    teacher_model_name_or_path: str | None = field(default=None, metadata=_help(
        "The teacher's id or path (the trainer's teacher_model argument takes precedence)."))
    teacher_model_init_kwargs: dict | str | None = field(default=None, metadata=_help(
        "kwargs of AutoModelForCausalLM.from_pretrained for a teacher given by id."))
    disable_dropout: bool = field(default=True, metadata=_help("Whether to disable dropouts in `model`."))
    seq_kd: bool = field(default=False, metadata=_help(
        "Off-policy steps train on the teacher's own completions (sequence-level KD) instead of the dataset's."))

    # hf_verl's
    teacher_tokenizer_name_or_path: str | None = field(default=None, metadata=_help(
        "The teacher's tokenizer when it is not the student's: turns on the cross-tokenizer mode (GOLD's field)."))
    placement: dict | str | None = field(default=None, metadata=_help(
        "{'teacher': 'colocated' | backend | server URL}: where the teacher runs (docs/placement.md)."))

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()) and not self.fp16
        for name in ("model_init_kwargs", "teacher_model_init_kwargs", "dataset_kwargs", "placement"):
            value = getattr(self, name)
            if isinstance(value, str) and value.lstrip().startswith("{"):  # the command line passes JSON
                setattr(self, name, json.loads(value))
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.pad_token is not None:
            logger.warning("pad_token is deprecated (TRL); set tokenizer.pad_token instead.")
        self._adopt_launch_cpu()
        super().__post_init__()
        self._take_over_deepspeed()
        self._validate()

    def _validate(self) -> None:
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError("lmbda must be in the range [0.0, 1.0].")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError("beta must be in the range [0.0, 1.0].")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (GKD samples its completions), got {self.temperature}.")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {self.max_length}.")
        if self.activation_offloading and not torch.cuda.is_available():
            raise ValueError("activation_offloading moves saved activations from the GPU to host memory; without a "
                             "CUDA device they are already there: remove activation_offloading.")
