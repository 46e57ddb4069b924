"""Asynchronous rollout of the facade (the worker itself is :mod:`hf_verl.pipeline.prefetch`).

The :class:`~hf_verl.facade.trainer.Trainer` generates its rollouts through :class:`AsyncRollout`:
for each source of batches (`rollout()`'s draws from the dataset, each `rollouts(batches)`
generator) it hands out the rollout prefetched for that source, or generates one now, then starts
the source's next prefetch on the background worker. Generation and scoring are the trainers' own
(:class:`~hf_verl.pipeline.rounds.RoundCollector`, on either thread); this class owns the worker
(:class:`~hf_verl.pipeline.prefetch.RolloutPrefetcher`), the pending prefetches and the round
counter of per-row sampling seeds, and reaches the trainer only through a :class:`RolloutHost`
(no private attribute of it). The roles, their weights and the phases that read a trained role
(reference, critic, old log-probs, advantages) stay the trainer's.

A prefetched rollout is `Generated` (generated and scored, not yet seen by the trainer's roles)
behind a `Pending` future, together with the generation settings it used: a setting changed since
(:data:`GENERATION_SETTINGS`) discards it and its rows are regenerated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_verl.facade.debug import TraceLogger, new_trace_id, trace
from hf_verl.facade.rollout import COLUMN_PREFIX, Rollout
from hf_verl.pipeline import generation
from hf_verl.pipeline.prefetch import RolloutPrefetcher
from hf_verl.pipeline.rounds import RoundCollector, round_row_seeds
from hf_verl.pipeline.sync import shares_actor_weights
from hf_verl.rewards.callables import combine_rewards
from hf_verl.rollout.base import RolloutEngine

logger = TraceLogger(logging.getLogger(__name__), {})

# settings a generated rollout depends on: a change discards a prefetch (its rows are regenerated)
GENERATION_SETTINGS = ("num_generations", "max_completion_length", "max_prompt_length", "temperature", "top_p",
                       "top_k", "seed", "per_row_sampling_seed", "max_tool_calling_iterations")
END = object()  # what a source's `next_batch` returns when it has no further batch


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
    reward_metrics: dict[str, float] = field(default_factory=dict)  # the reward functions' log_metric means


@dataclass
class Pending:
    """A prefetch: the rows it was started for, the settings it used, and its future `Generated`."""

    batch: Any
    settings: dict[str, Any]
    future: Future


@dataclass
class RolloutHost:
    """What :class:`AsyncRollout` needs of its trainer, as callables read at each use (the trainer's roles load
    lazily and its settings change live).

    Attributes:
        config: the live settings (`use_async_rollout`, `max_staleness`, `num_generations`, the generation
            settings of :data:`GENERATION_SETTINGS`).
        rows (`Callable[[Any], list[dict]]`): a batch as rows, each repeated per completion (checked on the main
            thread: a bad batch fails where it is handed in).
        collector (`Callable[[], RoundCollector]`): generates and scores rows.
        engine (`Callable[[], RolloutEngine]`): the rollout engine; actor (`Callable[[], TrainingEngine]`): the
            actor's training engine.
        dims (`Callable[[], ParallelDims]`): the layout; device: where rollout tensors go.
        global_step / engine_step (`Callable[[], int]`): the actor's optimizer steps, and the step whose weights
            the engine holds.
        sync_deferred (`Callable[[], None]`): apply a weight sync the trainer deferred while the engine generated.
        sharded_rewards (`Callable[[], int]`): reward models sharded with the policy (they score on the main
            thread only).
        reward_weights: the reward sources' weights (None: all 1).
        record (`Callable[[str, Mapping], None]`): the debug recorder at a role boundary.
    """

    config: Any
    rows: Callable[[Any], list[dict]]
    collector: Callable[[], RoundCollector]
    engine: Callable[[], RolloutEngine]
    actor: Callable[[], Any]
    dims: Callable[[], Any]
    device: Callable[[], torch.device]
    global_step: Callable[[], int]
    engine_step: Callable[[], int]
    sync_deferred: Callable[[], None]
    sharded_rewards: Callable[[], int]
    reward_weights: Callable[[], Any]
    record: Callable[[str, Mapping], None]


class AsyncRollout:
    """The trainer's generation of rollouts, one prefetch ahead per source of batches with
    `config.use_async_rollout` (and `config.max_staleness > 0`), synchronous otherwise.

    Args:
        host ([`RolloutHost`]): what it reads of its trainer.

    Attributes:
        pending (`dict`): the prefetch (`Pending`) of each source, by the source's key.
        prefetcher ([`RolloutPrefetcher`]): the background worker and the actor copy it generates with.
    """

    def __init__(self, host: RolloutHost) -> None:
        self._host = host
        self.pending: dict[Any, Pending] = {}  # prefetched rollouts, by source (`rollout()` or a generator)
        self.prefetcher = RolloutPrefetcher("hf_verl-facade-rollout")
        self._rounds = 0  # rollouts generated so far: the round index of per-row sampling seeds
        self._sync_logged = False

    def serve(self, key: Any, next_batch: Callable[[], Any]) -> Generated | None:
        """The next generated rollout of source `key`, and the start of the source's next prefetch.

        Args:
            key: the source (any hashable; one per `rollouts()` generator).
            next_batch (`Callable[[], Any]`): the source's next batch, or [`END`] when it has none.

        Returns:
            `Generated` or `None`: `key`'s prefetched rollout, or one generated now when there is
            none (or it was discarded: a generation setting changed since it started); `None` when
            the source has no further batch. The trainer's roles have not seen it yet.

        Raises:
            `RuntimeError`: the prefetched rollout is staler than `config.max_staleness` allows; it is
            kept, so that a retry with a higher `max_staleness` uses it.
        """
        h = self._host
        pending, generated, wait_s = self.pending.pop(key, None), None, 0.0
        if pending is None:
            batch = next_batch()
            if batch is END:
                return None
        else:
            t0 = time.perf_counter()
            generated = pending.future.result()  # a background error is raised here, as it was raised
            wait_s, batch = time.perf_counter() - t0, pending.batch
            if not self._prefetching() or pending.settings != self._generation_settings():
                logger.info("dropping the prefetched rollout (async rollout or a generation setting changed since "
                            "it started); regenerating its %d prompts now", _num_rows(batch))
                generated = None
            elif h.global_step() - generated.weights_step > h.config.max_staleness:
                self.pending[key] = pending  # kept: a retry with a higher max_staleness uses it
                raise RuntimeError(self._staleness_message(generated.weights_step))
        if generated is None:
            generated = self.generate_now(batch, new_trace_id())
        if self._prefetching() and (nxt := next_batch()) is not END:
            self.pending[key] = self._submit(nxt)
        generated.timings["rollout_wait"] = wait_s
        return generated

    def generate_now(self, batch: Any, trace_id: str) -> Generated:
        """Generate and score `batch` on the main thread with the actor's current weights.

        Args:
            batch: the rows, in any form `Trainer.rollout(batch)` takes.
            trace_id (`str`): the trace of the generation, kept in the rollout's meta.

        Returns:
            `Generated`: the rollout, generated after any background generation on the same engine
            finished and the weight sync deferred meanwhile was applied.
        """
        h = self._host
        with trace(trace_id):
            rows = h.rows(batch)
            engine = h.engine()
            if self.prefetcher.busy(engine):
                self.prefetcher.wait_idle()
            h.sync_deferred()
            shared = shares_actor_weights(engine, h.actor())
            tokenized = h.collector().tokenize(rows)
            generated = self._collect(rows, tokenized, engine, None, h.global_step() if shared else h.engine_step(),
                                      not shared, self._next_row_seeds(len(rows)))
        generated.out.meta["trace_id"] = trace_id
        return generated

    def close(self) -> None:
        """Drop the prefetched rollouts and stop the worker (a generation in flight finishes first),
        freeing the actor copy; the next prefetch starts a new worker."""
        self.pending.clear()
        self.prefetcher.close()

    def _prefetching(self) -> bool:
        cfg = self._host.config
        if cfg.use_async_rollout and cfg.max_staleness == 0 and not self._sync_logged:
            self._sync_logged = True
            logger.info("max_staleness=0: every rollout is generated synchronously with the current weights")
        return cfg.use_async_rollout and cfg.max_staleness > 0

    def _generation_settings(self) -> dict[str, Any]:
        return {k: getattr(self._host.config, k) for k in GENERATION_SETTINGS}

    def _staleness_message(self, weights_step: int) -> str:
        step, max_staleness = self._host.global_step(), self._host.config.max_staleness
        lag = step - weights_step
        return (f"the prefetched rollout was generated with the actor's weights of step {weights_step} and would be "
                f"used at step {step}: staleness {lag} exceeds config.max_staleness="
                f"{max_staleness}. step() ran {lag} times since the previous rollout (PPO epochs or "
                f"mini-batches?): set config.max_staleness >= {lag}, or config.use_async_rollout = False for "
                "on-policy rollouts; the next rollout() then uses (or regenerates) the same prompts.")

    def _next_row_seeds(self, rows: int) -> list[int] | None:
        index, self._rounds = self._rounds, self._rounds + 1
        dims = self._host.dims()
        return round_row_seeds(self._host.config, index, dims.dp_rank, dims.dp_size, rows)

    def _submit(self, batch: Any) -> Pending:
        """Start generating `batch` in the background (rows drawn and tokenized here, on the main thread)."""
        h, prefetcher = self._host, self.prefetcher
        if h.sharded_rewards():
            raise ValueError("reward models are sharded with the policy (FSDP2 / ZeRO-3) and score on the main "
                             "thread: set config.use_async_rollout = False.")
        rows = h.rows(batch)
        tokenized = h.collector().tokenize(rows)
        actor, step = h.actor(), h.global_step()
        engine = prefetcher.engine_for(h.engine(), actor, step)
        if engine is prefetcher.copy_engine:
            sync_s = prefetcher.sync_copy(actor, step)
            version, weights_step = h.engine().weight_version, step
        else:
            prefetcher.wait_idle()
            t0 = time.perf_counter()
            h.sync_deferred()
            sync_s, version, weights_step = time.perf_counter() - t0, None, h.engine_step()
        # the copy holds the actor's exact weights: only its staleness makes it off-policy
        off_policy = engine is not prefetcher.copy_engine and not shares_actor_weights(engine, actor)
        future = prefetcher.submit(engine, self._collect_in_background, new_trace_id(), sync_s, rows, tokenized,
                                   engine, version, weights_step, off_policy, self._next_row_seeds(len(rows)))
        return Pending(batch, self._generation_settings(), future)

    def _collect_in_background(self, trace_id: str, sync_s: float, *args: Any) -> Generated:
        with trace(trace_id):
            generated = self._collect(*args)
        generated.out.meta["trace_id"] = trace_id
        generated.timings["weight_sync"], generated.prefetched = sync_s, True
        return generated

    def _collect(self, rows: list[dict], tokenized: tuple | None, engine: RolloutEngine, version: int | None,
                 weights_step: int, off_policy: bool, row_seeds: list[int] | None = None) -> Generated:
        """Generate and score through the trainers' collector: reads no trainer role, so it may run off the main
        thread. Adds the facade's views: dataset columns in the meta, the combined reward."""
        h = self._host
        if tokenized is not None:
            h.record("prompts->actor", {"prompt_ids": torch.tensor([len(p) for p in tokenized[0].ids])})
        c = h.collector().collect(rows, engine, device=h.device(), row_seeds=row_seeds, version=version,
                                  tokenized=tokenized)
        out = c.batch
        h.record("actor->rollout", out.tensor_fields())
        for k, v in generation.row_columns(rows).items():
            out.meta[COLUMN_PREFIX + k] = v
        out.rewards = combine_rewards(c.rewards_per_func, h.reward_weights()).to(out.device)
        h.record("reward->rollout", {"rewards": out.rewards})
        num_truncated = -(-c.num_truncated // h.config.num_generations)  # distinct prompts
        logged = {name: sum(v) / len(v) for name, v in c.reward_context.metrics.items() if v}
        return Generated(out, c.rewards_per_func, num_truncated, weights_step, off_policy, c.timings,
                         reward_metrics=logged)


def _num_rows(batch: Any) -> int:
    return len(batch["prompt"]) if isinstance(batch, Mapping) else len(batch)
