"""Adaptive entropy control (TRL's meaning), the entropy-bonus coefficient of a run, for every algorithm family.

:class:`EntropyController` keeps `entropy_coef`. Static: the coefficient applies every step. Adaptive
(`use_adaptive_entropy`): the bonus applies only while the previous optimizer step's entropy (the token mean
over every rank) was at most `entropy_target`, and after each step the coefficient moves by
`entropy_coef_delta` (up when the entropy is at or under the target, down otherwise) within
`[entropy_coef_min, entropy_coef_max]`. Its state is saved with each checkpoint.
"""

from __future__ import annotations

import json
import math
import os

import torch

from hf_verl.parallel import comm

ENTROPY_STATE_FILE = "entropy_ctrl_state.json"


class EntropyController:
    """The entropy-bonus coefficient of a run (see the module docstring)."""

    def __init__(self, coef: float, *, adaptive: bool = False, coef_min: float = 0.0, coef_max: float = 1.0,
                 delta: float = 0.005, target: float = 0.2) -> None:
        self.coef, self.adaptive = float(coef), adaptive
        self.coef_min, self.coef_max, self.delta, self.target = coef_min, coef_max, delta, target
        self.last_entropy = math.inf  # no bonus before the first adaptive measurement
        self._window = torch.zeros(2, dtype=torch.float64)

    @classmethod
    def from_args(cls, args) -> EntropyController | None:
        """The controller of a config with `entropy_coef` / `use_adaptive_entropy`; None when the bonus is off."""
        adaptive = bool(getattr(args, "use_adaptive_entropy", False))
        if args.entropy_coef == 0 and not adaptive:
            return None
        if not adaptive:
            return cls(args.entropy_coef)
        return cls(args.entropy_coef, adaptive=True, coef_min=args.entropy_coef_min, coef_max=args.entropy_coef_max,
                   delta=args.entropy_coef_delta, target=args.entropy_target)

    def applied_coef(self) -> float:
        """The coefficient this step's micro-batches use."""
        if self.adaptive and self.last_entropy > self.target:
            return 0.0
        return self.coef

    def observe(self, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """Add a micro-batch's entropies (under `mask`) to the current step's window."""
        if self.adaptive:
            maskf = mask.to(entropy.dtype)
            self._window += torch.stack([(entropy * maskf).sum(), maskf.sum()]).double().cpu()

    def end_step(self, dims) -> float:
        """Close the optimizer step: update an adaptive coefficient from the step's entropy over every rank.
        Returns the coefficient in force for the next step."""
        if self.adaptive:
            total = comm.reduce(dims, self._window, "sum") if dims is not None else self._window
            entropy = (total[0] / total[1].clamp(min=1.0)).item()
            step = self.delta if entropy <= self.target else -self.delta
            self.coef = min(max(self.coef + step, self.coef_min), self.coef_max)
            self.last_entropy = entropy
            self._window.zero_()
        return self.coef

    def state_dict(self) -> dict:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["entropy_coef"])
        self.last_entropy = float(state["last_world_entropy"])

    def save(self, output_dir: str) -> None:
        with open(os.path.join(output_dir, ENTROPY_STATE_FILE), "w") as f:
            json.dump(self.state_dict(), f)

    def load(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, ENTROPY_STATE_FILE)
        if os.path.exists(path):
            with open(path) as f:
                self.load_state_dict(json.load(f))
