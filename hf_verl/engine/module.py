"""`EngineModule`: a training engine presented as the `nn.Module` a `transformers.Trainer` drives.

`transformers.Trainer` wraps its model for distributed training itself (through accelerate) unless
the module it trains is already a wrapper. The hf_verl trainers hand it an `EngineModule` over the
actor's engine instead: the Trainer then leaves the layout to the engine (DDP, FSDP2 or ZeRO,
chosen once in :mod:`hf_verl.parallel.backend`). The engine runs a whole accumulation window itself
(:meth:`~hf_verl.engine.base.TrainingEngine.forward_backward`, which reduces gradients once, with the last
micro-batch) and clips inside its own optimizer step, so the Trainer's `no_sync` around a micro-batch is a
no-op here and `zero_grad` reaches the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hf_verl.engine.base import TrainingEngine


class EngineModule(torch.nn.Module):
    """The engine's module as the Trainer's `model_wrapped` (see the module docstring).

    Args:
        engine ([`TrainingEngine`]): the actor's engine; its `module` may change when an optimizer
            is attached (DeepSpeed wraps then), so it is looked up on every call.
    """

    def __init__(self, engine: TrainingEngine) -> None:
        super().__init__()
        object.__setattr__(self, "engine", engine)  # not a submodule: parameters() is delegated below

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.module(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.engine.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.engine.module.named_parameters(*args, **kwargs)

    def train(self, mode: bool = True) -> EngineModule:
        self.engine.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # the engine decides where gradients are reduced within the window it runs (forward_backward)
        yield
