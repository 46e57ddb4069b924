"""The step part of an engine: an optimizer step's forwards and backwards, and the optimizer it owns.

An optimizer step is two calls (the contract is :mod:`hf_verl.engine.step`): :meth:`StepEngine.forward_backward`
runs the forward and the backward of every micro-batch of the step, reducing gradients once; then
:meth:`StepEngine.optimizer_step` takes the global gradient norm, clips, steps the optimizer and the LR schedule.
The engine builds both from an :class:`~hf_verl.engine.step.OptimizerSpec` (:meth:`StepEngine.configure_optimizer`),
over its own parameters in its own layout, and saves and restores their state.

Each micro-batch's forward is a request run on the engine itself (`forward.run(engine, micro_batch)`), so an engine
with this part also has the model-backed scoring part (:class:`~hf_verl.engine.parts.scoring.ModelScoring`) the
requests call; :class:`~hf_verl.engine.base.TrainingEngine` has both.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch

from hf_verl.engine.parts.model import EngineModel
from hf_verl.engine.step import ForwardRequest, LossFn, OptimizerSpec, SchedulerSpec, StepResult
from hf_verl.parallel import watchdog


class StepEngine(EngineModel):
    """A role trained by optimizer steps (see the module docstring)."""

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
                with sync, grad, self.routing_window():
                    with watchdog.phase(f"forward {i + 1}/{last + 1}", collective=self._forward_collective()):
                        output = forward.run(self, micro_batch)
                        loss, metrics = loss_fn(output, micro_batch)
                    result.losses.append(loss.detach())
                    result.metrics.append({k: float(v) for k, v in metrics.items()})
                    if keep_outputs:
                        result.outputs.append(detached(output))
                    # the forward's outputs must not outlive the backward: a branch the loss does not use (entropy
                    # with entropy_coef=0) would keep its saved tensors, a vocabulary-sized chunk each, through it
                    del output, metrics
                    if not forward_only:
                        with watchdog.phase(f"backward {i + 1}/{last + 1}",
                                            collective=self._backward_collective(reduces=i == last)):
                            self._backward(loss * loss_scale)
                    del loss
        return result

    def _backward_collective(self, reduces: bool) -> str | None:
        """The collective a backward waits in (the gradient reduction of the step's last micro-batch)."""
        if not reduces or self.dims.dp_size == 1:
            return None
        return "reduce_scatter" if self.backend.shards else "all_reduce"

    @abc.abstractmethod
    def _backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's (already scaled) loss; called by :meth:`forward_backward` only."""

    def routing_window(self) -> contextlib.AbstractContextManager:
        """A context around one micro-batch's forward and backward (a Mixture-of-Experts engine keeps a replayed
        routing in force through the backward's recomputation); none by default."""
        return contextlib.nullcontext()

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


def detached(output: Any) -> Any:
    """A forward output with every tensor detached (a tensor, a dataclass of tensors, or a tuple / list / dict)."""
    if isinstance(output, torch.Tensor):
        return output.detach()
    if is_dataclass(output) and not isinstance(output, type):
        return replace(output, **{f.name: detached(getattr(output, f.name)) for f in fields(output)})
    if isinstance(output, (tuple, list)):
        return type(output)(detached(x) for x in output)
    if isinstance(output, dict):
        return {k: detached(v) for k, v in output.items()}
    return output
