"""Asynchronous rollout of the facade (the worker itself is :mod:`hf_verl.pipeline.prefetch`).

The :class:`~hf_verl.facade.trainer.Trainer` generates its rollouts through :class:`AsyncRollout`:
for each source of batches (`rollout()`'s draws from the dataset, each `rollouts(batches)`
generator) it hands out the rollout prefetched for that source, or generates one now, then starts
the source's next prefetch on the background worker. It holds the role-free half of a rollout,
generation and scoring, which runs on either thread, and owns the worker
(:class:`~hf_verl.pipeline.prefetch.RolloutPrefetcher`), the pending prefetches and the round
counter of per-row sampling seeds. The roles, their weights, the rows of a batch and the phases
that read a trained role (reference, critic, old log-probs, advantages) stay the trainer's.

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
from typing import TYPE_CHECKING, Any

import torch

from hf_verl.facade.debug import TraceLogger, new_trace_id, trace
from hf_verl.facade.roles import model_device_dtype
from hf_verl.facade.rollout import COLUMN_PREFIX, Rollout
from hf_verl.pipeline import generation
from hf_verl.pipeline.prefetch import RolloutPrefetcher
from hf_verl.pipeline.sync import shares_actor_weights
from hf_verl.pipeline.tool_rollout import engine_context_length
from hf_verl.rewards.callables import combine_rewards
from hf_verl.rollout.base import RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from hf_verl.facade.trainer import Trainer

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


@dataclass
class Pending:
    """A prefetch: the rows it was started for, the settings it used, and its future `Generated`."""

    batch: Any
    settings: dict[str, Any]
    future: Future


class AsyncRollout:
    """The trainer's generation of rollouts, one prefetch ahead per source of batches with
    `config.use_async_rollout` (and `config.max_staleness > 0`), synchronous otherwise.

    Args:
        trainer ([`Trainer`]): the owner. On the main thread this class calls its `_prompts`,
            `_tokenize` and `_sync_deferred_weights` and reads its `dims`, `engine`, `actor_engine`,
            `global_step`, `_engine_step` and `_sharded_rewards`; generation and scoring (on either
            thread) read its `config`, `model` (for the device), `tokenizer`, `reward_funcs`,
            `reward_weights` and `_tool_rollout`, and record through its `_record`.

    Attributes:
        pending (`dict`): the prefetch (`Pending`) of each source, by the source's key.
        prefetcher ([`RolloutPrefetcher`]): the background worker and the actor copy it generates with.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
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
        t = self._trainer
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
            elif t.global_step - generated.weights_step > t.config.max_staleness:
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
        t = self._trainer
        with trace(trace_id):
            prompts, columns = t._prompts(batch)
            engine = t.engine
            if self.prefetcher.busy(engine):
                self.prefetcher.wait_idle()
            t._sync_deferred_weights()
            shared = shares_actor_weights(engine, t.actor_engine)
            prompt_ids, num_truncated = t._tokenize(prompts)
            generated = self._collect(prompts, prompt_ids, num_truncated, columns, engine, None,
                                      t.global_step if shared else t._engine_step, not shared,
                                      self._next_row_seeds(len(prompts)))
        generated.out.meta["trace_id"] = trace_id
        return generated

    def close(self) -> None:
        """Drop the prefetched rollouts and stop the worker (a generation in flight finishes first),
        freeing the actor copy; the next prefetch starts a new worker."""
        self.pending.clear()
        self.prefetcher.close()

    def _prefetching(self) -> bool:
        cfg = self._trainer.config
        if cfg.use_async_rollout and cfg.max_staleness == 0 and not self._sync_logged:
            self._sync_logged = True
            logger.info("max_staleness=0: every rollout is generated synchronously with the current weights")
        return cfg.use_async_rollout and cfg.max_staleness > 0

    def _generation_settings(self) -> dict[str, Any]:
        return {k: getattr(self._trainer.config, k) for k in GENERATION_SETTINGS}

    def _staleness_message(self, weights_step: int) -> str:
        step, max_staleness = self._trainer.global_step, self._trainer.config.max_staleness
        lag = step - weights_step
        return (f"the prefetched rollout was generated with the actor's weights of step {weights_step} and would be "
                f"used at step {step}: staleness {lag} exceeds config.max_staleness="
                f"{max_staleness}. step() ran {lag} times since the previous rollout (PPO epochs or "
                f"mini-batches?): set config.max_staleness >= {lag}, or config.use_async_rollout = False for "
                "on-policy rollouts; the next rollout() then uses (or regenerates) the same prompts.")

    def _next_row_seeds(self, rows: int) -> list[int] | None:
        index, self._rounds = self._rounds, self._rounds + 1
        cfg = self._trainer.config
        if not cfg.per_row_sampling_seed:
            return None
        dims = self._trainer.dims
        return generation.row_seeds(cfg.seed, index, dims.dp_rank, dims.dp_size, rows)

    def _submit(self, batch: Any) -> Pending:
        """Start generating `batch` in the background (rows drawn and tokenized here, on the main thread)."""
        t, prefetcher = self._trainer, self.prefetcher
        if t._sharded_rewards:
            raise ValueError("reward models are sharded with the policy (FSDP2 / ZeRO-3) and score on the main "
                             "thread: set config.use_async_rollout = False.")
        prompts, columns = t._prompts(batch)
        prompt_ids, num_truncated = t._tokenize(prompts)
        actor = t.actor_engine
        engine = prefetcher.engine_for(t.engine, actor, t.global_step)
        if engine is prefetcher.copy_engine:
            sync_s = prefetcher.sync_copy(actor, t.global_step)
            version, weights_step = t.engine.weight_version, t.global_step
        else:
            prefetcher.wait_idle()
            t0 = time.perf_counter()
            t._sync_deferred_weights()
            sync_s, version, weights_step = time.perf_counter() - t0, None, t._engine_step
        # the copy holds the actor's exact weights: only its staleness makes it off-policy
        off_policy = engine is not prefetcher.copy_engine and not shares_actor_weights(engine, actor)
        future = prefetcher.submit(engine, self._collect_in_background, new_trace_id(), sync_s, prompts,
                                   prompt_ids, num_truncated, columns, engine, version, weights_step,
                                   off_policy, self._next_row_seeds(len(prompts)))
        return Pending(batch, self._generation_settings(), future)

    def _collect_in_background(self, trace_id: str, sync_s: float, *args: Any) -> Generated:
        with trace(trace_id):
            generated = self._collect(*args)
        generated.out.meta["trace_id"] = trace_id
        generated.timings["weight_sync"], generated.prefetched = sync_s, True
        return generated

    def _collect(self, prompts: list, prompt_ids: list[list[int]], num_truncated: int, columns: dict[str, list],
                 engine: RolloutEngine, version: int | None, weights_step: int, off_policy: bool,
                 row_seeds: list[int] | None = None) -> Generated:
        """Generate and score: reads no trainer role, so it may run off the main thread."""
        t = self._trainer
        cfg = t.config
        t0 = time.perf_counter()
        sampling = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                  top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                                  repetition_penalty=cfg.repetition_penalty, stop=tuple(cfg.stop or ()))
        device = model_device_dtype(t.model)[0]
        if t._tool_rollout is not None:  # multi-turn: the trainers' tool-calling path
            rows = [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
            result = t._tool_rollout.generate_and_score(
                engine, rows, t.tokenizer, sampling, t.reward_funcs, columns, device=device,
                row_seeds=row_seeds, max_prompt_length=cfg.max_prompt_length, version=version, batch_cls=Rollout,
                max_context_length=engine_context_length(engine), max_iterations=cfg.max_tool_calling_iterations)
            out, per_func, t1 = result.batch, result.rewards_per_func, t0 + result.generate_s
            num_truncated = -(-result.num_truncated // cfg.num_generations)
            t._record("actor->rollout", out.tensor_fields())
        else:
            t._record("prompts->actor", {"prompt_ids": torch.tensor([len(p) for p in prompt_ids])})
            out = generation.generate(engine, prompt_ids, prompts, sampling, t.tokenizer, device,
                                      row_seeds=row_seeds, version=version, batch_cls=Rollout)
            t._record("actor->rollout", out.tensor_fields())
            t1 = time.perf_counter()
            per_func = generation.score(t.reward_funcs, out, columns)
        for k, v in columns.items():
            out.meta[COLUMN_PREFIX + k] = v
        out.rewards = combine_rewards(per_func, t.reward_weights).to(out.device)
        t._record("reward->rollout", {"rewards": out.rewards})
        timings = {"generate": t1 - t0, "reward": time.perf_counter() - t1}
        return Generated(out, per_func, num_truncated, weights_step, off_policy, timings)


def _num_rows(batch: Any) -> int:
    return len(batch["prompt"]) if isinstance(batch, Mapping) else len(batch)
