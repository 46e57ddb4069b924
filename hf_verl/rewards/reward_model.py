"""Reward models from the Hub or a local folder, scored on decoded text with their own tokenizer.

A reward model (`AutoModelForSequenceClassification`, `num_labels=1`) usually has a different
tokenizer from the policy, so it never sees the policy's token ids: the prompt and completion
texts are joined (standard format) or rendered with the reward model's own chat template
(conversational format) and tokenised by the reward model's tokenizer. The score is the single
logit. Loading is lazy (first call) and refuses to wait on the network in offline mode: an id
that is not in the local Hub cache fails at once with a message saying so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from hf_verl.data.prompts import is_conversational

logger = logging.getLogger(__name__)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def check_resolvable(model_id: str) -> None:
    """Fail fast if `model_id` is neither a local folder nor (when offline) in the Hub cache."""
    if os.path.isdir(model_id):
        return
    if _offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(model_id, "config.json"), str):
            raise ValueError(
                f"reward model {model_id!r} is not a local folder and is not in the Hub cache "
                f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}), and HF_HUB_OFFLINE is set. "
                "Download it first (huggingface-cli download) or pass a local path."
            )


class RewardModelScorer:
    """A reward function backed by a sequence-classification reward model.

    Args:
        model (`str` or `PreTrainedModel`): Hub id, local path, or a loaded model.
        tokenizer (*optional*): the reward model's tokenizer; loaded from `model` when omitted.
        device (*optional*): where to run it; defaults to the model's device or CPU.
        batch_size (`int`, defaults to 16): texts scored per forward pass.
        model_init_kwargs (`dict`, *optional*): extra `from_pretrained` kwargs.
        trust_remote_code (`bool`, defaults to `False`): allow Hub code (off unless asked).

    Called as a TRL reward function: `scorer(prompts=..., completions=..., **columns)` returns one
    float per sample.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        device: torch.device | str | None = None,
        batch_size: int = 16,
        model_init_kwargs: dict | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        if isinstance(model, str):
            check_resolvable(model)
        self._source = model
        self._model = None if isinstance(model, str) else model
        self._tokenizer = tokenizer
        self._device = device
        self.batch_size = batch_size
        self._init_kwargs = dict(model_init_kwargs or {})
        self._trust_remote_code = trust_remote_code
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.__name__ = str(name).rstrip("/").split("/")[-1]

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self._model is None:
            logger.info("loading reward model %s", self._source)
            self._model = AutoModelForSequenceClassification.from_pretrained(
                self._source, num_labels=1, trust_remote_code=self._trust_remote_code,
                use_safetensors=True, **self._init_kwargs,
            )
        if self._tokenizer is None:
            src = self._source if isinstance(self._source, str) else self._model.config._name_or_path
            self._tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=self._trust_remote_code)
        if self._tokenizer.pad_token_id is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        if self._model.config.pad_token_id is None:
            self._model.config.pad_token_id = self._tokenizer.pad_token_id
        if self._device is not None:
            self._model.to(self._device)
        self._model.eval()

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The strings the reward model scores, in its own format."""
        if self._model is None or self._tokenizer is None:
            self._load()
        out = []
        for p, c in zip(prompts, completions):
            if is_conversational(p):
                out.append(self._tokenizer.apply_chat_template(list(p) + list(c), tokenize=False))
            else:
                out.append(p + c)
        return out

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
        texts = self.texts(prompts, completions)
        device = next(self._model.parameters()).device
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self._tokenizer(
                texts[i : i + self.batch_size], return_tensors="pt", padding=True,
                padding_side="right", add_special_tokens=False,
            ).to(device)
            scores.extend(self._model(**enc).logits[:, 0].float().tolist())
        return scores
