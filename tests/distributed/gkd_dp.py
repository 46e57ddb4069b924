"""GKDTrainer for 4 steps on one global batch of 4 rows (`lmbda=0`: the dataset's completions, the full JSD): run with
plain python (one process, the teacher colocated) or under `accelerate launch` with 2 processes (DDP, 2 rows each,
the teacher on its own placement: `placement={"teacher": "fsdp2"}`, sharded over both processes).

The default shuffled sampler deals the same global batches whatever the layout and the loss is normalised by the
window's tokens over both ranks, so the logged losses and the final weights must match. Then one on-policy step
(`lmbda=1`: each rank samples through its rollout engine and the sharded teacher scores the samples) must run. The
main rank writes `OUT/result.json` (the losses, the on-policy step's loss, the layout, the teacher's parameter type)
and the final student into `OUT/final`.
"""

import json
import os
import sys

from hf_verl import GKDConfig, GKDTrainer
from tests.conftest import build_char_tokenizer
from tests.test_facade import tiny_llama
from tests.test_gkd import _rows

GLOBAL_ROWS = 4


def _trainer(out: str, world: int, **kw) -> GKDTrainer:
    tok = build_char_tokenizer()
    args = GKDConfig(output_dir=out, use_cpu=True, report_to=[], logging_steps=1, max_new_tokens=6,
                     per_device_train_batch_size=GLOBAL_ROWS // world, learning_rate=3e-3, lr_scheduler_type="constant",
                     save_strategy="no", disable_tqdm=True, seed=11, gradient_checkpointing=False, bf16=False,
                     placement={"teacher": "fsdp2"} if world > 1 else None, **kw)
    return GKDTrainer(model=tiny_llama(tok, seed=0), teacher_model=tiny_llama(tok, seed=1), args=args,
                      train_dataset=_rows(), processing_class=tok)


def main(out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = _trainer(out, world, lmbda=0.0, max_steps=4)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    on_policy = _trainer(os.path.join(out, "on_policy"), world, lmbda=1.0, max_steps=1)
    on_policy.train()
    if trainer.dims.is_main:
        result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                  "on_policy_loss": [h["loss"] for h in on_policy.state.log_history if "loss" in h],
                  "backend": trainer.backend.label, "world": trainer.dims.world_size, "dp_size": trainer.dims.dp_size,
                  "teacher_param_type": type(next(trainer.teacher.model.parameters())).__name__,
                  "teacher_backend": trainer.teacher.backend.label}
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1])
    leave_together()
