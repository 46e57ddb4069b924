"""The facade's loop with per-role placement: a critic and a reference on their own backends beside the actor.

`python -m tests.distributed.placement_parity PLACEMENT_JSON OUT`: three steps of the facade with a critic (GAE)
and a KL reference over one global batch of prompts, each rank taking its slice. Run alone it is the
one-process baseline (pass `{}`: every role colocated); under `ACCELERATE_USE_CPU=1 accelerate launch
--multi_gpu --num_processes 2` (the DDP launch) with e.g. `{"critic": "fsdp2", "reference": "zero3"}` the critic
and the reference run on their own layouts over the same 2 processes while the actor stays on DDP; with
`{"reference": "http://127.0.0.1:PORT/v1"}` every rank reads its rows' reference log-probs from that server (which
the caller starts, serving :func:`reference_model`).

The main rank writes `OUT/result.json`: the mean losses per step (policy and value), the backend label and the
parameter type of each role's engine (DTensor for FSDP2, a ZeRO-3 `ds_id` for ZeRO-3), the reference's log-probs
of the first step's rollout (gathered over the ranks), and `trainer.placement()`; the final weights go to
`OUT/final` (the critic under `final/critic`).
"""

import json
import os
import sys

import torch

from tests.conftest import build_char_tokenizer
from tests.distributed.parity import count_a, tiny_qwen2

PROMPTS = ["abc", "xyz", "hello", "ab", "b", "cc"]


def reference_model(tok):
    """The KL reference of these runs (local, or served by the test for a URL placement)."""
    return tiny_qwen2(tok, seed=3)


def run(placement: dict, out: str) -> None:
    from hf_verl import Trainer
    from hf_verl.engine.base import TrainingEngine
    from hf_verl.parallel import comm
    from hf_verl.rewards.remote import is_url

    tok = build_char_tokenizer()
    # a reference behind a URL is the model that server serves (the test serves reference_model(tok) there)
    served = is_url(placement.get("reference"))
    facade = Trainer(actor_model=tiny_qwen2(tok), reference_model=None if served else reference_model(tok),
                     critic_model=tiny_qwen2(tok, "Qwen2ForSequenceClassification", seed=1, num_labels=1),
                     reward_model=count_a, tokenizer=tok, placement=placement or None,
                     config=dict(num_generations=4, max_completion_length=6, beta=0.05, learning_rate=1e-3,
                                 critic_learning_rate=2e-3, seed=11, per_row_sampling_seed=True))
    dims = facade.dims
    per_rank = 2 // dims.dp_size
    losses, values, ref_lp, ref_mask = [], [], None, None
    for step in range(3):
        batch = PROMPTS[2 * step : 2 * step + 2][dims.dp_rank * per_rank : (dims.dp_rank + 1) * per_rank]
        rollout = facade.rollout(batch)
        if step == 0:  # the reference's log-probs of this rollout, every rank's rows in rank order
            mask = rollout.completion_mask.float()
            ref_lp = comm.gather_padded(dims, rollout.ref_logprobs.float() * mask).tolist()
            ref_mask = comm.gather_padded(dims, mask).tolist()
        loss = facade.compute_loss(rollout)
        losses.append(comm.reduce(dims, loss.detach().reshape(1), "mean").item())
        values.append(comm.reduce(dims, torch.tensor([facade._loss_metrics["loss/value"]]), "mean").item())
        facade.step(loss)
    lines = facade.placement()
    facade.save_pretrained(os.path.join(out, "final"))
    if dims.is_main:
        roles = {}
        for name in ("actor", "critic", "reference"):
            engine = facade.roles.engine(name)
            if not isinstance(engine, TrainingEngine):  # a served reference
                continue
            param = next(engine.model.parameters())
            roles[name] = {"backend": engine.backend.label, "param_type": type(param).__name__,
                           "zero3_partitioned": hasattr(param, "ds_id")}
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"losses": losses, "values": values, "roles": roles, "world": dims.world_size,
                       "ref_logprobs": ref_lp, "ref_mask": ref_mask, "placement": lines}, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    run(json.loads(sys.argv[1]), sys.argv[2])
    leave_together()
