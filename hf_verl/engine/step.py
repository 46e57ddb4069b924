"""The training engine's step contract: what a caller hands an engine for one optimizer step, and gets back.

An optimizer step is two calls on a :class:`~hf_verl.engine.base.TrainingEngine`:

1. ``engine.forward_backward(micro_batches, loss_fn, forward=request)``: the engine runs the forward and
   the backward of *every* micro-batch of the step, in whatever schedule its backend needs (a loop with
   gradient sync on the last micro-batch for DDP / FSDP2 / ZeRO; a pipeline schedule for a pipelined
   engine), and returns a :class:`StepResult`;
2. ``engine.optimizer_step()``: the global gradient norm, clipping, the optimizer and the LR schedule,
   all owned by the engine, which built them from an :class:`OptimizerSpec`.

What each micro-batch's forward computes is a *request* (:class:`LogProbs`, :class:`Values`,
:class:`SequenceScores`, or an algorithm's own object with a ``run(engine, micro_batch)`` method built on the
engine's forward primitives), so that an engine can serve the requests it knows in its own way: a
vocabulary-parallel engine answers :class:`LogProbs` without gathering the vocabulary, a pipelined one on its last
stage only. The loss function
sees one micro-batch's forward output and that micro-batch, and returns ``(loss, metrics)``; it must run no
collective (a pipeline schedule cannot host one): every normaliser or threshold that spans ranks is computed
before the step and carried on the micro-batch (:class:`~hf_verl.data.batch.LossInputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

# loss_fn(forward output, micro-batch) -> (loss scalar with graph, {metric name: float or 0-d tensor})
LossFn = Callable[[Any, Any], "tuple[torch.Tensor, dict[str, Any]]"]


class ForwardRequest(Protocol):
    """What an engine computes for one micro-batch (see the module docstring)."""

    def run(self, engine: Any, micro_batch: Any) -> Any: ...


@dataclass
class TokenQuery:
    """The arguments of one :meth:`~hf_verl.engine.base.TrainingEngine.token_logprobs` call, as data.

    A request whose forward is a single `token_logprobs` call followed by a reduction can say so: it offers
    `token_query(engine, micro_batch) -> TokenQuery | None` and `from_stats(stats, micro_batch)`, so that an
    engine that cannot run the whole model in one call (a pipeline, which runs the forward stage by stage and the
    reduction on the last stage) schedules it; `None` from `token_query` means "use `run`" (a layout of the
    engine's own, say)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    select: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    temperature: float = 1.0
    chunk_size: int = 1024
    with_entropy: bool = False
    with_mean_logit: bool = False
    with_aux_loss: bool = False
    with_log_sum_sq: bool = False

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `token_logprobs` (the three tensors are positional)."""
        return {k: getattr(self, k) for k in ("attention_mask", "position_ids", "temperature", "chunk_size",
                                              "with_entropy", "with_mean_logit", "with_aux_loss", "with_log_sum_sq")}


@dataclass(frozen=True)
class LogProbs:
    """The policy's `(B, C)` log-probs of a rollout's completion tokens (:meth:`TrainingEngine.logprobs`).

    The forward output is a :class:`PolicyOutput`.
    """

    temperature: float = 1.0
    chunk_size: int = 1024
    with_entropy: bool = False
    with_aux_loss: bool = False

    def run(self, engine: Any, micro_batch: Any) -> PolicyOutput:
        out = engine.logprobs(micro_batch, temperature=self.temperature, chunk_size=self.chunk_size,
                              with_entropy=self.with_entropy, with_aux_loss=self.with_aux_loss)
        take = getattr(engine, "take_routing_metrics", None)
        return PolicyOutput(logp=out[0], entropy=out[1], aux_loss=out[2] if self.with_aux_loss else None,
                            routing=take() if take is not None else {})


@dataclass(frozen=True)
class SamplingStatistics:
    """`((B, C) log-probs, (B, C) sum_v pi_v^2)` of a rollout's completion tokens, no gradient
    (:meth:`TrainingEngine.sampling_statistics`; the optimal-token-baseline estimators)."""

    temperature: float = 1.0
    chunk_size: int = 1024

    def run(self, engine: Any, micro_batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return engine.sampling_statistics(micro_batch, temperature=self.temperature, chunk_size=self.chunk_size)


@dataclass(frozen=True)
class Values:
    """A critic's `(B, C)` values of the states before each completion token (:meth:`TrainingEngine.values`)."""

    def run(self, engine: Any, micro_batch: Any) -> torch.Tensor:
        return engine.values(micro_batch)


def score_positions(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """`(B, T)` bool: the one position per row where a transformers sequence classifier reads its score, the
    rightmost token that is not `pad_token_id` (its `forward`'s rule, so that a score computed here equals the saved
    model's own; the last position when the model has no pad token)."""
    select = torch.zeros_like(input_ids, dtype=torch.bool)
    if pad_token_id is None:
        select[:, -1] = True
        return select
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    last = (positions * (input_ids != pad_token_id)).argmax(-1)
    select[torch.arange(input_ids.shape[0], device=input_ids.device), last] = True
    return select


@dataclass(frozen=True)
class SequenceScores:
    """A sequence classifier's (a reward model's) `(B,)` one-label scores of a padded batch's rows
    (`input_ids`, `attention_mask`), each read at :func:`score_positions` through the engine's value-head
    primitive (:meth:`~hf_verl.engine.parts.scoring.ModelScoring.token_values`)."""

    pad_token_id: int | None = None

    def run(self, engine: Any, micro_batch: Any) -> torch.Tensor:
        input_ids = micro_batch["input_ids"]
        select = score_positions(input_ids, self.pad_token_id)
        return engine.token_values(input_ids, select, attention_mask=micro_batch.get("attention_mask"))


@dataclass
class PolicyOutput:
    """The forward output of a :class:`LogProbs` request."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    routing: dict = field(default_factory=dict)  # a Mixture-of-Experts forward's routing metrics (hf_verl.moe)


@dataclass
class StepResult:
    """What :meth:`TrainingEngine.forward_backward` returns.

    Attributes:
        losses (`list[torch.Tensor]`): each micro-batch's loss, detached, as `loss_fn` returned it (before the
            engine's `loss_scale`).
        metrics (`list[dict]`): each micro-batch's metrics from `loss_fn`, values as floats.
        outputs (`list`): each micro-batch's forward output, detached, with `keep_outputs=True` (else empty).
        is_output_rank (`bool`): whether this rank computed the losses; on the others (the early stages of a
            pipeline) the engine broadcast them from the last stage, so every rank reads the same values.
    """

    losses: list[torch.Tensor] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    is_output_rank: bool = True

    @property
    def total_loss(self) -> torch.Tensor:
        """The sum of the micro-batch losses (0 for an empty step)."""
        return torch.stack(self.losses).sum() if self.losses else torch.zeros(())


@dataclass(frozen=True)
class SchedulerSpec:
    """An LR schedule by transformers' name (`transformers.get_scheduler`): `lr_scheduler_type`, warm-up and
    total optimizer steps, and the schedule's own kwargs."""

    name: str = "constant"
    num_warmup_steps: int = 0
    num_training_steps: int | None = None
    kwargs: dict = field(default_factory=dict)

    def build(self, optimizer: torch.optim.Optimizer):
        from transformers import get_scheduler

        return get_scheduler(self.name, optimizer, num_warmup_steps=self.num_warmup_steps,
                             num_training_steps=self.num_training_steps, scheduler_specific_kwargs=self.kwargs or None)


@dataclass
class OptimizerSpec:
    """How an engine builds its optimizer (it builds it over its own parameters, in its own layout).

    Args:
        optimizer_cls (`type`): the optimizer class (`torch.optim.AdamW`, or what transformers'
            `Trainer.get_optimizer_cls_and_kwargs` picks for `TrainingArguments.optim`).
        optimizer_kwargs (`dict`): its keyword arguments (`lr`, `betas`, `eps`, ...).
        weight_decay (`float`): the decay of the decayed parameters.
        decay_parameter_names (`set[str]`, *optional*): the parameter names that decay, the rest in a group
            without decay (transformers' grouping); `None`: one group, every parameter decays.
        max_grad_norm (`float`, *optional*): clip the global gradient norm to it in `optimizer_step` (`None` or
            0: no clipping, the norm is still computed).
        scheduler ([`SchedulerSpec`], *optional*): the LR schedule, stepped in `optimizer_step`.
        optimizer (`torch.optim.Optimizer`, *optional*): an optimizer the user built (TRL's `optimizers=`),
            adopted as it is; engines that must build their own (a distributed optimizer) refuse it.
        lr_scheduler (*optional*): the user's schedule for that optimizer.
    """

    optimizer_cls: type | None = None
    optimizer_kwargs: dict = field(default_factory=dict)
    weight_decay: float = 0.0
    decay_parameter_names: set[str] | frozenset[str] | None = None
    max_grad_norm: float | None = None
    scheduler: SchedulerSpec | None = None
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None

    def __post_init__(self) -> None:
        if self.optimizer is None and self.optimizer_cls is None:
            raise ValueError("OptimizerSpec needs optimizer_cls (with optimizer_kwargs) or a built optimizer.")

    def param_groups(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> list[dict]:
        """The trainable parameters in groups: transformers' decay / no-decay pair when
        `decay_parameter_names` is given, else one group with `weight_decay`."""
        trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
        if self.decay_parameter_names is None:
            return [{"params": [p for _, p in trainable], "weight_decay": self.weight_decay}]
        names = self.decay_parameter_names
        return [{"params": [p for n, p in trainable if n in names], "weight_decay": self.weight_decay},
                {"params": [p for n, p in trainable if n not in names], "weight_decay": 0.0}]

    def build(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        """The optimizer over `named_parameters` (the user's own one when given)."""
        if self.optimizer is not None:
            return self.optimizer
        kwargs = dict(self.optimizer_kwargs)
        kwargs.pop("weight_decay", None)  # carried per group
        return self.optimizer_cls(self.param_groups(named_parameters), **kwargs)
