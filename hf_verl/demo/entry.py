"""The demo's entry point, `run_demo` (the CLI's and the tests'): torch's CPU threads set for one run, then the
algorithm's body: :func:`~hf_verl.demo.run.demo_run_body` (GRPO, PPO, DPO) or
:func:`~hf_verl.demo.distill.distill_run_body` (`algo="distill"`, which builds its teacher with the former)."""

from __future__ import annotations

import logging

import torch

from hf_verl.demo.distill import distill_run_body
from hf_verl.demo.run import DemoResult, demo_run_body

logger = logging.getLogger(__name__)


def run_demo(output_dir: str, *, num_threads: int | None = None, **kwargs) -> DemoResult:
    """[`~hf_verl.demo.run.demo_run_body`] with torch's CPU threads set for the run (and restored after it).

    `num_threads=None` means 1 for the built-in model: its figures then do not depend on the machine's core count
    (the thread count changes float reductions, and 500 RL steps amplify the difference), and a single thread
    does not spin against other work on a shared machine. With `model_name` (a real model) None keeps torch's
    default. `kwargs` are [`~hf_verl.demo.run.demo_run_body`]'s.
    """
    if num_threads is None and kwargs.get("model_name") is None:
        num_threads = 1
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
        logger.info("torch CPU threads for this run: %d", num_threads)
    try:
        if kwargs.get("algo") == "distill":  # on-policy distillation
            return distill_run_body(output_dir, **{k: v for k, v in kwargs.items() if k != "algo"})
        return demo_run_body(output_dir, **kwargs)
    finally:
        torch.set_num_threads(previous)
