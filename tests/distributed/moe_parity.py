"""Several Mixture-of-Experts trainers in one launch: GRPO, PPO, DPO or the role facade, 3 steps each, on tiny
Qwen3-MoE / Qwen2-MoE / Mixtral actors with a router aux loss (the model config's `router_aux_loss_coef` 0.05).

`python -m tests.distributed.moe_parity OUT grpo:qwen3_moe,dpo:mixtral,...` runs the listed (algorithm, family)
runs one after the other. Alone it is the single-process baseline; under `accelerate launch --config_file
configs/accelerate/<backend>_cpu.yaml` each run trains the same global batch split over the processes (the
settings of :mod:`tests.distributed.parity`: per-row sampling seeds, one micro-batch per optimizer step). The main
rank writes `OUT/<algo>-<family>.json` (logged losses, aux losses, backend, world, parameter type, the sharded
export's distance from the initial weights) and `OUT/<algo>-<family>.safetensors` (the final actor, gathered).
"""

import json
import os
import sys

import torch
from datasets import Dataset

from tests.conftest import build_char_tokenizer
from tests.distributed.parity import common, count_a, export_error, tiny_qwen2
from tests.moe_models import tiny_moe

PROMPTS = ["abc", "xyz", "hello", "ab", "b", "cc", "dd", "e", "aa", "ba", "ca", "da"]


def build(algo: str, family: str, out: str, world: int, tok):
    """The trainer of one run (the facade is built in :func:`facade_run`)."""
    if algo == "grpo":
        from hf_verl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(num_generations=4, max_completion_length=6, beta=0.05, temperature=1.0,
                          per_row_sampling_seed=True, **common(out, world))
        return GRPOTrainer(model=tiny_moe(family, tok), reward_funcs=count_a, args=args,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)
    if algo == "ppo":
        from hf_verl import PPOConfig, PPOTrainer

        args = PPOConfig(num_mini_batches=1, num_ppo_epochs=1, response_length=6, stop_token="eos", kl_coef=0.05,
                         per_row_sampling_seed=True, critic_learning_rate=2e-3, **common(out, world))
        critic = tiny_qwen2(tok, "Qwen2ForSequenceClassification", seed=1, num_labels=1)
        return PPOTrainer(args=args, processing_class=tok, model=tiny_moe(family, tok), reward_model=count_a,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}), value_model=critic)
    from hf_verl import DPOConfig, DPOTrainer

    pairs = {"prompt": [p + "=" for p in PROMPTS] * 3,
             "chosen": [p[::-1] for p in PROMPTS] * 3, "rejected": [p + p for p in PROMPTS] * 3}
    args = DPOConfig(max_length=32, beta=0.1, **common(out, world))
    return DPOTrainer(model=tiny_moe(family, tok), args=args, train_dataset=Dataset.from_dict(pairs),
                      processing_class=tok)


def facade_run(family: str, tok) -> dict:
    """The facade's loop (KL reference, dense critic) on this rank's slice of each global batch of 4 prompts
    (one per rank on 4 processes)."""
    from hf_verl import Trainer
    from hf_verl.parallel import comm

    prompts = ["abc", "xyz", "hello", "ab", "b", "cc", "ba", "aab", "c", "bca", "a", "xa"]
    facade = Trainer(actor_model=tiny_moe(family, tok), reference_model=tiny_moe(family, tok),
                     critic_model=tiny_qwen2(tok, "Qwen2ForSequenceClassification", seed=1, num_labels=1),
                     reward_model=count_a, tokenizer=tok,
                     config=dict(num_generations=4, max_completion_length=6, beta=0.05, learning_rate=1e-3,
                                 critic_learning_rate=2e-3, seed=11, per_row_sampling_seed=True))
    dims = facade.dims
    per_rank = 4 // dims.dp_size
    losses, aux = [], []
    for step in range(3):
        batch = prompts[4 * step : 4 * step + 4][dims.dp_rank * per_rank : (dims.dp_rank + 1) * per_rank]
        loss = facade.compute_loss(facade.rollout(batch))
        losses.append(comm.reduce(dims, loss.detach().reshape(1), "mean").item())
        aux.append(comm.reduce(dims, torch.tensor([float(facade._loss_metrics["aux_loss"])]), "mean").item())
        facade.step(loss)
    engine = facade.actor_engine
    return {"losses": losses, "aux": aux, "backend": engine.backend.label, "world": dims.world_size,
            "param_type": type(next(engine.model.parameters())).__name__,
            "zero3_partitioned": hasattr(next(engine.model.parameters()), "ds_id"),
            "aux_enabled": facade.algorithm.aux_loss_enabled,
            "export_max_error": 0.0, "export_names_match": True}, engine.full_state_dict(), dims.is_main


def trainer_run(algo: str, family: str, out: str, world: int, tok):
    trainer = build(algo, family, out, world, tok)
    err, same_names = export_error(trainer, tiny_moe(family, tok).state_dict())
    param = next(trainer.actor.model.parameters())
    trainer.train()
    history = trainer.state.log_history
    result = {"losses": [h["loss"] for h in history if "loss" in h],
              "aux": [h["aux_loss"] for h in history if "aux_loss" in h], "aux_enabled": getattr(trainer, "algorithm", trainer).aux_loss_enabled,
              "backend": trainer.backend.label, "world": trainer.dims.world_size,
              "param_type": type(param).__name__, "zero3_partitioned": hasattr(param, "ds_id"),
              "export_max_error": err, "export_names_match": same_names}
    return result, trainer.actor.full_state_dict(), trainer.dims.is_main


def main(out: str, runs: str) -> None:
    from safetensors.torch import save_file

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = build_char_tokenizer()
    for run in runs.split(","):
        algo, family = run.split(":")
        result, weights, is_main = (facade_run(family, tok) if algo == "facade"
                                    else trainer_run(algo, family, out, world, tok))
        if is_main:
            with open(os.path.join(out, f"{algo}-{family}.json"), "w") as f:
                json.dump(result, f)
            save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, f"{algo}-{family}.safetensors"))
        torch.manual_seed(0)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1], sys.argv[2])
    leave_together()
