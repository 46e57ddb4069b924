"""Run under `torchrun --nproc_per_node 2`: the training engine with sequence parallelism (sp=2) against one process.

For each backend (DDP over the world; FSDP2 over the flattened dp_shard x sp mesh) an actor and a critic
`AccelerateEngine` are built with `ParallelDims(sp=2)` and trained for two SGD steps on the same rollout
batch as a single-process plain engine on a copy of the same models (run on every rank, no process group
involved): `engine.logprobs` / `engine.values` go through the packed, sequence-sharded path and `engine.backward`
turns the group's averaged gradients into the sum. Each rank writes `rank<k>.json` into argv[1]: per backend, the
largest differences of log-probs, entropy, values, losses, gradient norms and final weights.
"""

import copy
import json
import sys

import torch
import torch.distributed as dist

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.accelerate_engine import AccelerateEngine
from hf_verl.engine.step import LogProbs, OptimizerSpec, Values
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.comm import leave_together
from hf_verl.parallel.dims import ParallelDims
from tests.distributed.ulysses_parity import build


def rollout() -> RolloutBatch:
    g = torch.Generator().manual_seed(11)
    prompts = [[int(t) for t in torch.randint(1, 61, (n,), generator=g)] for n in (3, 6, 2, 5)]
    completions = [[int(t) for t in torch.randint(1, 61, (n,), generator=g)] for n in (5, 1, 8, 4)]
    batch = RolloutBatch.from_lists(prompts, completions, pad_token_id=0)
    batch.advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    return batch


def engines(actor_model, critic_model, dims, backend, accelerator=None):
    actor = AccelerateEngine(actor_model, role="actor", dims=dims, backend=backend, accelerator=accelerator)
    critic = AccelerateEngine(critic_model, role="critic", dims=dims, backend=backend, accelerator=accelerator)
    actor.configure_optimizer(OptimizerSpec(torch.optim.SGD, {"lr": 0.5}, max_grad_norm=1.0))
    critic.configure_optimizer(OptimizerSpec(torch.optim.SGD, {"lr": 0.5}, max_grad_norm=1.0))
    return actor, critic


def run(actor, critic, batch, steps=2):
    """Two steps; the loss's policy part runs through the actor engine's forward_backward, its value part through
    the critic's (each engine scales its own backward)."""
    rec = {"losses": [], "logp": [], "entropy": [], "values": [], "actor_norms": [], "critic_norms": []}
    mask = batch.completion_mask.float()
    returns = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape)
    for _ in range(steps):
        def policy_loss(out, mb):
            loss = -(out.logp * mb.advantages[:, None] * mask).sum() / mask.sum() \
                - 0.01 * (out.entropy * mask).sum() / mask.sum()
            return loss, {}

        def value_loss(values, mb):
            return 0.5 * (((values - returns) * mask) ** 2).sum() / mask.sum(), {}

        pol = actor.forward_backward([batch], policy_loss, forward=LogProbs(with_entropy=True), keep_outputs=True)
        val = critic.forward_backward([batch], value_loss, forward=Values(), keep_outputs=True)
        rec["losses"].append([pol.losses[0].item(), val.losses[0].item()])
        rec["logp"].append(pol.outputs[0].logp)
        rec["entropy"].append(pol.outputs[0].entropy)
        rec["values"].append(val.outputs[0])
        rec["actor_norms"].append(actor.optimizer_step())
        rec["critic_norms"].append(critic.optimizer_step())
    from torch.distributed.tensor import DTensor

    rec["layout"] = [type(actor.module).__name__, any(isinstance(p, DTensor) for p in actor.module.parameters())]
    return rec, actor.full_state_dict(), critic.full_state_dict()


def compare(kind, rank, world, accelerator):
    actor_model, critic_model = build("llama", 4, 2)
    ref = engines(copy.deepcopy(actor_model), copy.deepcopy(critic_model), ParallelDims(), BackendSpec())
    want, want_actor, want_critic = run(*ref, rollout())
    dims = ParallelDims.data_parallel(world, rank, shard=kind == "fsdp2", sp=2)
    got, got_actor, got_critic = run(*engines(actor_model, critic_model, dims, BackendSpec(kind), accelerator),
                                     rollout())

    def diff(key):
        return max((a - b).abs().max().item() for a, b in zip(got[key], want[key]))

    result = {"attention": actor_model.config._attn_implementation,
              "max_diff_logp": diff("logp"), "max_diff_entropy": diff("entropy"), "max_diff_values": diff("values"),
              "max_diff_loss": max(abs(a - b) for g, w in zip(got["losses"], want["losses"]) for a, b in zip(g, w)),
              "max_diff_norm": max(abs(a - b) for k in ("actor_norms", "critic_norms")
                                   for a, b in zip(got[k], want[k])),
              "losses": got["losses"], "want_losses": want["losses"], "layout": got["layout"]}
    if dims.is_main:
        result["max_diff_weights"] = max((got_actor[n] - want_actor[n]).abs().max().item() for n in want_actor)
        result["max_diff_critic_weights"] = max((got_critic[n] - want_critic[n]).abs().max().item()
                                                for n in want_critic)
        result["weights_moved"] = max((want_actor[n] - v).abs().max().item()
                                      for n, v in build("llama", 4, 2)[0].state_dict().items())
    return result


def main(out_dir: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {kind: compare(kind, rank, world, accelerator) for kind in ("ddp", "fsdp2")}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    leave_together()


if __name__ == "__main__":
    main(sys.argv[1])
