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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_verl.data.prompts import is_conversational
from hf_verl.hub import check_resolvable

logger = logging.getLogger(__name__)


class RewardModelScorer:
    """A reward function backed by a sequence-classification reward model.

    Args:
        model (`str` or `PreTrainedModel`): Hub id, local path, or a loaded model.
        tokenizer (*optional*): the reward model's tokenizer; loaded from `model` when omitted.
        device (*optional*): where to run it; defaults to the model's device or CPU.
        batch_size (`int`, defaults to 16): texts scored per forward pass.
        model_init_kwargs (`dict`, *optional*): extra `from_pretrained` kwargs.
        trust_remote_code (`bool`, defaults to `False`): allow Hub code (off unless asked).
        defer_check (`bool`, defaults to `False`): check that an id resolves offline at the first call
            instead of here (a role facade builds offline and loads on first use).

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
        defer_check: bool = False,
    ) -> None:
        if isinstance(model, str) and not defer_check:
            check_resolvable("reward", model)
        self._source = model
        self._model = None if isinstance(model, str) else model
        self._tokenizer = tokenizer
        self._device = device
        self.batch_size = batch_size
        self._init_kwargs = dict(model_init_kwargs or {})
        self._trust_remote_code = trust_remote_code
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.__name__ = str(name).rstrip("/").split("/")[-1]
        self._forward: Callable[..., Any] | None = None  # set by `place`: the (sharded) module to run
        self._ready = False  # loaded, padding agreed between tokenizer and model

    @property
    def model(self) -> Any:
        """The reward model (loaded on first use)."""
        if self._model is None:
            self._load()
        return self._model

    @property
    def tokenizer(self) -> Any:
        """The reward model's tokenizer: the one given, else its own (loaded on first use, without the model)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            src = self._source if isinstance(self._source, str) else self._model.config._name_or_path
            check_resolvable("reward", src)
            self._tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=self._trust_remote_code)
        return self._tokenizer

    def place(self, forward: Callable[..., Any]) -> None:
        """Run the model through `forward(**encoded) -> outputs` (a sharded engine's) instead of directly."""
        self._forward = forward

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self._model is None:
            check_resolvable("reward", self._source)
            logger.info("loading reward model %s", self._source)
            self._model = AutoModelForSequenceClassification.from_pretrained(
                self._source, num_labels=1, trust_remote_code=self._trust_remote_code,
                use_safetensors=True, **self._init_kwargs,
            )
        if self._tokenizer is None:
            src = self._source if isinstance(self._source, str) else self._model.config._name_or_path
            self._tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=self._trust_remote_code)
        if self._tokenizer.pad_token_id is None:  # no pad token, or one the vocabulary lacks
            self._tokenizer.pad_token = self._tokenizer.eos_token
        # the score is read at the last token before the padding the model's config names: it must be the
        # padding this tokenizer adds (TRL sets it the same way)
        self._model.config.get_text_config().pad_token_id = self._tokenizer.pad_token_id
        if self._device is not None:
            self._model.to(self._device)
        self._model.eval()
        self._ready = True

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The strings the reward model scores, in its own format."""
        if not self._ready:
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
            out = (self._forward or self._model)(**enc)
            scores.extend(out.logits[:, 0].float().tolist())
        return scores


def align_processing_classes(num_reward_funcs: int, processing_classes: Any) -> list:
    """TRL's `reward_processing_classes`: None (every reward model's own tokenizer), one tokenizer (a list of
    one), or a list aligned with the reward functions (None entries for functions and for reward models that
    use their own).

    Raises:
        ValueError: the list's length differs from the number of reward functions.
    """
    if processing_classes is None:
        return [None] * num_reward_funcs
    classes = list(processing_classes) if isinstance(processing_classes, (list, tuple)) else [processing_classes]
    if len(classes) != num_reward_funcs:
        raise ValueError(f"The number of reward processing classes ({len(classes)}) must match the number of reward "
                         f"functions ({num_reward_funcs}).")
    return classes


def resolve_reward_sources(sources: Any, processing_classes: Any = None, *, defer_checks: bool = False) -> list:
    """One reward function per source: callables stay, ids / paths / models become :class:`RewardModelScorer`,
    URLs a :class:`~hf_verl.rewards.remote.RemoteRewardModel`.

    Args:
        sources: a reward function (TRL's convention), a reward model (Hub id, path or
            `AutoModelForSequenceClassification`), the URL of a server that scores one (`http://...`, vLLM's
            `/classify` route: :class:`~hf_verl.rewards.remote.RemoteRewardModel`), or a list of them.
        processing_classes: the reward models' tokenizers: one for all, or a list aligned with `sources`
            (None entries load the model's own).
        defer_checks (`bool`): check ids at the first call rather than now (nothing is loaded either way).

    Raises:
        ValueError / TypeError: no source, a misaligned tokenizer list, or a source of another kind.
    """
    import os

    funcs = list(sources) if isinstance(sources, (list, tuple)) else [sources]
    if not funcs:
        raise ValueError("no reward source: pass at least one reward function or reward model.")
    tokenizers = (list(processing_classes) if isinstance(processing_classes, (list, tuple))
                  else [processing_classes] * len(funcs))
    if len(tokenizers) != len(funcs):
        raise ValueError(f"reward_processing_classes has {len(tokenizers)} entries for {len(funcs)} reward sources.")
    out = []
    from hf_verl.rewards.remote import RemoteRewardModel, is_url

    for func, tok in zip(funcs, tokenizers):
        if is_url(func):
            func = RemoteRewardModel(func, tokenizer=tok)
        elif isinstance(func, (str, os.PathLike)):
            func = RewardModelScorer(os.fspath(func), tok, defer_check=defer_checks)
        elif isinstance(func, torch.nn.Module):
            func = RewardModelScorer(func, tok)
        elif not callable(func):
            raise TypeError(f"reward source {func!r} is neither a callable nor a reward model id, path or object.")
        out.append(func)
    return out
