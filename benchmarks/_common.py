"""Helpers shared by the benchmarks: a step timer that skips the warm-up step, RSS readings, a reward."""

import resource
import time
from pathlib import Path

from transformers import TrainerCallback


def count_a(completions, **kwargs):
    """A cheap rule reward: how many 'a' a completion holds."""
    return [float(c.count("a")) for c in completions]


class StepTimer(TrainerCallback):
    """Times steps after a warm-up step, so that one-off set-up is not counted."""

    def __init__(self):
        self.t0, self.steps = None, 0

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 1:
            self.t0 = time.perf_counter()
        elif self.t0 is not None:
            self.steps += 1


def current_rss_mib():
    """Resident set size now (Linux ``/proc``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def peak_rss_mib():
    """Peak resident set size of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
