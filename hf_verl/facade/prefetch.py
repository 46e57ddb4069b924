"""Asynchronous rollout of the facade: the next rollout is generated while the current one trains.

:class:`RolloutPrefetcher` owns one background worker thread and, for an in-process engine that
shares the actor's weights (the default :class:`~hf_verl.rollout.hf_engine.TransformersEngine`),
a second engine on a frozen copy of the actor: the optimizer mutates the actor in place, so a
generation running on it while `step()` runs would read half-updated weights. The copy costs one
more set of the actor's parameters and buffers (no gradients, no optimizer state); it is created
the first time a prefetch starts and refreshed from the actor on the main thread just before each
generation, never while one is in flight. Engines that own their weights (a remote server, vLLM,
any other :class:`~hf_verl.rollout.base.RolloutEngine`) are used as they are; the trainer defers
their `sync_weights` while a generation runs on them.

At most one generation is in flight: a new one is submitted only after the previous finished.
What runs off the main thread is generation and reward scoring only; everything that reads a
trainer role (reference, critic, old log-probs, advantages) runs on the main thread when the
rollout is handed out (:meth:`hf_verl.facade.trainer.Trainer.rollout`).

On CUDA the worker's kernels go to the same default stream as the main thread's, so the overlap
is host-side (sampling loop, decoding, reward functions); a remote or vLLM engine overlaps fully.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_verl.facade.debug import TraceLogger
from hf_verl.facade.rollout import Rollout
from hf_verl.rollout.base import RolloutEngine
from hf_verl.rollout.hf_engine import TransformersEngine

logger = TraceLogger(logging.getLogger(__name__), {})

# settings a generated rollout depends on: a change discards a prefetch (its rows are regenerated)
GENERATION_SETTINGS = ("group_size", "max_new_tokens", "max_prompt_length", "temperature", "top_p", "top_k", "seed")


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


def shares_actor_weights(engine: RolloutEngine, actor: torch.nn.Module) -> bool:
    """Whether `engine` generates with the actor's own parameter tensors (so training mutates them)."""
    return isinstance(engine, TransformersEngine) and engine.model is actor


class RolloutPrefetcher:
    """One background worker for rollouts, and the actor copy it generates with when it must.

    The trainer calls :meth:`engine_for` and :meth:`sync_copy` on the main thread, then
    :meth:`submit`; :meth:`busy` says whether a generation is in flight on a given engine.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: tuple[Future, RolloutEngine] | None = None
        self.copy_engine: TransformersEngine | None = None
        self.copy_step: int | None = None  # the actor step the copy's weights are from

    def engine_for(self, engine: RolloutEngine, actor: torch.nn.Module, step: int) -> RolloutEngine:
        """The engine a prefetch runs on: `engine` itself unless it shares the actor's weights,
        else a `TransformersEngine` on a copy of the actor (made on first use)."""
        if not shares_actor_weights(engine, actor):
            return engine
        if self.copy_engine is None:
            self.wait_idle()
            t0 = time.perf_counter()
            model = copy.deepcopy(actor)
            for p in model.parameters():
                p.requires_grad_(False)
                p.grad = None
            self.copy_engine = TransformersEngine(model.eval(), engine.tokenizer, batch_size=engine.batch_size,
                                                  use_generate=engine.use_generate)
            self.copy_step = step
            n = sum(p.numel() for p in model.parameters())
            logger.info("async rollout: generating on a copy of the actor (%.1fM parameters, made in %.2fs); "
                        "set use_async_rollout=False to save its memory", n / 1e6, time.perf_counter() - t0)
        return self.copy_engine

    def sync_copy(self, actor: torch.nn.Module, step: int) -> float:
        """Copy the actor's weights into the copy engine if they moved since; returns seconds spent.
        Waits for an in-flight generation first: the copy is never written while it is read."""
        if self.copy_engine is None or self.copy_step == step:
            return 0.0
        self.wait_idle()
        t0 = time.perf_counter()
        self.copy_engine.sync_weights(actor.state_dict().items())
        self.copy_step = step
        return time.perf_counter() - t0

    def busy(self, engine: RolloutEngine | None = None) -> bool:
        """Whether a generation is in flight (on `engine`, if given)."""
        if self._inflight is None or self._inflight[0].done():
            return False
        return engine is None or self._inflight[1] is engine

    def wait_idle(self) -> None:
        """Block until no generation is in flight (its outcome stays in its future)."""
        if self._inflight is not None:
            wait([self._inflight[0]])
            self._inflight = None

    def submit(self, engine: RolloutEngine, fn: Callable[..., Generated], *args: Any) -> Future:
        """Run `fn(*args)` on the worker thread; `engine` is the engine it generates on."""
        self.wait_idle()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_verl-facade-rollout")
        future = self._executor.submit(fn, *args)
        self._inflight = (future, engine)
        return future

    def close(self, wait_for_inflight: bool = True) -> None:
        """Stop the worker (a generation in flight finishes first) and free the actor copy."""
        if self._executor is not None:
            self._executor.shutdown(wait=wait_for_inflight, cancel_futures=True)
        self._executor, self._inflight = None, None
        self.copy_engine, self.copy_step = None, None
