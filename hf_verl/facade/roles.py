"""The facade's model roles (actor, critic, reference): sources that load on first use.

A role is given as a Hub id or local path (loaded on first use, never at construction), a model
object, a PEFT model, or a :class:`~hf_verl.rollout.base.RolloutEngine` (actor generation only).
:class:`LazyModel` holds the source and loads it the first time :meth:`LazyModel.get` is called,
given the role's layout: under FSDP2 or ZeRO-3 over 2+ data-parallel shards an id or path loads
sharded (:func:`~hf_verl.parallel.sharded_load.load_sharded`, no rank holds the whole model; see
docs/loading.md), otherwise with `from_pretrained`; a model object is used as given;
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

    def get(self, layout: Any = None) -> torch.nn.Module:
        """The model, loading it first if the role was given as an id or path.

        Args:
            layout ([`~hf_verl.engine.registry.RoleLayout`], *optional*): the layout the role will run on. Where
                :func:`~hf_verl.parallel.sharded_load.sharded_load_applies` holds for it (FSDP2 or ZeRO-3 over 2+
                data-parallel shards), an id or path loads sharded: each rank reads only its own part, and the model
                comes back pending (FSDP2, filled by its engine) or partitioned (ZeRO-3); it must not be moved.
                Otherwise, or without a layout, the model loads whole with `from_pretrained`. Ignored once loaded
                and for a model object.

        Returns:
            `torch.nn.Module`: the role's model.

        Raises:
            RoleLoadError: the id or path cannot be loaded.
        """
        if self._model is None:
            self._model = self._load(layout)
            for hook in self.on_load:
                hook(self)
        return self._model

    def _load(self, layout: Any = None) -> torch.nn.Module:
        check_resolvable(self.role, self.source)
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
        )

        cls = AutoModelForCausalLM if self.kind == "causal_lm" else AutoModelForSequenceClassification
        kwargs = {"num_labels": 1} if self.kind == "value" else {}
        if layout is not None:
            from hf_verl.parallel.sharded_load import sharded_load_applies

            if sharded_load_applies(layout) and self._checkpoint_covers(cls, kwargs):
                return self._load_sharded(layout, cls, kwargs)
        logger.info("loading the %s model %s", self.role, self.source)
        try:
            model = cls.from_pretrained(self.source, dtype=_resolve_dtype(self.dtype), use_safetensors=True,
                                        trust_remote_code=False, **kwargs)
        except (OSError, ValueError) as err:
            raise RoleLoadError(f"cannot load the {self.role} model {self.source!r}: {err}") from err
        device = self.device or (f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
        return model.to(device)

    def _sharded_dtype(self) -> torch.dtype:
        """The dtype a sharded load builds in: the configured one, or for "auto" the checkpoint config's (float32
        when it names none), as `from_pretrained(dtype="auto")` picks it."""
        if self.dtype != "auto":
            return _resolve_dtype(self.dtype)
        from transformers import AutoConfig

        dtype = getattr(AutoConfig.from_pretrained(self.source, trust_remote_code=False), "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return dtype or torch.float32

    def _checkpoint_covers(self, cls, kwargs: dict) -> bool:
        """Whether the checkpoint holds every parameter of the model `cls` builds (names as the model registers
        them; tied weights under any of their names). A value head new to a causal-LM checkpoint is not there:
        `from_pretrained` initialises it, which a sharded load cannot, so such a role loads whole (logged)."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig

        from hf_verl.parallel.sharded_load import (
            SafetensorsCheckpoint,
            resolve_checkpoint,
        )

        try:
            checkpoint = SafetensorsCheckpoint(resolve_checkpoint(self.source))
        except (OSError, ValueError) as err:
            logger.info("loading the %s model %s whole on every rank: %s", self.role, self.source, err)
            return False
        config = AutoConfig.from_pretrained(self.source, trust_remote_code=False, **kwargs)
        with init_empty_weights():
            model = cls.from_config(config, trust_remote_code=False)
        names: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        missing = [group[0] for group in names.values() if not any(n in checkpoint for n in group)]
        if missing:
            logger.info("loading the %s model %s whole on every rank: its checkpoint has no weights for %s (new "
                        "parameters are initialised by from_pretrained, which a sharded load cannot do)", self.role,
                        self.source, missing[:3])
        return not missing

    def _load_sharded(self, layout: Any, cls, kwargs: dict) -> torch.nn.Module:
        from hf_verl.parallel.sharded_load import load_sharded

        logger.info("loading the %s model %s sharded for %s: each rank reads its own part", self.role, self.source,
                    layout.label)
        try:
            return load_sharded(self.source, layout, auto_class=cls, dtype=self._sharded_dtype(),
                                trust_remote_code=False, **kwargs)
        except (OSError, ValueError) as err:
            raise RoleLoadError(f"cannot load the {self.role} model {self.source!r} sharded: {err}") from err


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
        if emb is not None:  # a ZeRO-3 partitioned weight keeps its shape in ds_shape
            return int(getattr(emb.weight, "ds_shape", emb.weight.shape)[0])
    except (AttributeError, NotImplementedError):
        pass
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return None if size is None else int(size)
