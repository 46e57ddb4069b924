"""The facade's string roles load sharded: `hf_verl.Trainer(actor_model=PATH, reference_model=PATH,
critic_model=PATH)` for 2 steps (GAE critic, KL reference) against the same run given the models loaded whole.

`accelerate launch --config_file configs/accelerate/<fsdp2|zero3>_cpu.yaml -m tests.distributed.sharded_load_facade
DIR OUT`: `DIR` holds `actor`, `reference` and `critic` (:func:`save_models`). The facade runs twice in this
process: from the paths, and from `from_pretrained` objects of the same directories. The loader's INFO lines
(`hf_verl.parallel.sharded_load`) are collected per rank. The main rank writes `OUT/result.json`: per load, the
mean losses per step, each role's backend label, every rank's loader lines; and the largest difference of the final
actor and critic weights (gathered) between the two loads.
"""

import json
import logging
import os
import sys

import torch

from tests.conftest import build_char_tokenizer
from tests.distributed.parity import count_a
from tests.distributed.sharded_load_trainers import _Lines

PROMPTS = ["abc", "xyz", "hello", "ab"]


def save_models(directory: str, tok) -> None:
    """A tiny Llama actor (seed 0), another as the KL reference (seed 3) and a one-label sequence-classification
    critic (seed 1), saved as safetensors under `directory/{actor,reference,critic}`."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    def config(**extra):
        return LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=len(tok), tie_word_embeddings=False,
                           max_position_embeddings=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                           **extra)

    for name, cls, seed, extra in (("actor", LlamaForCausalLM, 0, {}), ("reference", LlamaForCausalLM, 3, {}),
                                   ("critic", LlamaForSequenceClassification, 1, {"num_labels": 1})):
        torch.manual_seed(seed)
        cls(config(**extra)).save_pretrained(os.path.join(directory, name), safe_serialization=True)


def run(sources: dict, tok, dims_out: dict) -> tuple[list[float], dict, dict, dict]:
    from hf_verl import Trainer
    from hf_verl.parallel import comm

    facade = Trainer(actor_model=sources["actor"], reference_model=sources["reference"],
                     critic_model=sources["critic"], reward_model=count_a, tokenizer=tok, reference_tokenizer=tok,
                     config=dict(num_generations=4, max_completion_length=6, beta=0.05, learning_rate=1e-2,
                                 critic_learning_rate=1e-2, seed=11, per_row_sampling_seed=True))
    dims = facade.dims
    per_rank = 2 // dims.dp_size
    losses = []
    for step in range(2):
        batch = PROMPTS[2 * step: 2 * step + 2][dims.dp_rank * per_rank: (dims.dp_rank + 1) * per_rank]
        rollout = facade.rollout(batch)
        loss = facade.compute_loss(rollout)
        losses.append(comm.reduce(dims, loss.detach().reshape(1), "mean").item())
        facade.step(loss)
    backends = {name: facade.roles.engine(name).backend.label for name in ("actor", "reference", "critic")}
    actor = facade.roles.engine("actor").full_state_dict()  # collectives: the main rank keeps the tensors
    critic = facade.roles.engine("critic").full_state_dict()
    dims_out["rank"], dims_out["world"] = dims.dp_rank, dims.world_size
    facade.close()
    return losses, backends, actor, critic


def main(directory: str, out: str) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tok = build_char_tokenizer()
    handler = _Lines()
    logger = logging.getLogger("hf_verl.parallel.sharded_load")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    paths = {name: os.path.join(directory, name) for name in ("actor", "reference", "critic")}

    def whole():
        return {"actor": AutoModelForCausalLM.from_pretrained(paths["actor"], dtype=torch.float32),
                "reference": AutoModelForCausalLM.from_pretrained(paths["reference"], dtype=torch.float32),
                "critic": AutoModelForSequenceClassification.from_pretrained(paths["critic"], num_labels=1,
                                                                             dtype=torch.float32)}

    runs, dims = {}, {}
    for load in ("sharded", "whole"):
        handler.lines.clear()
        losses, backends, actor, critic = run(paths if load == "sharded" else whole(), tok, dims)
        gathered = [None] * dims["world"]
        torch.distributed.all_gather_object(gathered, list(handler.lines))
        runs[load] = {"losses": losses, "backends": backends, "lines": gathered, "actor": actor, "critic": critic}
    if torch.distributed.get_rank() == 0:
        result = {load: {k: run[k] for k in ("losses", "backends", "lines")} for load, run in runs.items()}
        start = whole()
        for role in ("actor", "critic"):
            a, b = runs["sharded"][role], runs["whole"][role]
            result[f"{role}_same_names"] = set(a) == set(b)
            result[f"{role}_weight_diff"] = max(float((a[k] - b[k]).abs().max()) for k in b)
            result[f"{role}_trained"] = max(float((b[k] - start[role].state_dict()[k]).abs().max()) for k in b)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1], sys.argv[2])
    leave_together()
