"""The facade's roles (actor, critic, reference, reward): lazy sources and their forward passes.

A role is given as a Hub id or local path (loaded on first use, never at construction), a model
object, a PEFT model, a :class:`~hf_verl.rollout.base.RolloutEngine` (actor generation only) or,
for rewards, a callable or a reward model. :class:`LazyModel` holds the source and loads it the
first time :meth:`LazyModel.get` is called; with `HF_HUB_OFFLINE` set, an id missing from the
local cache fails at once with an error naming the role and the id.

The forward passes are module functions: :func:`token_logprobs` (actor / reference: completion
token log-probs from the final hidden states, in chunks) and :func:`token_values` (critic: the
backbone's hidden states through the sequence-classification `score` head, one value per
completion token, read at the position that predicts the token, as TRL's PPO does).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from hf_verl.algorithms.logprobs import logprobs_from_hidden
from hf_verl.data.batch import RolloutBatch

logger = logging.getLogger(__name__)


class RoleLoadError(OSError):
    """A role given as a Hub id or path could not be loaded."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def check_resolvable(role: str, model_id: str) -> None:
    """Fail fast, naming `role` and `model_id`, if an offline id is neither a folder nor cached."""
    if os.path.isdir(model_id) or not _offline():
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        raise RoleLoadError(
            f"cannot load the {role} model {model_id!r}: it is not a local folder and not in the Hub cache "
            f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}), and HF_HUB_OFFLINE is set. Download it "
            "first (`hf download <id>`), pass a local path, or pass a loaded model."
        )


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
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
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


def _position_ids(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model, batch: RolloutBatch, *, temperature: float, chunk_size: int = 1024,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `(B, C)` of the completion tokens under a causal LM (and entropy if asked).

    The logits are the final hidden states through the output embedding, made in chunks by
    :func:`~hf_verl.algorithms.logprobs.logprobs_from_hidden`, divided by `temperature` (the
    sampling convention of :mod:`hf_verl.rollout.base`; greedy counts as 1).
    """
    mask = batch.attention_mask
    out = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=_position_ids(mask),
                output_hidden_states=True, logits_to_keep=1, use_cache=False)
    C = batch.completion_ids.shape[1]
    hidden = out.hidden_states[-1][:, -C - 1 : -1]
    head = model.get_output_embeddings()
    return logprobs_from_hidden(hidden, head.weight, batch.completion_ids, bias=getattr(head, "bias", None),
                                temperature=temperature if temperature > 0 else 1.0, chunk_size=chunk_size,
                                with_entropy=with_entropy)


def _value_parts(critic) -> tuple[torch.nn.Module, torch.nn.Module]:
    base = critic.get_base_model() if is_peft_model(critic) else critic
    backbone = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    head = getattr(base, "score", None)
    if backbone is None or head is None:
        raise TypeError(
            f"the critic {type(base).__name__} has no backbone `{base.base_model_prefix}` and `score` head; "
            "pass an AutoModelForSequenceClassification model with num_labels=1."
        )
    return backbone, head


def token_values(critic, batch: RolloutBatch) -> torch.Tensor:
    """Values `(B, C)`: the critic's `score` head on the hidden state before each completion token."""
    backbone, head = _value_parts(critic)
    mask = batch.attention_mask
    hidden = backbone(input_ids=batch.input_ids, attention_mask=mask, position_ids=_position_ids(mask),
                      use_cache=False).last_hidden_state
    C = batch.completion_ids.shape[1]
    values = head(hidden[:, -C - 1 : -1])
    if values.shape[-1] != 1:
        raise ValueError(f"the critic's score head has {values.shape[-1]} outputs; it needs num_labels=1.")
    return values.squeeze(-1)
