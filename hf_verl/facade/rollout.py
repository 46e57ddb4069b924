"""`Rollout`: the facade's rollout, a :class:`~hf_verl.data.batch.RolloutBatch` with named views.

Everything a loss needs is a tensor field of the batch (ids, masks, old / reference log-probs,
values, rewards, advantages, returns), aligned row by row; the texts, extra dataset columns, the
trace id and the rollout's metrics live in `meta`. `select` and `split` keep every per-row list
aligned, so PPO mini-batches are `rollout.split(size)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_verl.data.batch import RolloutBatch

COLUMN_PREFIX = "column/"  # meta key prefix of the dataset columns: top-level lists stay row-aligned


@dataclass
class Rollout(RolloutBatch):
    """A validated rollout batch with the facade's views over `meta`."""

    @property
    def prompts(self) -> list[Any]:
        """The prompts as given (strings or message lists), one per completion."""
        return self.meta.get("prompts", [])

    @property
    def completions(self) -> list:
        """The decoded completion texts (special tokens skipped); with tools, each completion's messages
        (assistant turns with their `tool_calls`, and the `tool` results)."""
        return self.meta.get("completions", [])

    @property
    def columns(self) -> dict[str, list]:
        """The extra dataset columns handed to the reward functions, one entry per completion."""
        return {k[len(COLUMN_PREFIX):]: v for k, v in self.meta.items() if k.startswith(COLUMN_PREFIX)}

    @property
    def trace_id(self) -> str | None:
        return self.meta.get("trace_id")

    @property
    def metrics(self) -> dict[str, Any]:
        """Metrics of the rollout phase (lengths, timings, peak memory, rewards, trace id)."""
        return self.meta.get("metrics", {})
