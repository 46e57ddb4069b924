"""The watchdog: phase tracking, the hang report's words and decision, a real watchdog thread over a real store,
and (slow, multi-process) 2 gloo ranks under torchrun with rank 1 stalled in a reward function, stalled in a model
forward, failing with an exception, or simply returning."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hf_verl.parallel import watchdog
from hf_verl.parallel.watchdog import Snapshot, failure_report, hang_report, should_report, stop_line

ROOT = Path(__file__).resolve().parents[1]


def snap(rank, progress, *, phase="critic.values", collective="all_gather", since=0.0, step=12, detail="",
         waiting=True, background=""):
    return Snapshot(rank, step, phase, detail, collective, waiting, progress, since, background)


# ---------------------------------------------------------------------- the tracker
def test_marks_nest_and_count_progress():
    t = watchdog.TRACKER
    start = t.progress
    with watchdog.phase("values", role="critic"):
        with watchdog.phase("forward"):  # local work: shown, not counted
            s = t.snapshot()
            assert (s.phase, s.detail, s.collective, s.waiting) == ("critic.values", "forward", None, False)
        with watchdog.collective("all_gather"):
            s = t.snapshot()
            assert s.where().endswith("critic.values, all_gather]")
            assert s.waiting
    assert t.progress == start + 2
    assert t.snapshot().phase == "after critic.values"


def test_phase_decorates_a_function_and_records_where_it_failed():
    @watchdog.phase("score", role="reward")
    def boom():
        raise ValueError("no")

    watchdog.TRACKER.failed_where = None
    watchdog.set_step(3)
    with pytest.raises(ValueError):
        boom()
    assert watchdog.TRACKER.failed_where == "[step 3, reward.score, no collective]"
    watchdog.TRACKER.failed_where = None
    watchdog.set_step(None)


def test_background_thread_marks_are_shown_not_counted():
    t = watchdog.TRACKER
    inside, leave = threading.Event(), threading.Event()

    def worker():
        with watchdog.phase("score", role="reward"):
            inside.set()
            leave.wait(5)

    thread = threading.Thread(target=worker, name="hf_verl-rollout")
    before = t.progress
    thread.start()
    inside.wait(5)
    s = t.snapshot()
    leave.set()
    thread.join()
    assert s.progress == before
    assert s.background == "hf_verl-rollout: reward.score"


# ---------------------------------------------------------------------- the report
def test_hang_report_names_step_role_phase_collective_and_missing_rank():
    me = snap(0, 7, since=100.0)
    peers = {1: snap(1, 6, phase="reward.score", collective=None, since=95.0, waiting=False)}
    report = hang_report(me, peers, timeout_s=60, now=160.0)
    assert report["missing"] == [1] and report["by"] == 0 and report["kind"] == "hang"
    assert report["text"].startswith("[step 12, critic.values, all_gather] rank 1 never arrived; rank 0 waited 60 s")
    assert "rank 1 is in [step 12, reward.score, no collective] for 65 s" in report["text"]
    assert "ddp_timeout=60 s" in report["text"]
    # every rank logs it with its own place
    line = stop_line(peers[1], report)
    assert line.startswith("hf_verl watchdog: [step 12, reward.score, no collective] rank 1 stops: rank 0 "
                           "reported a hang: [step 12, critic.values, all_gather] rank 1 never arrived")
    assert stop_line(me, report) == "hf_verl watchdog: " + report["text"]


def test_hang_report_when_every_rank_arrived_or_one_never_reported():
    me = snap(0, 7, since=0.0)
    text = hang_report(me, {1: snap(1, 7)}, 20, 21.0)["text"]
    assert "every rank reached this collective and it did not complete; rank 0 waited 21 s" in text
    report = hang_report(me, {1: None, 2: snap(2, 7)}, 20, 21.0)
    assert report["missing"] == [1]
    assert "rank 1 never reported a phase" in report["text"]


def test_only_ranks_not_behind_a_peer_report():
    me = snap(0, 7)
    assert should_report(me, {1: snap(1, 6)})  # the peer is behind: it never arrived
    assert should_report(me, {1: snap(1, 7)})  # everyone in the same collective
    assert not should_report(me, {1: snap(1, 8)})  # this rank is the one behind: its peer reports
    between = snap(0, 7, phase="after actor.forward_backward", collective=None)  # no mark open
    assert not should_report(between, {1: snap(1, 7)})  # everyone between phases: maybe long local work
    assert should_report(between, {1: snap(1, 5)})


def test_failure_report_names_the_exception():
    report = failure_report(1, "[step 2, reward.score, no collective]", ValueError("reward exploded\nmore"))
    assert report["text"] == "rank 1 failed in [step 2, reward.score, no collective] with ValueError: reward exploded"
    assert report["kind"] == "failed" and report["by"] == 1


def test_start_rejects_a_bad_timeout_and_is_a_no_op_on_one_process():
    with pytest.raises(ValueError, match="ddp_timeout"):
        watchdog.start(0)
    assert watchdog.start(30) is None  # no process group


# a real watchdog thread over a real store (no process group): rank 0 waits in a collective while its peer's
# published snapshot is behind; the process must log the report and exit with EXIT_CODE
_THREAD_SCRIPT = r"""
import logging, sys, time
import torch.distributed as dist
from hf_verl.parallel import watchdog
from hf_verl.parallel.watchdog import Snapshot, Watchdog
store = dist.HashStore()
peer = Snapshot(1, 5, "reward.score", "", None, False, 0, time.time(), "")
store.set("state/1", peer.to_json())
store.set("ack/1", "1")
wd = Watchdog(store, None, 0, 2, timeout_s=0.5)
watchdog._WATCHDOG = wd
wd.start()
watchdog.set_step(5)
with watchdog.phase("advantages", role="actor"), watchdog.collective("all_gather"):
    time.sleep(30)
print("not stopped")
"""


def test_watchdog_thread_reports_and_exits(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _THREAD_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == watchdog.EXIT_CODE, proc.stderr[-2000:]
    assert "not stopped" not in proc.stdout
    assert "hf_verl watchdog: [step 5, actor.advantages, all_gather] rank 1 never arrived; rank 0 waited" \
        in proc.stderr
    assert "rank 1 is in [step 5, reward.score, no collective]" in proc.stderr


# ---------------------------------------------------------------------- 2 gloo processes
TIMEOUT_S = 20
MARGIN_S = 40  # log flushing, acknowledgements and the launcher's teardown on a loaded 2-core machine


def _launch(tmp_path, mode: str, port: int) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "tests.distributed.watchdog_stall", str(tmp_path), mode, str(TIMEOUT_S)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, time.time()


def _stall_started(tmp_path) -> float:
    return json.loads((tmp_path / "stall.json").read_text())["t"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("mode, port, phase, collective", [
    ("reward", 29641, "reward.score", "all_gather"),
    ("forward", 29642, "actor.forward_backward", "all_reduce"),
])
def test_a_stalled_rank_is_named_and_every_rank_exits(tmp_path, mode, port, phase, collective):
    proc, ended = _launch(tmp_path, mode, port)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert ended - _stall_started(tmp_path) < TIMEOUT_S + MARGIN_S, out[-3000:]
    lines = [x for x in out.splitlines() if "hf_verl watchdog:" in x]
    reporter = [x for x in lines if "rank 1 never arrived; rank 0 waited" in x and " stops:" not in x]
    assert len(reporter) == 1, out[-3000:]
    assert f", {collective}] rank 1 never arrived" in reporter[0]
    assert f"rank 1 is in [step 2, {phase}" in reporter[0]
    # rank 1 logs it too, with its own place
    assert any(f"[step 2, {phase}" in x and "rank 1 stops: rank 0 reported a hang" in x for x in lines), out[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_exception_on_one_rank_ends_every_rank_naming_it(tmp_path):
    proc, _ = _launch(tmp_path, "raise", 29643)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ValueError: reward exploded on rank 1" in out  # rank 1's own traceback
    stops = [x for x in out.splitlines() if "rank 0 stops: rank 1 failed in [step 2, reward.score" in x]
    assert stops and stops[0].endswith("with ValueError: reward exploded on rank 1"), out[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_that_returns_exits_cleanly(tmp_path):
    proc, _ = _launch(tmp_path, "return", 29644)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "hf_verl watchdog" not in proc.stderr


def _launch_facade(mode: str, port: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "tests.distributed.watchdog_facade", mode, "30"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_facade_exits_cleanly_and_names_a_failed_rank():
    proc = _launch_facade("return", 29645)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    proc = _launch_facade("raise", 29646)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    stops = [x for x in out.splitlines() if "rank 0 stops: rank 1 failed in [step 2, reward.score" in x]
    assert stops and stops[0].endswith("with ValueError: facade reward exploded on rank 1"), out[-3000:]
