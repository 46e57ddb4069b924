"""Request batching of the rollout server: concurrent requests that sample alike share one engine call.

The engine generates one call at a time (weight updates must not interleave with generation). While it is
busy, requests queue; when it is free, the oldest queued request is taken together with every other queued
request of equal sampling parameters, up to `max_rows` completions, and the rows are generated in one
`engine.generate` call. A seeded request is generated alone, so that its completions depend only on its own
rows, as with the engine itself. A request never waits for others to arrive: the first one of an idle server
runs at once. Batched completions are left-padded together, so their log-probs can differ from a lone
request's in float rounding, as between any two batch compositions.

With an engine that decodes continuously (`hf-verl serve --continuous-batching`: a transformers engine whose calls
share one decode loop, :mod:`hf_verl.rollout.continuous`), batches do not wait for each other: each runs at once
under the shared side of the :class:`GenerationLock`, and its rows join the running decode batch at the next step,
whatever their sampling settings; a weight update that is not in flight still takes the exclusive side, so it lands
after every generation in progress, as without. A batch for a LoRA adapter (or any batch while adapters are
loaded) runs alone, as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hf_verl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)


class GenerationLock:
    """The server's generation lock: `with lock:` is exclusive (a weight update, an adapter switch, a generation
    on an engine that decodes one call at a time); `with lock.shared():` lets any number of continuous generations
    run together. A waiting exclusive holder goes first: new shared holders wait behind it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive holders waiting

    def __enter__(self) -> GenerationLock:
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()

    def locked(self) -> bool:
        """Whether anyone holds the lock (either side)."""
        return self._exclusive or self._shared > 0

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield self
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()


@dataclass
class _Job:
    prompts: list[list[int]]
    sampling: SamplingParams
    adapter: str | None = None  # a loaded LoRA adapter's name (hf_verl.serve.adapters), None: the base model
    future: Future = field(default_factory=Future)


def split_output(out: GenerationOutput, sizes: Sequence[int]) -> list[GenerationOutput]:
    """`out` cut into consecutive parts of `sizes` rows, each with the call's weight version."""
    parts, start = [], 0
    for size in sizes:
        end = start + size
        parts.append(GenerationOutput(completion_ids=out.completion_ids[start:end], logprobs=out.logprobs[start:end],
                                      finish_reasons=out.finish_reasons[start:end],
                                      weight_version=out.weight_version,
                                      routed_experts=None if out.routed_experts is None
                                      else out.routed_experts[start:end],
                                      extra={k: v[start:end] for k, v in out.extra.items()
                                             if k == "token_versions"}))
        start = end
    return parts


class RequestBatcher:
    """Generate queued requests on `engine`, batching those that sample alike (see the module docstring).

    Args:
        engine ([`RolloutEngine`]): generates.
        lock (`threading.Lock`): held around each engine call (weight updates hold it too).
        max_rows (`int`, defaults to 256): completions per batched call; a larger request runs alone.
    """

    def __init__(self, engine: RolloutEngine, lock: GenerationLock | threading.Lock, max_rows: int = 256,
                 adapters: Any = None) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}.")
        self.engine, self.lock, self.max_rows = engine, lock, max_rows
        self._workers: ThreadPoolExecutor | None = None  # continuous batches, each on its own thread
        self.adapters = adapters  # an AdapterHost: each batch runs with its adapter (or none) active
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 adapter: str | None = None) -> GenerationOutput:
        """One completion per prompt, generated alone or batched with other requests (of the same `adapter`);
        blocks until done."""
        job = _Job(prompts, sampling, adapter)
        with self._cond:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hf-verl-serve-batcher", daemon=True)
                self._thread.start()
            self._queue.append(job)
            self._cond.notify()
        return job.future.result()

    def close(self) -> None:
        """Stop after the queued requests."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self._workers is not None:
            self._workers.shutdown(wait=True)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._take()
            if self._continuous(batch):
                if self._workers is None:
                    self._workers = ThreadPoolExecutor(64, thread_name_prefix="hf-verl-serve-continuous")
                self._workers.submit(self._serve, batch)
            else:
                self._serve(batch)

    def _continuous(self, batch: list[_Job]) -> bool:
        """Whether `batch` may run beside others: a continuously decoding engine, no adapter in play."""
        return bool(getattr(self.engine, "continuous_batching", False)) and isinstance(self.lock, GenerationLock) \
            and batch[0].adapter is None and not (self.adapters is not None and self.adapters.names)

    def _take(self) -> list[_Job]:
        """The oldest job and the queued ones that sample alike (not seeded), within `max_rows`."""
        first = self._queue.popleft()
        batch, rows, rest = [first], len(first.prompts), deque()
        for job in self._queue:
            if first.sampling.seed is None and job.sampling == first.sampling and job.adapter == first.adapter and \
                    rows + len(job.prompts) <= self.max_rows:
                batch.append(job)
                rows += len(job.prompts)
            else:
                rest.append(job)
        self._queue = rest
        return batch

    def _serve(self, batch: list[_Job]) -> None:
        try:
            if self._continuous(batch):
                with self.lock.shared():
                    out = self.engine.generate([p for job in batch for p in job.prompts], batch[0].sampling)
            else:
                with self.lock, (self.adapters.context(batch[0].adapter) if self.adapters is not None
                                 else contextlib.nullcontext()):
                    out = self.engine.generate([p for job in batch for p in job.prompts], batch[0].sampling)
        except Exception as err:  # noqa: BLE001 (handed to the waiting requests)
            if len(batch) > 1:  # one request's failure must not fail the others: each alone
                logger.warning("a batch of %d requests failed (%s); generating them one by one", len(batch), err)
                for job in batch:
                    self._serve([job])
            else:
                batch[0].future.set_exception(err)
            return
        if len(batch) > 1:
            logger.debug("generated %d requests in one call", len(batch))
        for job, part in zip(batch, split_output(out, [len(job.prompts) for job in batch])):
            job.future.set_result(part)
