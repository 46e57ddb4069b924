"""The adapters part of an engine: PEFT adapters it can switch off, so that a LoRA actor is its own reference.

:func:`hf_verl.pipeline.phases.reference_logprobs` scores with the actor's adapters off when no reference model
is given; it asks :attr:`AdapterEngine.has_adapters` first. The default reads a `PeftModel`'s `disable_adapter`;
the Megatron engine switches off the LoRA branches it carries (:mod:`hf_verl.engine.megatron.adapters`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hf_verl.engine.parts.model import EngineModel


class AdapterEngine(EngineModel):
    """A role whose model may carry PEFT adapters (see the module docstring)."""

    @property
    def has_adapters(self) -> bool:
        """Whether the model carries PEFT adapters that :meth:`adapters_disabled` can switch off."""
        return hasattr(self.model, "disable_adapter")

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[AdapterEngine]:
        """This engine with its PEFT adapters switched off (the reference policy of a LoRA actor)."""
        disable = getattr(self.model, "disable_adapter", None)
        if disable is None:
            raise ValueError(f"the {self.role} model has no PEFT adapters to disable; give a reference model.")
        with disable():
            yield self
