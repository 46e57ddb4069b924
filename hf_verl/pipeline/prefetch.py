"""Asynchronous rollout: the next rollout is generated while the current one trains.

:class:`RolloutPrefetcher` owns one background worker thread and, for a rollout engine that
generates with the actor's own parameter tensors (the default
:class:`~hf_verl.rollout.hf_engine.TransformersEngine` on an unsharded actor), a second engine on
a frozen copy of the actor: the optimizer mutates the actor in place, so a generation running on
it while the actor steps would read half-updated weights. The copy (PEFT adapters merged into it; with
`weight_sync="adapter"` left unmerged, and each sync then copies the adapters only) costs one more set of the actor's
weights, no gradients or optimizer state; it is made the first
time a prefetch needs it and brought to the actor's weights on the main thread just before each
generation, never while one is in flight. Engines with their own weights (a server, vLLM, a
transformers engine on a replica of a sharded actor) are used as they are; the front-end defers
their weight sync while a generation runs on them.

At most `depth` generations are in flight (one unless `async_rollout_depth` asks for more; several run on one
engine only when it decodes them together, continuous batching). What runs off the main thread is generation and reward
scoring only; everything that reads a trained role (reference, critic, old log-probs, advantages)
runs on the main thread when the rollout is handed out. Both front-ends use this class: the
trainers (`use_async_rollout=True`) and the role facade.

On CUDA the worker's kernels share the default stream with the main thread, so the overlap is
host-side (decode loop, reward functions); a remote or vLLM engine overlaps fully.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from hf_verl.engine.base import TrainingEngine
from hf_verl.pipeline.sync import holds_adapter_base, shares_actor_weights, sync_weights
from hf_verl.rollout.base import RolloutEngine
from hf_verl.rollout.hf_engine import TransformersEngine

logger = logging.getLogger(__name__)


def frozen_copy(model, keep_adapters: bool = False):
    """A detached eval-mode copy of an *unsharded* model, PEFT adapters merged into a plain model (with
    `keep_adapters`, left unmerged beside the base: adapter-only weight sync)."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError("the model is already partitioned by DeepSpeed ZeRO-3 (loaded under deepspeed.zero.Init): "
                         "hf_verl partitions every role itself; load the model without zero.Init.")
    out = copy.deepcopy(model)
    if hasattr(out, "merge_and_unload") and not keep_adapters:
        out = out.merge_and_unload()
    out.eval().requires_grad_(False)
    for p in out.parameters():
        p.grad = None
    return out


class RolloutPrefetcher:
    """One background worker for rollouts, and the actor copy it generates with when it must.

    The front-end calls :meth:`engine_for` and :meth:`sync_copy` on the main thread, then
    :meth:`submit`; :meth:`busy` says whether a generation is in flight on a given engine.
    """

    def __init__(self, thread_name: str = "hf_verl-rollout") -> None:
        self._thread_name = thread_name
        self._executor: ThreadPoolExecutor | None = None
        self._workers = 0
        self._inflight: list[tuple[Future, RolloutEngine]] = []
        self.copy_engine: TransformersEngine | None = None
        self.copy_step: int | None = None  # the actor step the copy's weights are from

    def engine_for(self, engine: RolloutEngine, actor: TrainingEngine, step: int) -> RolloutEngine:
        """The engine a prefetch runs on: `engine` itself unless it shares the actor's weights, else a
        `TransformersEngine` on a copy of the actor (made on first use)."""
        if not shares_actor_weights(engine, actor):
            return engine
        if self.copy_engine is None:
            self.wait_idle()
            t0 = time.perf_counter()
            adapters = getattr(engine, "weight_sync_mode", "auto") == "adapter"  # base once, adapters each sync
            model = frozen_copy(actor.rollout_model(), keep_adapters=adapters)
            self.copy_engine = TransformersEngine(model, engine.tokenizer, batch_size=engine.batch_size,
                                                  use_generate=engine.use_generate,
                                                  cache_implementation=engine.cache_implementation,
                                                  generate_kwargs=engine.generate_kwargs,
                                                  autocast_dtype=engine.autocast_dtype)
            self.copy_engine.eos_token_ids = set(engine.eos_token_ids)
            if adapters:  # (an actor without adapters is refused at the first sync)
                self.copy_engine.weight_sync_mode = "adapter"
                if hasattr(model, "active_adapter"):
                    holds_adapter_base(self.copy_engine, model.active_adapter)
            self.copy_step = step
            n = sum(p.numel() for p in model.parameters())
            logger.info("async rollout: generating on a copy of the actor (%.1fM parameters, made in %.2fs); "
                        "set use_async_rollout=False to save its memory", n / 1e6, time.perf_counter() - t0)
        return self.copy_engine

    def sync_copy(self, actor: TrainingEngine, step: int) -> float:
        """Bring the copy engine to the actor's weights if they moved since; returns seconds spent.
        Waits for an in-flight generation first: the copy is never written while it is read."""
        if self.copy_engine is None or self.copy_step == step:
            return 0.0
        self.wait_idle()
        seconds = sync_weights(actor, self.copy_engine)
        self.copy_step = step
        return seconds

    def busy(self, engine: RolloutEngine | None = None) -> bool:
        """Whether a generation is in flight (on `engine`, if given)."""
        self._inflight = [(f, e) for f, e in self._inflight if not f.done()]
        return any(engine is None or e is engine for _, e in self._inflight)

    def wait_idle(self) -> None:
        """Block until no generation is in flight (their outcomes stay in their futures)."""
        if self._inflight:
            wait([f for f, _ in self._inflight])
            self._inflight = []

    def submit(self, engine: RolloutEngine, fn: Callable[..., Any], *args: Any, depth: int = 1) -> Future:
        """Run `fn(*args)` on a worker thread once fewer than `depth` generations are in flight (waiting for the
        oldest otherwise); `engine` is the engine it generates on."""
        self.busy()
        while len(self._inflight) >= depth:
            wait([self._inflight[0][0]])
            self._inflight.pop(0)
        if self._executor is None or self._workers < depth:
            if self._executor is not None:
                self._executor.shutdown(wait=False)  # its running generation finishes; the new pool takes the next
            self._executor = ThreadPoolExecutor(max_workers=depth, thread_name_prefix=self._thread_name)
            self._workers = depth
        future = self._executor.submit(fn, *args)
        self._inflight.append((future, engine))
        return future

    def close(self, wait_for_inflight: bool = True) -> None:
        """Stop the worker (a generation in flight finishes first) and free the actor copy."""
        if self._executor is not None:
            self._executor.shutdown(wait=wait_for_inflight, cancel_futures=True)
        self._executor, self._inflight, self._workers = None, [], 0
        if self.copy_engine is not None and wait_for_inflight:
            self.copy_engine.close()  # its continuous decode loop, if one runs
        self.copy_engine, self.copy_step = None, None
