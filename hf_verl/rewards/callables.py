"""Reward functions called as TRL does, validated, and combined with weights.

A reward function is called ``f(prompts=..., completions=..., completion_ids=..., **columns)``
and returns one float (or None: "not applicable") per sample. Async functions run concurrently.
Every result is checked here, once: a wrong length, a non-number, NaN or inf is an error naming
the function and the sample. A trainer also passes TRL's context keywords (`trainer_state`,
`log_extra`, `log_metric`) through a :class:`RewardCallContext`, one per scoring call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


def reward_func_name(func: Any) -> str:
    """The name used in metrics (`rewards/<name>/mean`)."""
    return getattr(func, "__name__", None) or type(func).__name__


class RewardCallContext:
    """The keywords TRL gives every reward function besides the dataset columns, for one scoring call.

    `trainer_state` (the `transformers.TrainerState`, for rewards shaped by training progress),
    `log_extra(column, values)` (one value per sample, a column of the completions table) and
    `log_metric(name, value)` (a scalar, averaged into the next training log). What the functions log is
    kept here, so that a rollout scored in a background thread keeps its logs apart from the others; the
    trainer collects it when it uses the rollout.

    Args:
        trainer_state (*optional*): passed as `trainer_state`.
    """

    KEYWORDS = ("trainer_state", "log_extra", "log_metric")

    def __init__(self, trainer_state: Any = None) -> None:
        self.trainer_state = trainer_state
        self.extra: dict[str, list] = defaultdict(list)
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """Add `values` (one per sample of the call) to the completions table's column `column`."""
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """Log a scalar `name`; the values of a logging interval are averaged."""
        self.metrics[name].append(float(value))

    def bind(self, reward_funcs: Sequence[Any]) -> list:
        """`reward_funcs` with these keywords added to every call; a function receives the ones its signature
        accepts (all of them with `**kwargs`, as TRL's convention asks)."""
        values = {"trainer_state": self.trainer_state, "log_extra": self.log_extra, "log_metric": self.log_metric}
        out = []
        for func in reward_funcs:
            accepted = {k: v for k, v in values.items() if _accepts(func, k)}
            out.append(_with_keywords(func, accepted) if accepted else func)
        return out


def _accepts(func: Callable, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # no signature (some builtins): pass nothing extra
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY) for p in params)


def _with_keywords(func: Callable, keywords: dict) -> Callable:
    def call(*args, **kwargs):
        return func(*args, **{**keywords, **kwargs})  # an async function's coroutine is awaited by the caller

    functools.update_wrapper(call, func, updated=())
    call.__name__ = reward_func_name(func)  # a callable object has no __name__ of its own to copy
    return call


def _run_coroutines(coros: list) -> list:
    async def gather():
        return await asyncio.gather(*coros)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from inside a running loop
        return pool.submit(asyncio.run, gather()).result()


def _check(name: str, result: Any, n: int) -> list[float]:
    if isinstance(result, (str, bytes)) or not isinstance(result, Sequence) and not isinstance(result, torch.Tensor):
        raise ValueError(f"reward function {name!r} must return a list of floats, got {type(result).__name__}.")
    values = result.tolist() if isinstance(result, torch.Tensor) else list(result)
    if len(values) != n:
        raise ValueError(f"reward function {name!r} returned {len(values)} rewards for {n} samples; expected {n}.")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(
                f"reward function {name!r} returned a non-number for sample {i}: {type(v).__name__} {v!r}."
            )
        if not math.isfinite(float(v)):
            raise ValueError(
                f"reward function {name!r} returned {v} for sample {i}; return a finite float, or None "
                "when the reward does not apply."
            )
        out.append(float(v))
    return out


def score_reward_funcs(
    reward_funcs: Sequence[Any],
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: dict[str, list] | None = None,
) -> torch.Tensor:
    """Scores of every function on every sample, `(N, F)` float32, NaN where a function gave None."""
    n = len(completions)
    kwargs = dict(columns or {})
    results: list[Any] = []
    pending: dict[int, Any] = {}
    for j, func in enumerate(reward_funcs):
        res = func(prompts=list(prompts), completions=list(completions),
                   completion_ids=list(completion_ids), **kwargs)
        if inspect.isawaitable(res):
            pending[j] = res
        results.append(res)
    if pending:
        for j, value in zip(pending, _run_coroutines(list(pending.values()))):
            results[j] = value
    cols = [_check(reward_func_name(f), r, n) for f, r in zip(reward_funcs, results)]
    scores = torch.tensor(cols, dtype=torch.float32).T.reshape(n, len(reward_funcs))
    unscored = scores.isnan().all(dim=1)
    if unscored.any():  # TRL's warning, with the first such sample's inputs
        i = int(unscored.nonzero()[0, 0])
        row = {k: v[i] for k, v in kwargs.items() if isinstance(v, list) and len(v) == n}
        logger.warning("All reward functions returned None for the following kwargs:\n%s\nPlease ensure that at "
                       "least one reward function returns a valid reward (%d of %d samples got none; their reward "
                       "is 0).", {**row, "prompt": prompts[i], "completion": completions[i]}, int(unscored.sum()), n)
    return scores


def combine_rewards(per_func: torch.Tensor, weights: Sequence[float] | None = None) -> torch.Tensor:
    """Weighted sum over functions, ignoring None (NaN) entries; all-None samples get 0."""
    num = per_func.shape[1]
    if weights is None:
        w = torch.ones(num, dtype=per_func.dtype, device=per_func.device)
    else:
        if len(weights) != num:
            raise ValueError(f"reward_weights has {len(weights)} entries but there are {num} reward functions.")
        w = torch.as_tensor(list(weights), dtype=per_func.dtype, device=per_func.device)
    return (per_func * w).nansum(dim=1)  # a sample every function left unscored gets 0 (warned when scored)
