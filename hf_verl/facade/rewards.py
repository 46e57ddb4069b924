"""The facade's reward role: callables, reward models and lists of both, resolved lazily.

A reward model given as a Hub id or path becomes a
:class:`~hf_verl.rewards.reward_model.RewardModelScorer` on its first call (never at
construction), so that a Trainer naming a large reward model can be built offline; it scores
the decoded text with its own tokenizer.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hf_verl.facade.roles import check_resolvable
from hf_verl.rewards.reward_model import RewardModelScorer


class LazyRewardModel:
    """A reward function that builds a `RewardModelScorer` for `model_id` on its first call."""

    def __init__(self, model_id: str, tokenizer: Any = None) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.__name__ = model_id.rstrip("/").split("/")[-1]
        self._scorer: RewardModelScorer | None = None

    def __call__(self, prompts, completions, **kwargs: Any) -> list[float]:
        if self._scorer is None:
            check_resolvable("reward", self.model_id)
            self._scorer = RewardModelScorer(self.model_id, self.tokenizer)
        return self._scorer(prompts=prompts, completions=completions, **kwargs)


def build_reward_funcs(reward_model: Any, reward_tokenizer: Any = None) -> list:
    """One reward function per source of `reward_model` (a source or a list of sources)."""
    sources = reward_model if isinstance(reward_model, (list, tuple)) else [reward_model]
    if not sources:
        raise ValueError("reward_model is an empty list: give at least one reward function or reward model.")
    funcs = []
    for src in sources:
        if isinstance(src, (str, os.PathLike)):
            funcs.append(LazyRewardModel(os.fspath(src), reward_tokenizer))
        elif isinstance(src, torch.nn.Module):
            funcs.append(RewardModelScorer(src, reward_tokenizer))
        elif callable(src):
            funcs.append(src)
        else:
            raise TypeError(f"reward source {src!r} is neither a callable nor a reward model id, path or object.")
    return funcs
