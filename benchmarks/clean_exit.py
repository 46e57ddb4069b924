"""Clean exits of 2-process gloo runs that simply return: launch a script many times and count aborted peers.

A launch is `torchrun --nproc_per_node 2` of one of:

- `trainer`: GRPOTrainer trains one step and the script returns (tests/distributed/watchdog_stall.py `return`);
- `facade`: the role facade's loop runs two steps and the script returns (tests/distributed/watchdog_facade.py);
- `bare`: plain torch.distributed, one all_reduce, return, no hf_verl (what a script without an exit step does);
- `watched`: the same with `hf_verl.parallel.watchdog.start(...)` (hf_verl's exit step alone).

None of them calls anything at the end. A launch is clean when torchrun exits 0; otherwise each worker with a
non-zero exit code (or a signal: SIGABRT is -6) counts as an aborted peer, and its exit codes are listed.
Counts, not timings (the machine is shared):

    python benchmarks/clean_exit.py --script trainer facade bare watched --launches 25 25 50 50
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPTS = {
    "trainer": ["-m", "tests.distributed.watchdog_stall", "{out}", "return", "60"],
    "facade": ["-m", "tests.distributed.watchdog_facade", "return", "60"],
    "bare": [str(Path(__file__).resolve()), "--child", "bare"],
    "watched": [str(Path(__file__).resolve()), "--child", "watched"],
}


def child(kind: str) -> None:
    """One worker of a `bare` / `watched` launch: one collective, then return."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if kind == "watched":
        from hf_verl.parallel import watchdog

        watchdog.start(60)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == dist.get_world_size()


def launch(script: str, port: int, out: Path) -> tuple[int, list[int]]:
    """One launch: (torchrun's exit code, the non-zero exit codes torchrun reported for its workers)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    args = [a.format(out=out) for a in SCRIPTS[script]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    by_pid = {int(pid): int(code) for code, pid in
              re.findall(r"exitcode\s*:\s*(-?\d+)\)?[^\n]*?\(pid:\s*(\d+)\)", proc.stderr)}
    codes = [c for c in by_pid.values() if c]
    if proc.returncode and not codes:
        codes = [proc.returncode]
    if proc.returncode:
        (out / f"failed_{script}_{port}.log").write_text(proc.stdout + proc.stderr)
    return proc.returncode, codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", nargs="+", choices=sorted(SCRIPTS), default=["trainer", "facade"])
    parser.add_argument("--launches", nargs="+", type=int, default=[25, 25], help="launches per script")
    parser.add_argument("--out", default="/tmp/hf_verl_clean_exit")
    parser.add_argument("--wait-while", default=None, help="before each launch, wait while this file exists")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        child(a.child)
        return
    if len(a.launches) == 1:
        a.launches = a.launches * len(a.script)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    port = 29700
    for script, n in zip(a.script, a.launches):
        clean, aborted, codes = 0, 0, []
        for _ in range(n):
            while a.wait_while and os.path.exists(a.wait_while):
                time.sleep(20)
            port = port + 1 if port < 29990 else 29700
            rc, bad = launch(script, port, out)
            clean += rc == 0
            aborted += len(bad)
            codes += bad
        results[script] = {"launches": n, "clean": clean, "aborted_peers": aborted, "exit_codes": codes}
        print(json.dumps({script: results[script]}), flush=True)
    (out / "clean_exit.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
