"""`TrainingEngine`: what every model role (actor, critic, reference, reward model) offers the RL code.

The trainers and the facade never touch a model directly. They ask its engine for token
log-probs / entropy / values of a batch (`infer`), hand it every micro-batch of an optimizer step with a
loss function (`forward_backward`, :mod:`hf_verl.engine.step`) and then `optimizer_step`, stream its full
HF-named weights to a rollout engine, save and load it, and switch it between train and eval.
How the model is laid out (one device, DDP replicas, FSDP2 shards, ZeRO partitions, or, later,
Megatron-Core tensor and pipeline ranks) is the engine's business alone: it gathers inside when a
result needs whole rows, and a Megatron engine implements the same methods over its own model.

Two forward primitives carry everything:

- :meth:`TrainingEngine.token_logprobs`: log-probs (and entropy, mean logit) of chosen next tokens
  at selected positions of a batch of sequences, padded or packed; RL rollouts and DPO pairs are
  both expressed as (input ids, positions, targets);
- :meth:`TrainingEngine.token_values`: a value head's output at selected positions (the critic).

:meth:`TrainingEngine.logprobs` and :meth:`TrainingEngine.values` express a
:class:`~hf_verl.data.batch.RolloutBatch` (left-padded prompt, right-padded completion) in those terms and return
`(B, C)` tensors aligned with `completion_ids`, zero on padding. How rows are laid out for a forward (padded,
packed padding-free, each prompt laid out once) is an engine's own policy: transformers-based engines take
:class:`~hf_verl.engine.hf_layouts.HFLayouts`; a Megatron engine would have its own.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.step import (
    ForwardRequest,
    LossFn,
    OptimizerSpec,
    PolicyOutput,
    SchedulerSpec,
    StepResult,
)
from hf_verl.parallel import watchdog
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims


@dataclass
class TokenStats:
    """Per-position results of :meth:`TrainingEngine.token_logprobs`, one entry per selected position
    (row-major order of the selection mask)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    mean_logit: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None  # a Mixture of Experts' router load-balancing loss, when asked
    log_sum_sq: torch.Tensor | None = None  # log sum_v p_v^2 per position (no gradient), when asked


class TrainingEngine(abc.ABC):
    """One model role on one parallel layout (see the module docstring).

    Attributes:
        role (`str`): "actor", "critic", "reference" or "reward".
        dims ([`ParallelDims`]): the layout; the only source of ranks and groups.
        backend ([`BackendSpec`]): plain, DDP, FSDP2 or DeepSpeed ZeRO.
        trainable (`bool`): whether the engine runs backward / optimizer steps.
        padding_free / shared_prefix (`bool`, *optional*): the layout switches of engines that lay rows out
            themselves (:class:`~hf_verl.engine.hf_layouts.HFLayouts`).
    """

    role: str
    dims: ParallelDims
    backend: BackendSpec
    trainable: bool
    padding_free: bool | None = None
    shared_prefix: bool | None = None

    # ------------------------------------------------------------------ models
    @property
    @abc.abstractmethod
    def model(self) -> torch.nn.Module:
        """The model as the user knows it (a `PreTrainedModel` or `PeftModel`), without wrappers."""

    @property
    @abc.abstractmethod
    def module(self) -> torch.nn.Module:
        """The module forward passes run through (a DDP / DeepSpeed wrapper, an FSDP2 root, or the model)."""

    @property
    def device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's (first) parameters."""
        for p in self.model.parameters():
            return p.dtype
        return torch.float32

    @property
    def holds_full_weights(self) -> bool:
        """Whether every rank holds every parameter whole between forwards (not FSDP2 / ZeRO-3), so that
        another model, such as a rollout engine, may share the parameter tensors."""
        return not self.backend.partitions_parameters

    # ------------------------------------------------------------------ forward primitives
    @abc.abstractmethod
    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, select: torch.Tensor, *,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                       temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                       with_mean_logit: bool = False, with_aux_loss: bool = False,
                       with_log_sum_sq: bool = False) -> TokenStats:
        """Log-probs of `targets[select]` given the prefix up to each selected position (and the router
        load-balancing loss of a Mixture-of-Experts model with `with_aux_loss`).

        Args:
            input_ids (`torch.Tensor` `(B, T)`): token ids (padded rows, or one packed row).
            targets (`torch.Tensor` `(B, T)`): at each selected position, the next token to score.
            select (`torch.Tensor` `(B, T)` bool): the positions to score; or `(N,)` long, flat positions into
                `B * T` in the order of the result, with `targets` `(N,)` (see :func:`select_positions`).
            attention_mask / position_ids: as the model takes them (packed rows: position ids only).
            temperature (`float`): logits are divided by it. chunk_size (`int`): positions per LM-head chunk.
            with_entropy / with_mean_logit (`bool`): also return those per position.
        """

    @abc.abstractmethod
    def token_values(self, input_ids: torch.Tensor, select: torch.Tensor, *,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The value head at `select` positions `(N,)` (a critic: sequence-classification model, one label)."""

    @abc.abstractmethod
    def logprobs(self, batch: RolloutBatch, *, temperature: float = 1.0, chunk_size: int = 1024,
                 with_entropy: bool = False, with_aux_loss: bool = False):
        """`(B, C)` log-probs of a rollout's completion tokens (and entropy if asked), 0 on padding.

        Returns:
            `(logp, entropy)`; with `with_aux_loss`, `(logp, entropy, aux_loss)` where `aux_loss` is the
            model's router load-balancing loss of this forward (a Mixture-of-Experts model).
        """

    @abc.abstractmethod
    def sampling_statistics(self, batch: RolloutBatch, *, temperature: float = 1.0,
                            chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, C)` log-probs of a rollout's completion tokens and `sum_v pi_v^2` at each of them (no gradient;
        0 on padding)."""

    @abc.abstractmethod
    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """`(B, C)` critic values of the states before each completion token, 0 on padding."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context of this engine's forwards (none by default)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[TrainingEngine]:
        """This engine with its PEFT adapters switched off (the reference policy of a LoRA actor)."""
        disable = getattr(self.model, "disable_adapter", None)
        if disable is None:
            raise ValueError(f"the {self.role} model has no PEFT adapters to disable; give a reference model.")
        with disable():
            yield self

    # ------------------------------------------------------------------ the step
    def forward_backward(self, micro_batches: Sequence[Any], loss_fn: LossFn, *, forward: ForwardRequest,
                         forward_only: bool = False, loss_scale: float = 1.0,
                         keep_outputs: bool = False) -> StepResult:
        """Run the forward (and, unless `forward_only`, the backward) of every micro-batch of one optimizer step.

        Gradients accumulate over the micro-batches and are reduced across data-parallel ranks once, with the last
        micro-batch's backward (DDP's `no_sync`, FSDP2's deferred reduce-scatter, ZeRO's accumulation boundary);
        the caller then calls :meth:`optimizer_step`. The engine keeps its train / eval mode as it is.

        Args:
            micro_batches (`Sequence`): the step's micro-batches (a [`RolloutBatch`] or whatever `forward` takes).
            loss_fn (`Callable`): `loss_fn(forward_output, micro_batch) -> (loss, metrics)`; runs no collective.
            forward ([`ForwardRequest`]): what each micro-batch's forward computes ([`LogProbs`], [`Values`], ...).
            forward_only (`bool`): no graph and no backward (evaluation, thresholds computed before a step).
            loss_scale (`float`): each loss is multiplied by it before its backward (e.g. 1 / accumulation steps);
                the returned losses are unscaled.
            keep_outputs (`bool`): also return each micro-batch's forward output, detached.

        Returns:
            [`StepResult`]: per micro-batch, the loss (detached) and the metrics.
        """
        if not forward_only and not self.trainable:
            raise ValueError(f"the {self.role} engine is frozen; it runs no backward.")
        result = StepResult()
        last = len(micro_batches) - 1
        with watchdog.phase("forward_backward", role=self.role):
            for i, micro_batch in enumerate(micro_batches):
                sync = contextlib.nullcontext() if forward_only or i == last else self.no_sync()
                grad = torch.no_grad() if forward_only else contextlib.nullcontext()
                with sync, grad:
                    with watchdog.phase(f"forward {i + 1}/{last + 1}", collective=self._forward_collective()):
                        output = forward.run(self, micro_batch)
                        loss, metrics = loss_fn(output, micro_batch)
                    result.losses.append(loss.detach())
                    result.metrics.append({k: float(v) for k, v in metrics.items()})
                    if keep_outputs:
                        result.outputs.append(_detached(output))
                    # the forward's outputs must not outlive the backward: a branch the loss does not use (entropy
                    # with entropy_coef=0) would keep its saved tensors, a vocabulary-sized chunk each, through it
                    del output, metrics
                    if not forward_only:
                        with watchdog.phase(f"backward {i + 1}/{last + 1}",
                                            collective=self._backward_collective(reduces=i == last)):
                            self._backward(loss * loss_scale)
                    del loss
        return result

    def _forward_collective(self) -> str | None:
        """The collective a forward of this engine may wait in, for the watchdog: a sharded layout gathers its
        parameters, a DDP replica broadcasts its buffers; None on one process (a forward is local work)."""
        if self.dims.world_size == 1:
            return None
        return "all_gather" if self.backend.partitions_parameters else (
            "broadcast" if self.dims.dp_size > 1 and self.trainable else None)

    def _backward_collective(self, reduces: bool) -> str | None:
        """The collective a backward waits in (the gradient reduction of the step's last micro-batch)."""
        if not reduces or self.dims.dp_size == 1:
            return None
        return "reduce_scatter" if self.backend.shards else "all_reduce"

    @torch.no_grad()
    def infer(self, batch: Any, forward: ForwardRequest, *, micro_batch: int | None = None) -> Any:
        """`forward` over `batch` without gradients, in eval mode, `micro_batch` rows at a time (the reference's
        and the old policy's log-probs, a critic's values); tensor outputs are concatenated over the rows and a
        :class:`PolicyOutput` field by field. The engine's train / eval mode is restored afterwards."""
        was_training = self.training
        self.train(False)
        name = "".join("_" + c.lower() if c.isupper() else c for c in type(forward).__name__).lstrip("_")
        try:
            with watchdog.phase(name, role=self.role), watchdog.phase("forward", collective=self._forward_collective()):
                if micro_batch is None:  # one forward over the whole batch (any type the request takes)
                    parts = [forward.run(self, batch)]
                else:
                    size = max(1, micro_batch)
                    parts = [forward.run(self, batch.select(slice(i, i + size)))
                             for i in range(0, batch.batch_size, size)]
        finally:
            self.train(was_training)
        return _concat(parts)

    @property
    @abc.abstractmethod
    def training(self) -> bool:
        """Whether the engine is in train mode (dropout on)."""

    @abc.abstractmethod
    def train(self, mode: bool = True) -> None: ...

    def eval(self) -> None:
        self.train(False)

    @abc.abstractmethod
    def _backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's (already scaled) loss; called by :meth:`forward_backward` only."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context in which a forward and backward accumulate local gradients without reducing them."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ the optimizer
    @abc.abstractmethod
    def configure_optimizer(self, spec: OptimizerSpec) -> None:
        """Build this engine's optimizer (and LR schedule, when `spec.scheduler` is set) over its own parameters
        in its own layout (a DeepSpeed engine initialises DeepSpeed here)."""

    @abc.abstractmethod
    def configure_scheduler(self, spec: SchedulerSpec | None = None, scheduler: Any = None) -> None:
        """Set the LR schedule after :meth:`configure_optimizer`: built from `spec`, or the user's `scheduler`."""

    @property
    @abc.abstractmethod
    def has_optimizer(self) -> bool:
        """Whether :meth:`configure_optimizer` has run."""

    @abc.abstractmethod
    def optimizer_step(self) -> float | None:
        """The global gradient norm over every rank and parameter shard, clipping to the spec's `max_grad_norm`,
        the optimizer step, the LR schedule's step, and zeroed gradients. Returns the norm before clipping (None
        if the backend reports none)."""

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @property
    @abc.abstractmethod
    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups (their `lr` and `weight_decay` may be changed in place)."""

    @abc.abstractmethod
    def optimizer_state_dict(self) -> dict:
        """The optimizer's state (this rank's shard on sharded layouts)."""

    @abc.abstractmethod
    def load_optimizer_state_dict(self, state: dict) -> None: ...

    @abc.abstractmethod
    def scheduler_state_dict(self) -> dict | None: ...

    @abc.abstractmethod
    def load_scheduler_state_dict(self, state: dict) -> None: ...

    @abc.abstractmethod
    def last_lr(self) -> list[float]:
        """The learning rate of every parameter group now."""

    # ------------------------------------------------------------------ weights and checkpoints
    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                       to_cpu: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors, bucket by bucket (a collective on sharded layouts: every rank iterates)."""

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole, HF-named state dict on the main rank (empty elsewhere); a collective."""

    @abc.abstractmethod
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole, HF-named weights into the (possibly sharded) model; a collective when sharded."""

    @abc.abstractmethod
    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """The HF export: `save_pretrained` of the whole model on the main rank (a collective when sharded)."""

    @abc.abstractmethod
    def save_checkpoint(self, output_dir: str) -> None:
        """Save what resuming needs beyond the HF weights (optimizer and schedule; one shard per rank on sharded
        layouts); a collective."""

    @abc.abstractmethod
    def load_checkpoint(self, input_dir: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""

    # ------------------------------------------------------------------ what other roles may know of the model
    @property
    def config(self) -> Any:
        """The model's `PretrainedConfig` (sizes, token ids), or None."""
        return getattr(self.model, "config", None)

    @property
    def has_adapters(self) -> bool:
        """Whether the model carries PEFT adapters that :meth:`adapters_disabled` can switch off."""
        return hasattr(self.model, "disable_adapter")

    def state_dict_keys(self) -> tuple[set[str], set[str]]:
        """`(the HF state-dict keys of the model, the keys tied to another one)`: what a checkpoint must hold."""
        model = self.model
        return set(model.state_dict().keys()), set(getattr(model, "_tied_weights_keys", None) or [])

    @torch.no_grad()
    def mix_weights_from(self, source: TrainingEngine, alpha: float) -> None:
        """`self <- (1 - alpha) self + alpha source`, parameter by parameter (TR-DPO / TRL's `sync_ref_model`; both
        engines on one layout, so that shards line up)."""
        mine, theirs = list(self.model.parameters()), list(source.model.parameters())
        if len(mine) != len(theirs):
            raise ValueError(f"the {self.role} has {len(mine)} parameters but the {source.role} {len(theirs)}: "
                             "cannot mix.")
        for r, p in zip(mine, theirs):
            r.lerp_(p.detach().to(r.dtype), alpha)

    def shares_weights_with(self, module: Any) -> bool:
        """Whether `module` is this engine's own model (a colocated rollout engine generating on its tensors)."""
        return module is not None and module is self.model

    def rollout_model(self) -> torch.nn.Module:
        """The model, unwrapped, for a rollout engine colocated on the same tensors (a transformers engine on the
        actor) or for building one (vLLM's `from_model`, a copy for asynchronous rollout).

        Raises:
            ValueError: on a layout that partitions parameters (FSDP2, ZeRO-3): no rank holds the whole model.
        """
        if not self.holds_full_weights:
            raise ValueError(f"the {self.role} engine ({self.backend.label}) partitions its parameters: no rank holds "
                             "a whole model to generate with; generate on a replica kept in step by weight sync.")
        return self.model


def _detached(output: Any) -> Any:
    """A forward output with every tensor detached (a tensor, a dataclass of tensors, or a tuple / list / dict)."""
    if isinstance(output, torch.Tensor):
        return output.detach()
    if is_dataclass(output) and not isinstance(output, type):
        return replace(output, **{f.name: _detached(getattr(output, f.name)) for f in fields(output)})
    if isinstance(output, (tuple, list)):
        return type(output)(_detached(x) for x in output)
    if isinstance(output, dict):
        return {k: _detached(v) for k, v in output.items()}
    return output


def _concat(parts: list[Any]) -> Any:
    """Concatenate per-chunk outputs over their rows: tensors, :class:`PolicyOutput` field by field, tuples
    element by element (a `None` field stays None)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(parts).mean() if first.dim() == 0 else torch.cat(parts)  # a scalar: its mean
    if isinstance(first, PolicyOutput):
        return PolicyOutput(*(_concat([getattr(p, f.name) for p in parts]) for f in fields(PolicyOutput)))
    if isinstance(first, tuple):
        return tuple(_concat(list(items)) for items in zip(*parts))
    if first is None:
        return None
    raise TypeError(f"infer() cannot concatenate outputs of type {type(first).__name__}; run one chunk "
                    "(micro_batch=None) or return tensors.")
