"""The round orchestrator: when a rollout round is generated, on which engine and with which weights, for both
front-ends.

:class:`RoundOrchestrator` is the one schedule of rollout rounds under the TRL-style trainers
(`trainers/on_policy.py`: a round per `steps_per_generation x num_iterations` micro-steps) and the role facade
(`facade/trainer.py`: a round per `rollout()` call or per batch of `rollouts(batches)`). It owns

- the weight sync of the rollout engine (lazily, before the engine generates for a newer policy; `after_step`
  for a front-end that syncs as soon as the actor steps; deferred while a background generation runs on it),
- asynchronous rollout (`use_async_rollout`): one prefetched round per *source* of rounds (`async_rollout_depth`
  of them with in-flight weight updates, decoded together by continuous batching: partial rollouts), generated on
  the background workers of :class:`~hf_verl.pipeline.prefetch.RolloutPrefetcher` (on a copy of the actor when the
  engine shares the actor's weights), dropped when a generation setting changed since it started or when it no
  longer matches the rows it stands for, refused when staler than `max_staleness`,
- the round index of per-row sampling seeds,

and hands out a typed :class:`Round`. *How* a round is generated and scored is the front-end's
:attr:`RoundHost.collect` (both call :class:`~hf_verl.pipeline.rounds.RoundCollector`); everything that reads
a trained role (reference, critic, old log-probs, advantages) runs on the main thread after :meth:`serve`
returns, in the algorithm.

Policy *versions* count what a rollout can lag behind: the actor's optimizer steps for the facade, rollout rounds
for the trainers (their engine is synced once per round); staleness is the version a round is trained at minus
the version it was generated with.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_verl.parallel import watchdog
from hf_verl.pipeline.prefetch import RolloutPrefetcher
from hf_verl.pipeline.rounds import Collected, round_row_seeds
from hf_verl.pipeline.sync import shares_actor_weights, sync_weights
from hf_verl.rollout.base import RolloutEngine

logger = logging.getLogger(__name__)

END = object()  # what a source returns when it has no further round

# settings a generated round depends on: a change discards a prefetch (its rows are generated again)
GENERATION_SETTINGS = ("num_generations", "max_completion_length", "max_prompt_length", "temperature", "top_p",
                       "top_k", "min_p", "repetition_penalty", "stop", "generation_kwargs", "seed",
                       "per_row_sampling_seed", "max_tool_calling_iterations")


@dataclass
class Round:
    """One generated and scored round, with where its weights came from.

    Attributes:
        collected ([`Collected`]): the rows, completions and per-source rewards.
        weights_version (`int`): the policy version the generating weights came from.
        weights_step (`int`): the actor's optimizer step the generating weights came from.
        off_policy (`bool`): sampled by other weights or numerics than the actor's forward (an engine with
            its own weights: vLLM, a server, a replica).
        prefetched (`bool`): generated in the background.
        staleness (`int`): versions between the generating weights and the version the round is served at.
        timings (`dict[str, float]`): the collector's timings, plus `rollout_wait` (seconds waiting for a
            prefetch) and `weight_sync` (seconds syncing the engine for this round, when a sync ran).
        metrics (`dict[str, float]`): in-flight weight updates' per-token version metrics (see
            :meth:`RoundOrchestrator.in_flight_update`).
        engine_key (`int`, *optional*): the generating engine (its weight versions map to policy versions).
    """

    collected: Collected
    weights_version: int
    weights_step: int
    off_policy: bool
    prefetched: bool = False
    staleness: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    engine_key: int | None = None


@dataclass
class Pending:
    """A prefetch: the source's item it was started for, its round index, the settings it used, its future."""

    item: Any
    index: int
    settings: dict[str, Any]
    future: Future
    pushes: int = 0  # in-flight weight updates that landed while it generated


@dataclass
class RoundHost:
    """What the orchestrator reads of its front-end, as callables read at each use (roles may load lazily and
    settings change live).

    Attributes:
        settings: the live config (`use_async_rollout`, `max_staleness` and :data:`GENERATION_SETTINGS`).
        rows (`Callable[[Any], list[dict]]`): a source's item as rows, each repeated per completion (called on the
            main thread, so a bad batch fails where it was handed in).
        prepare (`Callable[[list[dict]], Any]`): main-thread work on the rows before generation (tokenising); its
            result is handed to `collect`.
        collect (`Callable[[list[dict], Any, RolloutEngine, list[int] | None, int | None], Collected]`):
            generate and score `(rows, prepared, engine, row_seeds, weight_version)`; reads no trained role (it
            may run on the background thread).
        engine (`Callable[[], RolloutEngine]`): the rollout engine; actor: the actor's training engine.
        dims: the layout (`dp_rank`, `dp_size` of the row seeds).
        global_step (`Callable[[], int]`): the actor's optimizer steps; version: the policy version (see the
            module docstring).
        check_prefetch (`Callable[[], None]`): raises when a background generation cannot run now.
    """

    settings: Any
    rows: Callable[[Any], list[dict]]
    prepare: Callable[[list[dict]], Any]
    collect: Callable[..., Collected]
    engine: Callable[[], RolloutEngine]
    actor: Callable[[], Any]
    dims: Callable[[], Any]
    global_step: Callable[[], int]
    version: Callable[[], int]
    check_prefetch: Callable[[], None] = lambda: None


class RoundOrchestrator:
    """The schedule of rollout rounds (see the module docstring).

    Args:
        host ([`RoundHost`]): what it reads of its front-end.
        thread_name (`str`): the background worker's thread name.

    Attributes:
        pending (`dict`): the prefetch ([`Pending`]) of each source's next round, by the source's key.
        queued (`dict`): the prefetches of each source's rounds after that (`async_rollout_depth > 1`), oldest first.
        prefetcher ([`RolloutPrefetcher`]): the background worker and the actor copy it generates with.
        engine_step (`int`): the optimizer step whose weights the rollout engine holds (`None` before the first
            sync).
    """

    def __init__(self, host: RoundHost, thread_name: str = "hf_verl-rollout") -> None:
        self._host = host
        self.pending: dict[Hashable, Pending] = {}
        self.queued: dict[Hashable, deque[Pending]] = {}
        self.prefetcher = RolloutPrefetcher(thread_name)
        self.engine_step: int | None = None  # None: an engine with its own weights is synced before it first generates
        self._rounds = 0  # rounds generated without an explicit index: the row seeds' round index
        self._sync_logged = False
        self._versions: dict[int, dict[int, int]] = {}  # engine -> its weight version -> the policy version

    # ------------------------------------------------------------------ weights
    def sync_engine(self) -> float | None:
        """Bring the rollout engine to the actor's current weights if it holds older ones (a version bump for an
        engine on the actor's own tensors; a bucketed stream for vLLM, a server or a replica). Waits for a
        background generation on the engine first. Returns the seconds spent streaming, `None` when nothing was
        streamed (the engine was up to date, or generates with the actor's own tensors)."""
        h = self._host
        engine, actor, step = h.engine(), h.actor(), h.global_step()
        shared = shares_actor_weights(engine, actor)
        if self.engine_step == step or (self.engine_step is None and shared):  # on the actor's tensors from the start
            self.engine_step = step
            return None
        if self.prefetcher.busy(engine):
            self.prefetcher.wait_idle()
        seconds = sync_weights(actor, engine)
        self.engine_step = step
        return None if shared else seconds

    def after_step(self) -> None:
        """The actor stepped: sync the engine now, or, while a background generation runs on it, before its
        next generation (with `in_flight_weight_updates`: now, into the running generation)."""
        if self.in_flight():
            self.in_flight_update()
        elif not self.prefetcher.busy(self._host.engine()):
            self.sync_engine()

    # ------------------------------------------------------------------ in-flight weight updates
    def in_flight(self) -> bool:
        """Whether weight updates land in running generations (`in_flight_weight_updates` with prefetching)."""
        return bool(getattr(self._host.settings, "in_flight_weight_updates", False)) and self.prefetching()

    def in_flight_update(self, step: int | None = None) -> float | None:
        """With `in_flight_weight_updates`, after each optimizer step: stream the actor's new weights into the
        engine background generations run on (the actor copy, or an engine with its own weights) now, even while
        one runs; the engine applies them between two decode steps, so unfinished completions continue under the
        new weights and every later token carries the new version. Called on every rank after every step (a
        sharded actor's export is collective). Returns the seconds spent streaming, None when nothing was sent.

        Args:
            step (`int`, *optional*): the optimizer step count the actor's weights now stand at; defaults to the
                host's `global_step` (a caller that runs inside the optimizer step, before its front-end counts
                the step, passes the count after it: otherwise the engine, synced at the start of this step, looks
                current and the update never lands).

        Raises:
            ValueError: the engine cannot take weights while it generates (vLLM, a server).
        """
        if not self.in_flight():
            return None
        h, prefetcher = self._host, self.prefetcher
        actor, step = h.actor(), h.global_step() if step is None else step
        engine = prefetcher.copy_engine
        if engine is None and shares_actor_weights(h.engine(), actor):
            return None  # no prefetch has run yet: the first one makes the copy at the current weights
        engine = engine if engine is not None else h.engine()
        if not engine.supports_in_flight_updates:
            raise ValueError(f"in_flight_weight_updates=True needs a rollout engine that takes weights while it "
                             f"generates (the transformers engine); {type(engine).__name__} does not: set "
                             "in_flight_weight_updates=False.")
        if engine is prefetcher.copy_engine:
            if prefetcher.copy_step == step:
                return None
            seconds = sync_weights(actor, engine)
            prefetcher.copy_step = step
        else:
            if self.engine_step == step:
                return None
            seconds = sync_weights(actor, engine)
            self.engine_step = step
        self._record_version(engine)
        for pending in self._all_pending():
            if not pending.future.done():
                pending.pushes += 1
        return seconds

    def _all_pending(self) -> list[Pending]:
        return list(self.pending.values()) + [p for q in self.queued.values() for p in q]

    def _record_version(self, engine: RolloutEngine) -> None:
        self._versions.setdefault(id(engine), {})[engine.weight_version] = self._host.version()

    def _token_versions(self, served: Round, pushes: int) -> bool:
        """Per-token policy versions of an in-flight round: the engine's tags mapped to policy versions, tokens
        older than `max_staleness` masked out of the loss, the metrics in `served.metrics`. Returns whether any
        token is within the bound."""
        batch = served.collected.batch
        tags = getattr(batch, "token_weight_version", None)
        if tags is None or served.engine_key not in self._versions:
            return True
        mapping = self._versions[served.engine_key]
        known = torch.tensor(sorted(mapping), dtype=torch.long)
        policy = torch.tensor([mapping[int(k)] for k in known], dtype=torch.long)
        # a tag the map lacks (a sync outside the orchestrator) takes the newest known version not above it
        index = (torch.searchsorted(known, tags.cpu(), right=True) - 1).clamp(min=0)
        versions = policy[index].to(tags.device)
        batch.token_weight_version = versions
        real = batch.completion_mask.bool()
        h = self._host
        lag = h.version() - versions
        stale = (lag > h.settings.max_staleness) & real
        if real.any():
            served.metrics.update({
                "rollout/token_version_spread": float(versions[real].max() - versions[real].min()),
                "rollout/token_staleness_mean": float(lag[real].float().mean()),
                "rollout/stale_tokens_masked": float(stale.sum()) / float(real.sum()),
                "rollout/in_flight_updates": float(pushes)})
        if stale.any():
            batch.completion_mask = batch.completion_mask * (~stale).to(batch.completion_mask.dtype)
        if pushes:
            served.off_policy = True  # tokens of several versions: the importance weights correct each
        return bool((real & ~stale).any())

    @property
    def sync_deferred(self) -> bool:
        """Whether the engine holds older weights than the actor (a sync waits for its next generation)."""
        return self.engine_step != self._host.global_step()

    # ------------------------------------------------------------------ rounds
    def depth(self) -> int:
        """Rounds of a source generated ahead (`async_rollout_depth`, 1 by default).

        Raises:
            ValueError: a depth above 1 without in-flight weight updates, or above `max_staleness`.
        """
        cfg = self._host.settings
        depth = int(getattr(cfg, "async_rollout_depth", 1) or 1)
        if depth > 1:
            if not getattr(cfg, "in_flight_weight_updates", False):
                raise ValueError(f"async_rollout_depth={depth} generates rounds ahead that must take each new policy "
                                 "while they decode: set in_flight_weight_updates=True (or async_rollout_depth=1).")
            if cfg.max_staleness < depth:
                raise ValueError(f"async_rollout_depth={depth} starts a round {depth} policy versions before it "
                                 f"trains, so its first tokens are {depth} versions old: set max_staleness >= {depth} "
                                 f"(it is {cfg.max_staleness}) or lower async_rollout_depth.")
        return depth

    def prefetching(self) -> bool:
        """Whether rounds are prefetched (`use_async_rollout` with `max_staleness > 0`)."""
        cfg = self._host.settings
        if cfg.use_async_rollout and cfg.max_staleness == 0 and not self._sync_logged:
            self._sync_logged = True
            logger.info("max_staleness=0: every rollout is generated synchronously with the current weights")
        return bool(cfg.use_async_rollout) and cfg.max_staleness > 0

    def serve(self, key: Hashable, current: Callable[[], Any], upcoming: Callable[[], Any] | None = None, *,
              index: int | None = None, matches: Callable[[Any], bool] | None = None,
              ahead: Callable[[int], Any] | None = None) -> Round | None:
        """The next round of source `key`, and the start of the source's next prefetch.

        Args:
            key: the source (any hashable: one per stream of rounds).
            current (`Callable[[], Any]`): the source's item for this round (or [`END`]); called only when no
                usable prefetch stands for it.
            upcoming (`Callable[[], Any]`, *optional*): the item of the source's next round (or [`END`]),
                prefetched when prefetching; defaults to `current` (a source drawn item by item).
            index (`int`, *optional*): this round's index (row seeds; the next round gets `index + 1`); by
                default the count of rounds generated so far.
            matches (`Callable[[Any], bool]`, *optional*): whether a prefetched item is this round's; a mismatch
                generates `current()` now.
            ahead (`Callable[[int], Any]`, *optional*): the item (or [`END`]) of the round of a given index, for
                rounds prefetched further ahead (`async_rollout_depth > 1`, with `index`); without it, further rounds
                are drawn from `upcoming` one after the other.

        Returns:
            [`Round`] or `None` when the source has no further item. No trained role has seen it yet.

        Raises:
            `RuntimeError`: the prefetched round is staler than `max_staleness` allows; it is kept, so that a
            retry with a higher `max_staleness` uses it.
        """
        h = self._host
        pending, served, wait_s, item = self.pending.pop(key, None), None, 0.0, END
        if pending is not None:
            t0 = time.perf_counter()
            with watchdog.phase("wait_prefetch", role="rollout"):
                served = pending.future.result()  # a background error is raised here, as it was raised
            wait_s = time.perf_counter() - t0
            if matches is not None and not matches(pending.item):
                logger.warning("the prefetched rollout does not match this round's rows; rolling them out synchronously")
                served = None
                self.queued.pop(key, None)  # the rounds after it were drawn from the same wrong place
            else:
                item = pending.item
                if not self.prefetching() or pending.settings != self._settings() or \
                        (index is not None and pending.index != index):
                    logger.info("dropping the prefetched rollout (async rollout or a generation setting changed "
                                "since it started); generating its %d rows again now", len(served.collected.rows))
                    served = None
                    self.queued.pop(key, None)
                elif self.in_flight() and served.collected.batch.token_weight_version is not None:
                    if not self._token_versions(served, pending.pushes):
                        self.pending[key] = pending
                        raise RuntimeError(self._staleness_message(served.weights_version))
                elif h.version() - served.weights_version > h.settings.max_staleness:
                    self.pending[key] = pending  # kept: a retry with a higher max_staleness uses it
                    raise RuntimeError(self._staleness_message(served.weights_version))
        if served is None:
            item = current() if item is END else item
            if item is END:
                return None
            served = self.generate_now(item, index=index if index is not None else pending.index
                                       if pending is not None else None)
        if self.prefetching():
            self._top_up(key, upcoming or current, ahead, index)
        served.timings["rollout_wait"] = wait_s
        served.staleness = h.version() - served.weights_version
        return served

    def generate_now(self, item: Any, index: int | None = None) -> Round:
        """Generate and score `item` on the main thread with the actor's current weights (after a background
        generation on the same engine finished and the engine was synced)."""
        h = self._host
        rows = h.rows(item)
        engine = h.engine()
        sync_s = self.sync_engine()
        shared = shares_actor_weights(engine, h.actor())
        prepared = h.prepare(rows)
        collected = h.collect(rows, prepared, engine, self._row_seeds(index, len(rows)), None)
        out = Round(collected, h.version(), h.global_step(), off_policy=not shared, timings=collected.timings)
        if sync_s is not None:
            out.timings["weight_sync"] = sync_s
        return out

    def _top_up(self, key: Hashable, upcoming: Callable[[], Any], ahead: Callable[[int], Any] | None,
                index: int | None) -> None:
        """Keep `depth()` rounds of source `key` prefetched: the queued next one becomes pending, then new ones start
        (round `index + 1`, `index + 2`, ... when the rounds are indexed)."""
        depth, queue = self.depth(), self.queued.setdefault(key, deque())
        if key not in self.pending and queue:
            self.pending[key] = queue.popleft()
        while (key in self.pending) + len(queue) < depth:
            last = queue[-1] if queue else self.pending.get(key)
            nxt_index = None if index is None else (last.index if last is not None else index) + 1
            nxt = ahead(nxt_index) if ahead is not None and nxt_index is not None and last is not None else upcoming()
            if nxt is END:
                break
            submitted = self._submit(nxt, nxt_index, depth)
            if key in self.pending:
                queue.append(submitted)
            else:
                self.pending[key] = submitted

    def drop(self, key: Hashable) -> None:
        """Forget source `key`'s prefetches (their generations, if running, just end)."""
        self.pending.pop(key, None)
        self.queued.pop(key, None)

    def close(self) -> None:
        """Drop every prefetch and stop the worker (a generation in flight finishes first), freeing the actor
        copy; the next prefetch starts a new worker."""
        self.pending.clear()
        self.queued.clear()
        self.prefetcher.close()

    # ------------------------------------------------------------------ internals
    def _settings(self) -> dict[str, Any]:
        return {k: getattr(self._host.settings, k, None) for k in GENERATION_SETTINGS}

    def _row_seeds(self, index: int | None, rows: int) -> list[int] | None:
        if index is None:
            index, self._rounds = self._rounds, self._rounds + 1
        dims = self._host.dims()
        return round_row_seeds(self._host.settings, index, dims.dp_rank, dims.dp_size, rows)

    def _staleness_message(self, weights_version: int) -> str:
        h = self._host
        version, max_staleness = h.version(), h.settings.max_staleness
        lag = version - weights_version
        return (f"the prefetched rollout was generated with the actor's weights of version {weights_version} and "
                f"would be trained at version {version}: staleness {lag} exceeds config.max_staleness="
                f"{max_staleness}. The actor stepped {lag} times since the previous rollout (PPO epochs or "
                f"mini-batches?): set config.max_staleness >= {lag}, or config.use_async_rollout = False for "
                "on-policy rollouts; the next rollout then uses (or regenerates) the same prompts.")

    def _submit(self, item: Any, index: int | None, depth: int = 1) -> Pending:
        """Start generating `item` in the background (rows made and prepared here, on the main thread); with
        `depth > 1`, beside the generations in flight, on an engine that decodes them together."""
        h, prefetcher = self._host, self.prefetcher
        h.check_prefetch()
        rows = h.rows(item)
        prepared = h.prepare(rows)
        actor, step = h.actor(), h.global_step()
        engine = prefetcher.engine_for(h.engine(), actor, step)
        if engine is prefetcher.copy_engine:
            sync_s, version = prefetcher.sync_copy(actor, step), h.engine().weight_version
        else:
            if not self.in_flight():  # in flight, the engine takes new weights while it generates
                prefetcher.wait_idle()
            sync_s, version = self.sync_engine(), None
        if depth > 1 and not getattr(engine, "continuous_batching", True):
            engine.enable_continuous_batching()  # the rounds in flight share its decode steps
        if self.in_flight():
            if not engine.supports_in_flight_updates:
                raise ValueError(f"in_flight_weight_updates=True needs a rollout engine that takes weights while it "
                                 f"generates (the transformers engine); {type(engine).__name__} does not: set "
                                 "in_flight_weight_updates=False.")
            engine.tag_token_versions = True
            self._record_version(engine)
        # the copy holds the actor's exact weights: only its staleness makes it off-policy
        off_policy = engine is not prefetcher.copy_engine and not shares_actor_weights(engine, actor)
        index = index if index is not None else self._take_index()
        seeds = self._row_seeds(index, len(rows))
        future = prefetcher.submit(engine, self._collect_in_background, rows, prepared, engine, seeds, version,
                                   Round(None, h.version(), step, off_policy, prefetched=True,
                                         engine_key=id(engine)), sync_s, depth=depth)
        return Pending(item, index, self._settings(), future)

    def _take_index(self) -> int:
        index, self._rounds = self._rounds, self._rounds + 1
        return index

    def _collect_in_background(self, rows, prepared, engine, seeds, version, out: Round, sync_s) -> Round:
        out.collected = self._host.collect(rows, prepared, engine, seeds, version)
        out.timings = out.collected.timings
        if sync_s is not None:
            out.timings["weight_sync"] = sync_s
        return out
