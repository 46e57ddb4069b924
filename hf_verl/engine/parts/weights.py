"""The weights part of an engine: its weights out (HF-named, whole) and in, and its checkpoints.

Weights leave an engine HF-named whatever its layout: :meth:`WeightsEngine.export_weights` streams them bucket by
bucket (the weight sync to a rollout engine; a collective on sharded layouts), :meth:`WeightsEngine.full_state_dict`
gathers them on the main rank, :meth:`WeightsEngine.save_pretrained` writes the HF model. What resuming needs
beyond them (optimizer and schedule state, one shard per rank where sharded) is
:meth:`WeightsEngine.save_checkpoint` / :meth:`WeightsEngine.load_checkpoint`. The rest is what other roles may
know of the weights: whether a rank holds them whole (so a rollout engine may share the tensors), the HF keys a
checkpoint must hold, mixing another engine's weights in (TR-DPO's reference update).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch

from hf_verl.engine.parts.model import EngineModel


class WeightsEngine(EngineModel):
    """A role whose weights can be exported, saved and restored (see the module docstring)."""

    @property
    def holds_full_weights(self) -> bool:
        """Whether every rank holds every parameter whole between forwards (not FSDP2 / ZeRO-3), so that
        another model, such as a rollout engine, may share the parameter tensors."""
        return not self.backend.partitions_parameters

    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                       to_cpu: bool = False, lora: str = "merged") -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors, bucket by bucket (a collective on sharded layouts: every rank iterates); a PEFT
        actor's `lora` part: `"merged"`, `"base"` or `"adapter"` (adapter-only sync)."""

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

    def state_dict_keys(self) -> tuple[set[str], set[str]]:
        """`(the HF state-dict keys of the model, the keys tied to another one)`: what a checkpoint must hold."""
        model = self.model
        return set(model.state_dict().keys()), set(getattr(model, "_tied_weights_keys", None) or [])

    @torch.no_grad()
    def mix_weights_from(self, source: WeightsEngine, alpha: float) -> None:
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
