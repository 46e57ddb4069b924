"""Where a GRPO step's time goes, phase by phase, in hf_verl and in TRL 1.16, on the matrix's cells.

Each side runs as a fresh subprocess on a cell of `benchmarks/matrix.py` (same model, tokenizer, data, reward and
config as the matrix builds them). Inside it, wall-clock timers wrap the methods that carry each phase (the
benchmark wraps them; neither library is changed):

- generate: hf_verl `TransformersEngine.generate`; TRL `GRPOTrainer._generate` (transformers' `generate` and the
  batching around it);
- reward: the cell's reward function itself (the same callable on both sides);
- scoring forwards (no grad: old / reference log-probs): hf_verl `infer` on an engine; TRL
  `_get_per_token_logps_and_entropies` under `torch.no_grad`;
- training forward + loss: hf_verl `forward_backward` minus its backward; TRL `compute_loss` (its forward with
  grad) minus nothing (its backward is outside);
- backward: hf_verl the engine's `_backward`; TRL `Accelerator.backward`;
- optimizer: hf_verl the engine's `optimizer_step`; TRL the accelerate-wrapped optimizer's `step` (with the
  Trainer's clipping and scheduler around it counted under "other");
- other: the step's wall time minus the phases above (data loading, the round's bookkeeping, padding and
  tensor building, advantages, metrics, the Trainer loop).

Phases are summed over every step but the first (compilation and allocator warm-up) and reported per step. Nested
phases are not double-counted: a wrapper records time only when no other phase is open.

Usage:
  python benchmarks/grpo_phases.py [--cells g1,g5,c1] [--steps N] [--runs 2]
Measure on a quiet machine only. `--runs` repeats each side (alternating) and reports the median per phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrix  # noqa: E402
from matrix import CELLS, Cell  # noqa: E402

PHASES = ("generate", "reward", "scoring", "train_forward", "backward", "optimizer", "other")
# Completion-bound shapes beyond the matrix's g1 / g5: short prompts, completions many times longer, groups 4-16
EXTRA_CELLS = [
    Cell("c1", "grpo", 1000, 128, 2, (4, 8), (16, 64), 8, 32, 8),
    Cell("c2", "grpo", 32000, 256, 4, (4, 12), (32, 96), 4, 16, 5),
]


class PhaseClock:
    """Wall time per phase; only the outermost open phase counts (a phase inside another is not added twice)."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(PHASES, 0.0)
        self.depth = 0

    def wrap(self, owner, name: str, phase, *, when=None) -> None:
        """Replace `owner.name` by a timed call; `phase` is a name or a function of the call's result-free context
        (`when` decides at call time whether this call counts, e.g. only without grad)."""
        original = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            if clock.depth or (when is not None and not when()):
                return original(*args, **kwargs)
            clock.depth += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clock.total[phase] += time.perf_counter() - t0
                clock.depth -= 1

        setattr(owner, name, timed)

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)


def instrument(which: str, clock: PhaseClock) -> None:
    import torch

    original_reward = matrix.distinct_words

    def reward(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original_reward(*args, **kwargs)
        finally:
            if not clock.depth:
                clock.total["reward"] += time.perf_counter() - t0

    reward.__name__ = original_reward.__name__
    matrix.distinct_words = reward
    if which == "hf_verl":
        from hf_verl.engine.accelerate_engine import AccelerateEngine
        from hf_verl.rollout.hf_engine import TransformersEngine

        clock.wrap(TransformersEngine, "generate", "generate")
        clock.wrap(AccelerateEngine, "infer", "scoring")
        clock.wrap(AccelerateEngine, "optimizer_step", "optimizer")
        # forward_backward holds the training forward and the backward: time the backward inside it separately
        original_fb, original_bw = AccelerateEngine.forward_backward, AccelerateEngine._backward

        def backward(self, loss):
            t0 = time.perf_counter()
            try:
                return original_bw(self, loss)
            finally:
                clock.total["backward"] += time.perf_counter() - t0

        def forward_backward(self, *args, **kwargs):
            if clock.depth:
                return original_fb(self, *args, **kwargs)
            clock.depth += 1
            before = clock.total["backward"]
            t0 = time.perf_counter()
            try:
                return original_fb(self, *args, **kwargs)
            finally:
                clock.total["train_forward"] += time.perf_counter() - t0 - (clock.total["backward"] - before)
                clock.depth -= 1

        AccelerateEngine._backward, AccelerateEngine.forward_backward = backward, forward_backward
    else:
        from accelerate import Accelerator
        from accelerate.optimizer import AcceleratedOptimizer
        from trl import GRPOTrainer

        clock.wrap(GRPOTrainer, "_generate", "generate")
        clock.wrap(GRPOTrainer, "_get_per_token_logps_and_entropies", "scoring",
                   when=lambda: not torch.is_grad_enabled())
        clock.wrap(GRPOTrainer, "compute_loss", "train_forward")
        clock.wrap(Accelerator, "backward", "backward")
        clock.wrap(AcceleratedOptimizer, "step", "optimizer")


def child(cell: Cell, which: str, steps: int) -> None:
    """One run in this fresh process; prints one JSON line (seconds per step by phase, steps 2..N)."""
    from transformers import TrainerCallback

    clock = PhaseClock()
    instrument(which, clock)

    class Steps(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append((time.perf_counter(), clock.snapshot()))

    marks = Steps()
    with tempfile.TemporaryDirectory() as out:
        trainer = matrix.build_trainer(cell, which, steps, out, [marks])
        trainer.train()
    (t1, p1), (t2, p2) = marks.marks[0], marks.marks[-1]
    n = len(marks.marks) - 1
    per_step = {k: (p2[k] - p1[k]) / n for k in PHASES if k != "other"}
    per_step["other"] = (t2 - t1) / n - sum(per_step.values())
    print("PHASES " + json.dumps({"run": which, "cell": cell.name, "step_s": (t2 - t1) / n, "phases": per_step}))


def spawn(cell: Cell, which: str, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", which, "--cells", cell.name, "--steps", str(steps)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{cell.name} {which} failed:\n{res.stderr[-4000:]}")
    line = next(x for x in reversed(res.stdout.splitlines()) if x.startswith("PHASES "))
    return json.loads(line[len("PHASES "):])


def table(cell: Cell, runs: dict[str, list[dict]]) -> str:
    med = {w: {p: statistics.median(r["phases"][p] for r in rs) for p in PHASES} for w, rs in runs.items()}
    step = {w: statistics.median(r["step_s"] for r in rs) for w, rs in runs.items()}
    lines = [f"{cell.name}: vocab {cell.vocab}, h={cell.hidden} L={cell.layers}, prompt {cell.prompt_words}, "
             f"completion <= {cell.answer_words[1]}, G={cell.group}, B={cell.batch}; ms per step (share of the step)",
             "| phase | hf_verl | TRL | TRL / hf_verl |", "|---|---|---|---|"]
    for p in (*PHASES, "step"):
        a = step["hf_verl"] if p == "step" else med["hf_verl"][p]
        b = step["trl"] if p == "step" else med["trl"][p]
        share = "" if p == "step" else f" ({a / step['hf_verl']:.0%})"
        share_t = "" if p == "step" else f" ({b / step['trl']:.0%})"
        ratio = f"x{b / a:.2f}" if a > 1e-4 else "-"
        lines.append(f"| {p} | {1e3 * a:.1f}{share} | {1e3 * b:.1f}{share_t} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="g1,g5,c1")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    known = {c.name: c for c in CELLS + EXTRA_CELLS}
    cells = [known[name] for name in a.cells.split(",")]
    if a.child:
        child(cells[0], a.child, a.steps or cells[0].steps)
        return
    results = []
    for cell in cells:
        if cell.algo != "grpo":
            raise SystemExit(f"{cell.name} is a {cell.algo} cell; this breakdown is GRPO's")
        runs = {"hf_verl": [], "trl": []}
        for i in range(a.runs):
            for which in (("hf_verl", "trl") if i % 2 == 0 else ("trl", "hf_verl")):
                runs[which].append(spawn(cell, which, a.steps or cell.steps))
        print(table(cell, runs) + "\n", flush=True)
        results.append({"cell": cell.name, "runs": runs})
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
