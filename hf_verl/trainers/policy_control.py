"""Step-level controllers of the on-policy trainers, with TRL's meanings: the (adaptive) entropy bonus
coefficient and the reference model mixed towards the policy (TR-DPO style `sync_ref_model`).

:class:`EntropyController` keeps `entropy_coef`. Static: the coefficient applies every step. Adaptive
(`use_adaptive_entropy`): the bonus applies only while the previous optimizer step's entropy (the token mean
over every rank) was at most `entropy_target`, and after each step the coefficient moves by
`entropy_coef_delta` (up when the entropy is at or under the target, down otherwise) within
`[entropy_coef_min, entropy_coef_max]`. Its state is saved with each checkpoint.

:class:`ReferenceMixCallback` sets `ref <- (1 - alpha) ref + alpha policy` every `ref_model_sync_steps`
optimizer steps. Sharded (FSDP2) parameters mix shard by shard: actor and reference are laid out alike.
"""

from __future__ import annotations

import json
import math
import os

import torch
from transformers import TrainerCallback

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
        if args.entropy_coef == 0 and not args.use_adaptive_entropy:
            return None
        return cls(args.entropy_coef, adaptive=args.use_adaptive_entropy, coef_min=args.entropy_coef_min,
                   coef_max=args.entropy_coef_max, delta=args.entropy_coef_delta, target=args.entropy_target)

    def applied_coef(self) -> float:
        """The coefficient this step's micro-batches use."""
        if self.adaptive and self.last_entropy > self.target:
            return 0.0
        return self.coef

    def observe(self, entropy: torch.Tensor, mask: torch.Tensor, dims=None) -> None:
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


class ReferenceMixCallback(TrainerCallback):
    """Mix the policy into a trainer's reference engine every `ref_model_sync_steps` optimizer steps."""

    def __init__(self, trainer) -> None:
        if trainer.reference is None:
            raise ValueError("sync_ref_model=True needs a reference model (beta > 0).")
        if trainer.backend.kind == "deepspeed" and trainer.backend.zero_stage == 3:
            raise ValueError("sync_ref_model=True under ZeRO-3 is not supported (partitioned parameters cannot be "
                             "mixed in place); use FSDP2 (configs/accelerate/fsdp2.yaml) or ZeRO-2.")
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.trainer.reference.mix_weights_from(self.trainer.actor, args.ref_model_mixup_alpha)
