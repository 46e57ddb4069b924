"""The facade's model roles (actor, critic, reference): sources that load on first use.

A role is given as a Hub id or local path (loaded on first use, never at construction), a model
object, a PEFT model, or a :class:`~hf_verl.rollout.base.RolloutEngine` (actor generation only).
:class:`LazyModel` holds the source and loads it the first time :meth:`LazyModel.get` is called;
with `HF_HUB_OFFLINE` set, an id missing from the local cache fails at once with an error naming
the role and the id (:func:`hf_verl.hub.check_resolvable`). Forward passes are the training
engines' (:mod:`hf_verl.engine`); reward sources are resolved by
:func:`hf_verl.rewards.reward_model.resolve_reward_sources`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from hf_verl.hub import RoleLoadError, check_resolvable

__all__ = ["LazyModel", "RoleLoadError", "is_peft_model", "model_device_dtype", "vocab_size"]

logger = logging.getLogger(__name__)


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _resolve_dtype(name: str):
    return "auto" if name == "auto" else getattr(torch, name)


class LazyModel:
    """A model role that loads its Hub id / path on first :meth:`get`.

    Args:
        role (`str`): the role's name, used in messages ("actor", "critic", "reference").
        source (`str` or `torch.nn.Module`): Hub id, local path or a model object.
        kind (`str`): "causal_lm" or "value" (sequence classification with one label).
        device (`str`, *optional*) / dtype (`str`): placement and dtype of loaded models.
    """

    def __init__(self, role: str, source: Any, kind: str, *, device: str | None = None,
                 dtype: str = "auto") -> None:
        if not isinstance(source, (str, os.PathLike, torch.nn.Module)):
            raise TypeError(
                f"{role}_model must be a Hub id, a local path or a model object, got {type(source).__name__}."
            )
        self.role = role
        self.kind = kind
        self.source = os.fspath(source) if isinstance(source, os.PathLike) else source
        self.device = device
        self.dtype = dtype
        self._model = source if isinstance(source, torch.nn.Module) else None
        self.on_load: list = []

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def name(self) -> str:
        if isinstance(self.source, str):
            return self.source
        return getattr(getattr(self._model, "config", None), "_name_or_path", "") or type(self._model).__name__

    def get(self) -> torch.nn.Module:
        """The model, loading it first if the role was given as an id or path."""
        if self._model is None:
            self._model = self._load()
            for hook in self.on_load:
                hook(self)
        return self._model

    def _load(self) -> torch.nn.Module:
        check_resolvable(self.role, self.source)
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cls = AutoModelForCausalLM if self.kind == "causal_lm" else AutoModelForSequenceClassification
        kwargs = {"num_labels": 1} if self.kind == "value" else {}
        logger.info("loading the %s model %s", self.role, self.source)
        try:
            model = cls.from_pretrained(self.source, dtype=_resolve_dtype(self.dtype), use_safetensors=True,
                                        trust_remote_code=False, **kwargs)
        except (OSError, ValueError) as err:
            raise RoleLoadError(f"cannot load the {self.role} model {self.source!r}: {err}") from err
        device = self.device or (f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
        return model.to(device)


def model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of a model's first floating parameter (CPU / float32 if none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of the input embedding (the vocabulary the model reads), or the config's vocab_size."""
    try:
        emb = model.get_input_embeddings()
        if emb is not None:
            return int(emb.weight.shape[0])
    except (AttributeError, NotImplementedError):
        pass
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return None if size is None else int(size)
