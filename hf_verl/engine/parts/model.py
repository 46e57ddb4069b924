"""`EngineModel`: what the local parts of a training engine stand on: the role's model, its layout and its mode.

The step (:class:`~hf_verl.engine.parts.stepping.StepEngine`), model-backed scoring
(:class:`~hf_verl.engine.parts.scoring.ModelScoring`), weights (:class:`~hf_verl.engine.parts.weights.WeightsEngine`)
and adapters (:class:`~hf_verl.engine.parts.adapters.AdapterEngine`) all read the same few things: the role's
name, its :class:`~hf_verl.parallel.dims.ParallelDims` and backend, the model (as the user knows it, and the module
forwards run through), and its train / eval mode, which a training step keeps and an inference pass switches off.
They are declared here once. A part that runs no local model (a served reference,
:class:`~hf_verl.engine.remote_reference.RemoteReference`) does not derive from it.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims


class EngineModel(abc.ABC):
    """One role's model on one parallel layout, and its train / eval mode.

    Attributes:
        role (`str`): "actor", "critic", "reference" or "reward".
        dims ([`ParallelDims`]): the layout; the only source of ranks and groups.
        backend ([`BackendSpec`]): plain, DDP, FSDP2, DeepSpeed ZeRO or Megatron.
        trainable (`bool`): whether the engine runs backward / optimizer steps.
    """

    role: str
    dims: ParallelDims
    backend: BackendSpec
    trainable: bool

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
    def config(self) -> Any:
        """The model's `PretrainedConfig` (sizes, token ids), or None."""
        return getattr(self.model, "config", None)

    @property
    @abc.abstractmethod
    def training(self) -> bool:
        """Whether the engine is in train mode (dropout on)."""

    @abc.abstractmethod
    def train(self, mode: bool = True) -> None: ...

    def eval(self) -> None:
        self.train(False)

    def _forward_collective(self) -> str | None:
        """The collective a forward of this engine may wait in, for the watchdog: a sharded layout gathers its
        parameters, a DDP replica broadcasts its buffers; None on one process (a forward is local work)."""
        if self.dims.world_size == 1:
            return None
        return "all_gather" if self.backend.partitions_parameters else (
            "broadcast" if self.dims.dp_size > 1 and self.trainable else None)
