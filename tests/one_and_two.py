"""Run one distributed test module on one process and under an `accelerate launch` config on 2 gloo processes.

Both runs write `<out>/result.json` (and whatever else the module saves); the caller compares them. Used by the
parity tests of trainers whose module takes just its output folder (`tests/distributed/gkd_dp.py`,
`reward_dp.py`)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.test_parallel_backends import ROOT, _env, _failure, _free_port


def one_and_two(module: str, config: str, tmp_path: Path) -> tuple[dict, dict, Path, Path]:
    """`python -m <module> <tmp>/one`, then `accelerate launch --config_file configs/accelerate/<config>.yaml
    -m <module> <tmp>/two` (2 processes as the config says); returns both `result.json` and both folders."""
    (one := tmp_path / "one").mkdir()
    (two := tmp_path / "two").mkdir()
    proc = subprocess.run([sys.executable, "-m", module, str(one)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, _failure(proc)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(ROOT / "configs" / "accelerate" / f"{config}.yaml"), "--main_process_port",
                           str(_free_port()), "-m", module, str(two)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, _failure(proc)
    want, got = (json.loads((d / "result.json").read_text()) for d in (one, two))
    return want, got, one, two
