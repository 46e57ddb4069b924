"""Completion logging of the on-policy trainers (TRL's `log_completions` family).

With `log_completions=True` the rows of the latest rollout round (prompt, completion, each reward function's
score, advantage; gathered from every data-parallel rank) are kept; at each log the main process writes them to
`<output_dir>/completions/completions_<step>.parquet` (TRL's layout) and logs a sample of
`num_completions_to_print` rows (all when None, none when <= 0), each prompt once with `log_unique_prompts`.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

logger = logging.getLogger(__name__)


def _text(value: Any) -> str:
    """A prompt or completion as text: plain strings as they are, message lists as `role: content` lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                         for m in value)
    return str(value)


class CompletionLog:
    """The rows of the latest round and how to write and show them (see the module docstring)."""

    def __init__(self, args, reward_names: list[str], seed: int = 0) -> None:
        self.enabled = bool(getattr(args, "log_completions", False))
        self.num_to_print = getattr(args, "num_completions_to_print", None)
        self.unique_prompts = bool(getattr(args, "log_unique_prompts", False))
        self.reward_names = list(reward_names)
        self.rows: list[dict] = []
        self._rng = random.Random(seed)

    def record(self, prompts: list, completions: list, rewards_per_func, advantages,
               extra: dict[str, list] | None = None) -> None:
        """Keep one round's rows (already gathered from every rank); `rewards_per_func` `(N, K)`, `advantages`
        `(N,)` or `(N, T)` (the first token's value is logged); `extra`: more columns, one value per row (the
        reward functions' `log_extra`)."""
        if not self.enabled:
            return
        rewards = rewards_per_func.tolist()
        adv = advantages if advantages.dim() == 1 else advantages[:, 0]
        extra = extra or {}
        self.rows = [
            {"prompt": _text(p), "completion": _text(c), **dict(zip(self.reward_names, r)), "advantage": float(a),
             **{k: v[i] for k, v in extra.items()}}
            for i, (p, c, r, a) in enumerate(zip(prompts, completions, rewards, adv.tolist()))
        ]

    @property
    def extra_columns(self) -> dict[str, list]:
        """The `log_extra` columns of the kept rows."""
        fixed = {"prompt", "completion", "advantage", *self.reward_names}
        names = [k for k in (self.rows[0] if self.rows else {}) if k not in fixed]
        return {k: [row[k] for row in self.rows] for k in names}

    def sample(self) -> list[dict]:
        """The rows to show: unique prompts first when asked, then `num_completions_to_print` of them."""
        rows = self.rows
        if self.unique_prompts:
            seen, unique = set(), []
            for row in rows:
                if row["prompt"] not in seen:
                    seen.add(row["prompt"])
                    unique.append(row)
            rows = unique
        n = self.num_to_print
        if n is None or n >= len(rows):
            return list(rows)
        return [] if n <= 0 else self._rng.sample(rows, n)

    def flush(self, step: int, output_dir: str, is_main: bool) -> None:
        """Write the round's rows as parquet and log the sample (main process only)."""
        if not (self.enabled and self.rows and is_main):
            return
        import pandas as pd

        folder = os.path.join(output_dir, "completions")
        os.makedirs(folder, exist_ok=True)
        frame = pd.DataFrame([{"step": step, **row} for row in self.rows])
        frame.to_parquet(os.path.join(folder, f"completions_{step:05d}.parquet"), index=False)
        for row in self.sample():
            scores = ", ".join(f"{k}={row[k]:.3f}" for k in self.reward_names)
            logger.info("step %d | prompt: %r | completion: %r | %s | advantage %.3f", step, row["prompt"][-200:],
                        row["completion"][:400], scores, row["advantage"])
