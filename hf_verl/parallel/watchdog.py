"""Hangs that name the role, and clean exits, for multi-process runs.

Three pieces, one per process:

- **The phase tracker** (:data:`TRACKER`): the main thread's stack of *marks*, set by :func:`phase` around each
  phase of a step (`actor.forward_backward`, `critic.values`, `reward.score`, `rollout.generate`,
  `actor.weight_sync`, ...) and by :func:`collective` around each collective of :mod:`hf_verl.parallel.comm`.
  A mark with a collective (`all_gather`, `all_reduce`, ...) or a role counts as *progress*: every rank enters
  them in the same order, so a rank whose count is lower than a peer's has not arrived where the peer waits.
  Marks set on other threads (the background rollout worker) are shown in reports, never counted.
- **The watchdog** (:func:`start`): a daemon thread per rank that publishes the tracker's snapshot to the
  process group's key-value store (a side channel that does not depend on a stalled collective) and checks it.
  A rank that has waited in a collective longer than the timeout (TrainingArguments' `ddp_timeout`) while no
  peer is ahead of it reads its peers' snapshots, writes one report to the store
  ("[step 12, critic.values, all_gather] rank 1 never arrived; rank 0 waited 60 s"), and every rank logs it with
  its own phase and exits with :data:`EXIT_CODE` instead of hanging. A rank that ends with an exception
  publishes it the same way, so that its peers stop naming it rather than waiting for the timeout.
- **Clean exits**: at interpreter exit every rank meets its peers at a barrier on the store, then the process
  group is destroyed (ranks that simply exit one after another could abort a peer still tearing its gloo
  connections down). :func:`leave_together` is the same step, callable earlier.

The report is as good as the marks: a collective outside every mark (a user's own `torch.distributed` call)
still hangs until the process group's own timeout; a rank stalled where no mark says it waits (inside a
sharded forward, where every rank looks alike) is reported as "every rank reached this collective".
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

EXIT_CODE = 3  # the exit status of a rank stopped by the watchdog (a hang, or a peer that failed)
ABORT_KEY = "abort"  # the store key of the first report (a hang or a failed rank); later ones are dropped


@dataclass(frozen=True)
class Mark:
    """One open phase: `name` (`actor.forward_backward` for a role phase, `forward` / `all_gather` inside one),
    the collective it waits in (None: local work), whether it counts as progress, and when it started."""

    name: str
    collective: str | None
    counts: bool
    started: float


@dataclass(frozen=True)
class Snapshot:
    """Where a rank is: its step, innermost role phase, the marks inside it, its collective and progress count.

    Attributes:
        rank (`int`): the global rank.
        step (`int` or `None`): the optimizer step being run (the trainers' `global_step + 1`).
        phase (`str`): the innermost role phase, e.g. "critic.values" ("outside any phase" when none is open).
        detail (`str`): the marks open inside it, outermost first ("forward", "micro-batch 2").
        collective (`str` or `None`): the collective of the innermost mark that has one.
        waiting (`bool`): the innermost mark is a collective, or no mark is open (an untracked collective may run).
        progress (`int`): counted marks entered so far.
        since (`float`): wall time of the last change (entering or leaving a mark).
        background (`str`): what other threads of the rank are in (the rollout worker), "" when nothing.
    """

    rank: int
    step: int | None
    phase: str
    detail: str
    collective: str | None
    waiting: bool
    progress: int
    since: float
    background: str = ""

    def where(self) -> str:
        """`[step 12, critic.values, all_gather]` (the detail after the phase when there is one)."""
        step = "step ?" if self.step is None else f"step {self.step}"
        phase = f"{self.phase} ({self.detail})" if self.detail else self.phase
        return f"[{step}, {phase}, {self.collective or 'no collective'}]"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Snapshot:
        return cls(**json.loads(text))


class PhaseTracker:
    """The process's open marks (see the module docstring); only :func:`phase` / :func:`collective` change it."""

    def __init__(self) -> None:
        self._stack: list[Mark] = []
        self._background: dict[str, list[Mark]] = {}
        self.step: int | None = None
        self.rank = 0
        self.progress = 0
        self.since = time.time()
        self.failed_where: str | None = None  # where the first exception left a mark (a failing rank's report)
        self.last_phase: str | None = None  # the role phase left last (names the place between two phases)

    def snapshot(self) -> Snapshot:
        stack = list(self._stack)
        roles = [i for i, m in enumerate(stack) if "." in m.name]
        top = roles[-1] if roles else -1
        phase = stack[top].name if roles else (f"after {self.last_phase}" if self.last_phase else "outside any phase")
        detail = ", ".join(m.name for m in stack[top + 1:] if m.collective is None or m.name != m.collective)
        collective = next((m.collective for m in reversed(stack) if m.collective), None)
        waiting = not stack or stack[-1].collective is not None
        background = "; ".join(f"{name}: {' / '.join(m.name for m in marks)}"
                               for name, marks in list(self._background.items()) if marks)
        return Snapshot(self.rank, self.step, phase, detail, collective, waiting, self.progress, self.since,
                        background)

    @contextlib.contextmanager
    def mark(self, name: str, collective: str | None, counts: bool) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            marks = self._background.setdefault(threading.current_thread().name, [])
            marks.append(Mark(name, collective, False, time.time()))
            try:
                yield
            finally:
                marks.pop()
            return
        self._stack.append(Mark(name, collective, counts, time.time()))
        self.progress += counts
        self.since = time.time()
        try:
            yield
        except BaseException as err:
            if self.failed_where is None and not isinstance(err, (KeyboardInterrupt, SystemExit)):
                self.failed_where = self.snapshot().where()
            if collective is not None and _WATCHDOG is not None:
                _WATCHDOG.collective_failed(self.snapshot(), err)  # a timed-out collective: report, do not unwind
            raise
        finally:
            self._stack.pop()
            self.since = time.time()
            if "." in name:
                self.last_phase = name


TRACKER = PhaseTracker()


def phase(name: str, *, role: str | None = None, collective: str | None = None):
    """A context manager marking a phase of a step for the watchdog.

    Args:
        name (`str`): the phase ("values", "forward_backward", "score") or, without `role`, a part of the
            enclosing phase ("forward", "backward").
        role (`str`, *optional*): the role running it ("actor", "critic", "reference", "reward", "rollout");
            the report names `role.name`.
        collective (`str`, *optional*): the collective the phase waits in ("all_reduce", ...); None for local work.

    Example:
        ```python
        with watchdog.phase("values", role="critic", collective="all_gather"):
            values = critic.infer(batch, Values())
        ```
    """
    label = f"{role}.{name}" if role else name
    return TRACKER.mark(label, collective, counts=role is not None or collective is not None)


def collective(op: str):
    """A context manager around one collective `op` ("all_gather", "all_reduce", "broadcast", "barrier")."""
    return TRACKER.mark(op, op, counts=True)


def set_step(step: int | None) -> None:
    """The optimizer step the next marks belong to (shown in reports)."""
    TRACKER.step = step


# ---------------------------------------------------------------------------------------------- reports
def hang_report(me: Snapshot, peers: dict[int, Snapshot | None], timeout_s: float, now: float) -> dict:
    """The report of rank `me.rank`, which has waited in a collective past `timeout_s`, from its peers' snapshots
    (None: a peer that never published one). Pure: the watchdog's decision and words, tested on their own.

    Returns:
        `dict`: `kind` ("hang"), `by` (the reporting rank), `missing` (ranks behind it), `text` (one line).
    """
    waited = now - me.since
    missing = sorted(r for r, s in peers.items() if s is None or s.progress < me.progress)
    if missing:
        ranks = ", ".join(map(str, missing))
        text = f"{me.where()} rank{'s' if len(missing) > 1 else ''} {ranks} never arrived; " \
               f"rank {me.rank} waited {waited:.0f} s"
    else:
        text = (f"{me.where()} every rank reached this collective and it did not complete; rank {me.rank} waited "
                f"{waited:.0f} s")
    states = []
    for r in sorted(peers):
        s = peers[r]
        if s is None:
            states.append(f"rank {r} never reported a phase (not started, or its process is stuck outside Python)")
        else:
            extra = f"; background {s.background}" if s.background else ""
            states.append(f"rank {r} is in {s.where()} for {now - s.since:.0f} s{extra}")
    if states:
        text += " (" + "; ".join(states) + ")"
    text += f". ddp_timeout={timeout_s:g} s is the longest a rank waits for its peers."
    return {"kind": "hang", "by": me.rank, "missing": missing, "text": text}


def failure_report(rank: int, where: str | None, err: BaseException) -> dict:
    """The report a rank leaving with exception `err` publishes to its peers."""
    first = str(err).splitlines()[0] if str(err) else ""
    named = f"{type(err).__name__}: {first}" if first else type(err).__name__
    text = f"rank {rank} failed{' in ' + where if where else ''} with {named}"
    return {"kind": "failed", "by": rank, "missing": [rank], "text": text}


def stop_line(me: Snapshot, report: dict) -> str:
    """What rank `me.rank` logs when it stops on `report`."""
    if report["by"] == me.rank and report["kind"] == "hang":
        return f"hf_verl watchdog: {report['text']}"
    return (f"hf_verl watchdog: {me.where()} rank {me.rank} stops: "
            f"{'rank ' + str(report['by']) + ' reported a hang: ' if report['kind'] == 'hang' else ''}"
            f"{report['text']}")


# ---------------------------------------------------------------------------------------------- the watchdog
def _default_store():
    """The default process group's key-value store (TCPStore under torchrun / env://, a FileStore for file://).

    `torch.distributed` has no public accessor for it; this is the one private call, isolated here. Any init method
    gives one, and it stays reachable while a collective of the group is stalled."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


class Watchdog:
    """The per-rank watchdog thread (see the module docstring); made by :func:`start`."""

    def __init__(self, store, group, rank: int, world_size: int, timeout_s: float) -> None:
        self.store, self.group, self.rank, self.world_size = store, group, rank, world_size
        self.timeout_s = float(timeout_s)
        self.interval = min(1.0, max(self.timeout_s / 20, 0.05))
        self.grace_s = 2.0 + 3 * self.interval  # how long a reporter waits for its peers to log before exiting
        self._stop = threading.Event()
        self._firing = threading.Lock()
        self._published: tuple | None = None
        self._thread = threading.Thread(target=self._run, name="hf_verl-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as err:  # the store is gone (a peer's launcher ended): nothing left to watch
                logger.debug("watchdog store unreachable: %s", err)
                if self._stop.wait(5 * self.interval):
                    return

    def tick(self, now: float | None = None) -> None:
        """Publish this rank's snapshot, stop on a peer's report, report a hang of this rank's own wait."""
        me = TRACKER.snapshot()
        key = (me.progress, me.since, me.step, me.background)
        if key != self._published:
            self.store.set(f"state/{self.rank}", me.to_json())
            self._published = key
        if self.store.check([ABORT_KEY]):
            report = json.loads(self.store.get(ABORT_KEY))
            if report["kind"] != "failed" or report["by"] != self.rank:  # a failing rank's exit path handles its own
                self.stop_on(report)
        now = time.time() if now is None else now
        if me.waiting and now - me.since > self.timeout_s:
            peers = self.peers()
            if should_report(me, peers):
                self.report(hang_report(me, peers, self.timeout_s, now))

    def peers(self) -> dict[int, Snapshot | None]:
        out = {}
        for r in range(self.world_size):
            if r != self.rank:
                key = f"state/{r}"
                out[r] = Snapshot.from_json(self.store.get(key)) if self.store.check([key]) else None
        return out

    # ------------------------------------------------------------------ stopping
    def report(self, report: dict) -> None:
        """Publish `report` (the first one published wins), wait for the peers to log it, log it, exit."""
        value = json.dumps(report)
        stored = self.store.compare_set(ABORT_KEY, "", value)
        self.stop_on(json.loads(stored))

    def stop_on(self, report: dict) -> None:
        """Log `report` with this rank's own phase, acknowledge it, and end the process with :data:`EXIT_CODE`.
        The reporter waits up to `grace_s` for its peers' acknowledgements, so that every rank logs before a
        launcher tears the others down. A failed rank's own exit path (:func:`_at_exit`) waits likewise."""
        if not self._firing.acquire(blocking=False):
            while True:  # the other thread is stopping the process
                time.sleep(1)
        me = TRACKER.snapshot()
        logger.critical(stop_line(me, report))
        _flush_logs()
        with contextlib.suppress(Exception):
            self.store.set(f"ack/{self.rank}", "1")
            if report["by"] == self.rank:
                self.wait_acks()
                self.store.set("acked", "1")
            else:  # the reporter ends first: a launcher that stops the others on the first exit then finds them gone
                deadline = time.time() + self.grace_s
                while time.time() < deadline and not self.store.check(["acked"]):
                    time.sleep(self.interval / 2)
                time.sleep(self.interval)
        os._exit(EXIT_CODE)

    def wait_acks(self) -> None:
        keys = [f"ack/{r}" for r in range(self.world_size) if r != self.rank]
        deadline = time.time() + self.grace_s
        while time.time() < deadline and not self.store.check(keys):
            time.sleep(self.interval / 2)

    def collective_failed(self, me: Snapshot, err: BaseException) -> None:
        """A collective raised on the main thread: a peer's report explains it (stop on that), and a timeout of the
        process group after waiting most of `timeout_s` is this rank's hang (report it) rather than a gloo error."""
        try:
            if self.store.check([ABORT_KEY]):
                self.stop_on(json.loads(self.store.get(ABORT_KEY)))
            if time.time() - me.since >= 0.5 * self.timeout_s:
                self.report(hang_report(me, self.peers(), self.timeout_s, time.time()))
        except Exception:  # noqa: BLE001 - the store is gone too: let the original error propagate
            return


def should_report(me: Snapshot, peers: dict[int, Snapshot | None]) -> bool:
    """Whether a rank waiting past the timeout reports: no peer is ahead of it (a rank behind a peer is the one
    missing, and its peer reports), and, outside every mark (an untracked collective), some peer is behind."""
    progress = [s.progress for s in peers.values() if s is not None]
    if any(p > me.progress for p in progress):
        return False
    if not me.collective:  # between phases: an untracked collective, or local work
        return any(s is None or s.progress < me.progress for s in peers.values())
    return True


_WATCHDOG: Watchdog | None = None
_GENERATION = 0  # process groups watched so far in this process (each gets its own key prefix)
_EXIT_REGISTERED = False


def _flush_logs() -> None:
    for handler in [*logging.getLogger().handlers, *logger.handlers, logging.lastResort]:
        with contextlib.suppress(Exception):
            if handler is not None:
                handler.flush()
    for stream in (sys.stderr, sys.stdout):
        with contextlib.suppress(Exception):
            stream.flush()


def start(timeout_s: float) -> Watchdog | None:
    """Watch this rank's phases with `timeout_s` seconds (TrainingArguments' `ddp_timeout`) and make the process
    leave cleanly at exit. Call it on every rank once the process group exists (the trainers and the facade do);
    calling it again keeps the watchdog of the current process group and takes the new timeout.

    Args:
        timeout_s (`float`): the longest a rank waits in a collective for its peers before the job stops.

    Returns:
        [`Watchdog`], or `None` in a single process (nothing to watch).

    Raises:
        ValueError: `timeout_s` is not positive.
    """
    global _WATCHDOG, _GENERATION, _EXIT_REGISTERED
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"the watchdog timeout (ddp_timeout) must be > 0 seconds, got {timeout_s!r}.")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    group = dist.group.WORLD
    if _WATCHDOG is not None and _WATCHDOG.group is group:
        _WATCHDOG.timeout_s = float(timeout_s)
        return _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
    _GENERATION += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"hf_verl/watchdog/{restart}/{_GENERATION}", _default_store())
    TRACKER.rank = dist.get_rank()
    _WATCHDOG = Watchdog(store, group, dist.get_rank(), dist.get_world_size(), timeout_s)
    _WATCHDOG.start()
    if not _EXIT_REGISTERED:  # after torch's and accelerate's imports: atexit runs it before their handlers
        atexit.register(_at_exit)
        _EXIT_REGISTERED = True
    return _WATCHDOG


def current() -> Watchdog | None:
    """The running watchdog, if any."""
    return _WATCHDOG


# ---------------------------------------------------------------------------------------------- clean exits
def _at_exit() -> None:
    """Interpreter exit: a rank that failed tells its peers (and waits for them to log it); the others leave
    together (:func:`leave_together`)."""
    err = getattr(sys, "last_value", None)  # set by the interpreter for an exception that ended the program
    wd = _WATCHDOG
    if err is not None and not isinstance(err, (KeyboardInterrupt, SystemExit)) and wd is not None:
        with contextlib.suppress(Exception):
            report = failure_report(wd.rank, TRACKER.failed_where, err)
            stored = json.loads(wd.store.compare_set(ABORT_KEY, "", json.dumps(report)))
            if stored["by"] == wd.rank:
                wd.wait_acks()
                wd.store.set("acked", "1")
        wd.stop()
        return
    if isinstance(err, KeyboardInterrupt):  # every rank was interrupted (or one was, by hand): no barrier to wait at
        if wd is not None:
            wd.stop()
        return
    with contextlib.suppress(Exception):
        leave_together()


def leave_together() -> None:
    """End a multi-process run: wait for every rank, then destroy the process group. It runs by itself at
    interpreter exit once a trainer or the facade started the watchdog; calling it earlier is harmless (the
    exit step then has nothing to do).

    The wait is a barrier on the process group's store, under the watchdog (a rank that never arrives is named
    after the timeout); cyclic garbage (a trainer and its sharded engines) is freed first, while the groups its
    modules use still exist.
    """
    global _WATCHDOG
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    wd = _WATCHDOG if _WATCHDOG is not None and _WATCHDOG.group is dist.group.WORLD else None
    if wd is None:
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
        return
    with phase("exit", role="process", collective="barrier"):
        _store_barrier(wd, "exit")
    wd.stop()
    _WATCHDOG = None
    dist.destroy_process_group()
    with contextlib.suppress(Exception):  # every rank's group is gone before any process ends
        _store_barrier(wd, "left", deadline=time.time() + 10)


def _store_barrier(wd: Watchdog, name: str, deadline: float | None = None) -> None:
    wd.store.add(name, 1)
    while wd.store.add(name, 0) < wd.world_size:
        if deadline is not None and time.time() > deadline:
            return
        if wd.store.check([ABORT_KEY]):
            wd.stop_on(json.loads(wd.store.get(ABORT_KEY)))
        time.sleep(0.02)
