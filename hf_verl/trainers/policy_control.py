"""TR-DPO style reference mixing for the trainers (TRL's `sync_ref_model`).

:class:`ReferenceMixCallback` sets `ref <- (1 - alpha) ref + alpha policy` every `ref_model_sync_steps`
optimizer steps. Sharded (FSDP2) parameters mix shard by shard: actor and reference are laid out alike.
"""

from __future__ import annotations

from transformers import TrainerCallback


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
