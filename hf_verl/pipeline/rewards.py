"""Reward models under sharded layouts: placed as frozen engines, scored on the main thread.

Under DDP and ZeRO-1/2 a reward model is a replica on every rank and scores that rank's rows on its
own, on any thread. Under FSDP2 and ZeRO-3 it is sharded like the policy (a frozen
:class:`~hf_verl.engine.accelerate_engine.AccelerateEngine`: FSDP2 shards, or a ZeRO-3 inference
engine), and every forward gathers its layers from all ranks, a collective: ranks must score in
lockstep (they do: every rank holds the same number of rows per round) and on the main thread, so
asynchronous rollout, which scores in a background thread, is refused with sharded reward models. Under
Megatron (`backend="megatron"`) a reward model stays a whole replica on every rank, as under DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hf_verl.parallel.backend import BackendSpec
from hf_verl.rewards.reward_model import RewardModelScorer


def place_reward_models(reward_funcs: Sequence[Any], backend: BackendSpec, make_engine: Callable[[Any], Any], *,
                        async_rollout: bool) -> int:
    """Load every reward model among `reward_funcs` now (on the main thread) and, on a sharded backend,
    run it through a frozen engine made by `make_engine(model)`. Returns how many were sharded.

    Raises:
        ValueError: sharded reward models with asynchronous rollout.
    """
    scorers = [f for f in reward_funcs if isinstance(f, RewardModelScorer)]
    if not scorers or not backend.partitions_parameters or backend.kind == "megatron":
        return 0  # under Megatron a reward model stays a whole replica on every rank, like under DDP
    if async_rollout:
        raise ValueError(
            f"reward models under {backend.label} are sharded like the policy and score in lockstep on the main "
            "thread, but asynchronous rollout scores in a background thread: set use_async_rollout=False, or "
            "launch with DDP / ZeRO-1/2 (reward models replicated), or wrap the model in a reward function.")
    for scorer in scorers:
        scorer.place(make_engine(scorer.model).forward)
    return len(scorers)
