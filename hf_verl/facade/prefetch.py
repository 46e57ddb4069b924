"""The facade's records of asynchronous rollout (the worker itself is :mod:`hf_verl.pipeline.prefetch`).

A prefetched rollout is `Generated` (generated and scored, not yet seen by the trainer's roles)
behind a `Pending` future, together with the generation settings it used: a setting changed since
(:data:`GENERATION_SETTINGS`) discards it and its rows are regenerated.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_verl.facade.rollout import Rollout

# settings a generated rollout depends on: a change discards a prefetch (its rows are regenerated)
GENERATION_SETTINGS = ("num_generations", "max_completion_length", "max_prompt_length", "temperature", "top_p",
                       "top_k", "seed", "per_row_sampling_seed", "max_tool_calling_iterations")


@dataclass
class Generated:
    """The role-free half of a rollout: generated and scored, not yet seen by the trainer's roles."""

    out: Rollout
    per_func: torch.Tensor
    num_truncated: int
    weights_step: int  # the actor's optimizer step the generating weights came from
    off_policy: bool  # sampled by other weights or numerics than the actor's current forward
    timings: dict[str, float] = field(default_factory=dict)
    prefetched: bool = False  # generated in the background


@dataclass
class Pending:
    """A prefetch: the rows it was started for, the settings it used, and its future `Generated`."""

    batch: Any
    settings: dict[str, Any]
    future: Future
