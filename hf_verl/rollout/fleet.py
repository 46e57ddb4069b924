"""`FleetEngine`: one :class:`~hf_verl.rollout.base.RolloutEngine` over several `hf-verl serve` servers, which
survives a server that dies and takes it back when it returns.

`placement={"generator": [url1, url2, ...]}` resolves to this engine (registered as `fleet`). Each server is a
:class:`~hf_verl.rollout.remote.RemoteEngine`, in one of three states:

- **live**: it serves the fleet's current weights and takes requests;
- **down**: its requests failed after the remote engine's retries (connection errors, timeouts, 5xx; backoff
  doubling from `backoff_s`), or a weight upload to it broke off. Its unfinished requests go back to the queue and
  the live servers take them. Before each generation and each weight sync the fleet probes it once
  (`GET /v1/weights/version`, no retry, `probe_timeout_s`);
- **stale**: it answers but not with the fleet's weights: it came back from down, or it answered a request with
  another weight version than the one the fleet last gave it (a server restarted on its original weights counts
  its versions from 0 again). It takes no requests (an answer on other weights is dropped and its prompts go to
  the others) until the trainer's next :meth:`FleetEngine.sync_weights`, which uploads to it with the live ones;
  then it is live again.

**Why re-sync from the trainer's next sync rather than from a copy.** A rejoining server needs the current
weights. The fleet could keep a copy of the last synced tensors and push it as soon as the server is back, but
that is a whole second copy of the model in the trainer process (or a re-export, a collective on a sharded actor,
outside the trainer's sync). The trainers and the facade sync after every optimizer step, so a returning server
waits at most one step; until then the live servers serve alone.

**Exactly once, in order.** A call's prompts are cut into requests (`chunk_rows`, or `prompts_per_request`); each
request goes to the live server with the fewest requests in flight (each takes up to `max_concurrency` at a time;
ties go round the servers in turn, so rounds of one request alternate), so the servers share the work however fast
each is. A request's result is kept from exactly one server: the one
that answered it on the fleet's weights; a failed or dropped request is sent again, whole, elsewhere. Results
are returned in prompt order (:meth:`generate`) or per request with its offset (:meth:`generate_stream`), and carry
the fleet's weight version (the number of syncs), whatever each server counts.

When no server can serve, the call fails with :class:`FleetUnavailable` naming every URL and what each said.
Each event (a server down, stale, back, re-synced) is logged at WARNING or INFO with its URL.

Weight sync reads the trainer's tensors once: each bucket goes to every target server (concurrently) before the
next bucket is read, so the trainer holds one bucket beyond its own weights, as with one server. Servers are
`hf-verl serve` (the bucketed upload route); `vllm serve` servers are not supported in a fleet.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import torch

from hf_verl.rollout.base import GenerationOutput, SamplingParams
from hf_verl.rollout.remote import (
    RemoteEngine,
    RequestBatchedEngine,
    RolloutServerError,
    ServerUnreachable,
    WeightUpload,
    check_prompts,
    tensor_buckets,
)

logger = logging.getLogger(__name__)

LIVE, DOWN, STALE = "live", "down", "stale"


class FleetUnavailable(RolloutServerError):
    """No server of a generator fleet can serve; the message names every URL and what each said."""


class _Member:
    """One server of the fleet: its engine, state, the server's weight version after the fleet's last upload to it
    (None before the first), why it is not live, and the requests it answered."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine, self.state, self.expected, self.reason, self.served = engine, LIVE, None, "", 0

    @property
    def url(self) -> str:
        return self.engine.base_url


class FleetEngine(RequestBatchedEngine):
    """Generate on several servers as one engine (see the module docstring).

    Args:
        urls (`Sequence[str]`): the servers' base URLs, e.g. `["http://127.0.0.1:8000", "http://127.0.0.1:8001"]`.
        token (`str`, *optional*): the bearer token of weight updates (every server's).
        timeout_s (`float`, defaults to 120): per request.
        max_retries (`int`, defaults to 3): retries of a request on one server before it is marked down.
        backoff_s (`float`, defaults to 0.5): first retry delay, doubled each time.
        max_concurrency (`int`, defaults to 8): requests in flight per server.
        prompts_per_request (`int`, defaults to 8): prompts per request; smaller than one server's default (16) so
            that a round spreads over the servers (each batches the requests in flight again).
        bucket_bytes (`int`, defaults to 256 MiB): weight-sync bucket size.
        probe_timeout_s (`float`, defaults to 5): the timeout of the one-attempt probe of a server that is down.
    """

    engine_kind = "a generator fleet"

    serves_every_rank = True  # one fleet for every rank: the main rank sends the weights

    def __init__(self, urls: Sequence[str], *, token: str | None = None, timeout_s: float = 120.0,
                 max_retries: int = 3, backoff_s: float = 0.5, max_concurrency: int = 8, prompts_per_request: int = 8,
                 bucket_bytes: int = 256 * 2**20, probe_timeout_s: float = 5.0) -> None:
        super().__init__()
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("a generator fleet needs at least one server URL.")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a generator fleet lists a server twice: {urls}.")
        self.members = [_Member(RemoteEngine(u, token=token, timeout_s=timeout_s, max_retries=max_retries,
                                             backoff_s=backoff_s, max_concurrency=max_concurrency))
                        for u in urls]
        self.prompts_per_request, self.bucket_bytes = prompts_per_request, bucket_bytes
        self.probe_timeout_s = probe_timeout_s
        self._lock = threading.Lock()
        self._turn = 0  # where ties between equally busy servers start, advanced per request

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def states(self) -> dict[str, str]:
        """Each server's state (`"live"`, `"down"` or `"stale"`) by URL."""
        return {m.url: m.state for m in self.members}

    def requests_served(self) -> dict[str, int]:
        """How many requests each server answered with a result the fleet kept, by URL."""
        return {m.url: m.served for m in self.members}

    # ------------------------------------------------------------------ states
    def _mark(self, member: _Member, state: str, reason: str) -> None:
        with self._lock:
            if member.state == state:
                return
            member.state, member.reason = state, reason
        if state == DOWN:
            logger.warning("generator fleet: %s is down (%s); the other servers take its prompts", member.url, reason)
        elif state == STALE:
            logger.warning("generator fleet: %s is stale (%s); it takes no prompts until the next weight sync",
                           member.url, reason)

    def _probe_down(self) -> None:
        """Probe each server that is down once: one that answers on the fleet's weights is live again, one on other
        weights is stale (re-synced at the next weight sync)."""
        for m in self.members:
            if m.state != DOWN:
                continue
            try:
                version = m.engine.server_weight_version(retry=False, timeout_s=self.probe_timeout_s)
            except (RolloutServerError, KeyError, ValueError, TypeError) as err:
                m.reason = f"unreachable: {err}"
                continue
            if m.expected is None or version == m.expected:
                with self._lock:
                    m.state, m.reason = LIVE, ""
                logger.info("generator fleet: %s is back on the fleet's weights (server version %d); it serves again",
                            m.url, version)
            else:
                with self._lock:
                    m.state = STALE
                    m.reason = (f"back at weight version {version}, the fleet gave it {m.expected} (restarted?); "
                                "it rejoins at the next weight sync")
                logger.warning("generator fleet: %s is back at weight version %d but the fleet gave it %d "
                               "(restarted?); it is re-synced at the next weight sync", m.url, version, m.expected)

    def _unavailable(self, what: str) -> FleetUnavailable:
        said = "; ".join(f"{m.url}: {m.state}, {m.reason or 'no answer'}" for m in self.members)
        return FleetUnavailable(f"no server of the generator fleet can {what}: {said}. Start (or restart) the "
                                "servers with `hf-verl serve MODEL`; a restarted one rejoins at the next weight sync.")

    # ------------------------------------------------------------------ generation
    def generate_stream(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                        chunk_rows: int | None = None) -> Iterator[tuple[int, GenerationOutput]]:
        """Generate like :meth:`generate`, yielding `(offset, output)` per request as each one completes, so the
        caller can score finished rows while others generate. Requests carry `chunk_rows` prompts (default
        `prompts_per_request`); a request a server fails or answers on other weights is sent again elsewhere.

        Raises:
            FleetUnavailable: no live server is left while prompts remain.
        """
        prompts = check_prompts(prompt_ids)
        size = max(1, chunk_rows or self.prompts_per_request)
        queue = deque((i, prompts[i : i + size]) for i in range(0, len(prompts), size))
        self._probe_down()
        workers = sum(m.engine.max_concurrency for m in self.members)
        pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(queue))))
        in_flight: dict = {}
        try:
            while queue or in_flight:
                self._dispatch(queue, in_flight, pool, sampling)
                if not in_flight:
                    raise self._unavailable("generate")
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    member, (offset, chunk) = in_flight.pop(future)
                    out = self._accept(member, future, len(chunk))
                    if out is None:
                        queue.appendleft((offset, chunk))
                    else:
                        yield offset, out
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _dispatch(self, queue: deque, in_flight: dict, pool: ThreadPoolExecutor, sampling: SamplingParams) -> None:
        """Send queued requests to the live servers with room, the least busy first."""
        while queue:
            load = {id(m): 0 for m in self.members}
            for member, _ in in_flight.values():
                load[id(member)] += 1
            room = [m for m in self.members if m.state == LIVE and load[id(m)] < m.engine.max_concurrency]
            if not room:
                return
            n = len(self.members)
            member = min(room, key=lambda m: (load[id(m)], (self.members.index(m) - self._turn) % n))
            self._turn += 1
            offset, chunk = queue.popleft()
            member.engine.record_routing = self.record_routing  # routing replay: every server returns its routing
            in_flight[pool.submit(member.engine.complete, chunk, sampling)] = (member, (offset, chunk))

    def _accept(self, member: _Member, future, rows: int) -> GenerationOutput | None:
        """A finished request's output in the fleet's weight version, or None when it must be sent again (the
        server is gone, or answered on other weights; the server is marked so)."""
        try:
            out = future.result()
        except ServerUnreachable as err:
            self._mark(member, DOWN, str(err))
            logger.warning("generator fleet: a request of %d prompts to %s failed; it goes to another server",
                           rows, member.url)
            return None
        versions = set(out.extra.get("weight_versions") or [out.weight_version])
        if member.expected is not None and versions != {member.expected}:
            self._mark(member, STALE, f"answered at weight version {sorted(versions)}, the fleet gave it "
                                      f"{member.expected} (restarted?)")
            logger.warning("generator fleet: dropped %d completions that %s generated on other weights; they go to "
                           "another server", rows, member.url)
            return None
        member.served += 1
        out.weight_version = self.weight_version
        out.extra = {**out.extra, "weight_versions": [self.weight_version] * len(out.completion_ids)}
        return out

    # ------------------------------------------------------------------ weights
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Upload the weights to every server that answers: the live ones and the stale or returning ones, which
        are live again once they applied them. The tensors are read once, one bucket at a time (each bucket goes to
        every server before the next is read). A server whose upload fails is marked down.

        Raises:
            FleetUnavailable: no server took the update.
            RolloutServerError: a server refused the upload (a wrong token, a weight it does not have).
        """
        self._probe_down()
        uploads = {id(m): (m, WeightUpload(m.engine)) for m in self.members if m.state != DOWN}
        if not uploads:
            raise self._unavailable("take the weights")
        buckets = tensor_buckets(named_tensors, self.bucket_bytes)
        pending = next(buckets, None)
        if pending is None:
            raise ValueError("sync_weights got no tensors.")
        with ThreadPoolExecutor(max_workers=len(uploads)) as pool:
            try:
                while pending is not None:
                    following = next(buckets, None)
                    sent = {pool.submit(up.send, pending, last=following is None): (m, up)
                            for m, up in uploads.values()}
                    for future, (m, up) in sent.items():
                        try:
                            future.result()
                        except ServerUnreachable as err:
                            self._mark(m, DOWN, f"weight upload failed: {err}")
                            up.close()
                            del uploads[id(m)]
                    pending = following
            finally:
                for _, up in uploads.values():
                    up.close()
        if not uploads:
            raise self._unavailable("take the weights")
        self._bump_version()
        for m, up in uploads.values():
            was = m.state
            m.expected = up.finish()
            with self._lock:
                m.state, m.reason = LIVE, ""
            if was != LIVE:
                logger.info("generator fleet: %s re-synced (fleet weight version %d, server version %d); it serves "
                            "again", m.url, self.weight_version, m.expected)
        logger.info("generator fleet: weight version %d on %s", self.weight_version,
                    ", ".join(m.url for m, _ in uploads.values()))

    def close(self) -> None:
        for m in self.members:
            m.engine.close()
