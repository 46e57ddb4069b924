"""Run under `torchrun --nproc_per_node 2`: routing replay under Ulysses sequence parallelism (sp=2) against one
process. A tiny Qwen3-MoE rolls out under bf16 autocast with its routing recorded (the same rows on both ranks);
an actor engine with `router_replay` scores and trains it one SGD step with sp=2 (DDP backend: each rank's routers
see its shard of the packed tokens, the record is packed and sharded alike) and on one process. Each rank writes
`rank<k>.json` into argv[1]: the largest log-prob, loss and weight differences, and the routing metrics."""

import copy
import json
import sys

import torch
import torch.distributed as dist

from hf_verl.engine.accelerate_engine import AccelerateEngine
from hf_verl.engine.step import LogProbs, OptimizerSpec
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.comm import leave_together
from hf_verl.parallel.dims import ParallelDims
from hf_verl.pipeline.generation import batch_from_output
from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from tests.conftest import build_char_tokenizer
from tests.test_router_replay import moe_model


def step(engine, batch):
    mask = batch.completion_mask.float()
    advantages = torch.linspace(-1, 1, batch.batch_size)

    def loss_fn(out, mb):
        return -(out.logp * advantages[:, None] * mask).sum() / mask.sum(), dict(out.routing)

    result = engine.forward_backward([batch], loss_fn, forward=LogProbs(), keep_outputs=True)
    engine.optimizer_step()
    return result.outputs[0].logp, result.losses[0].item(), result.metrics[0], engine.full_state_dict()


def main(out_dir: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = build_char_tokenizer()
    model = moe_model(tok, hidden=64, experts=8, layers=2)
    model.config._attn_implementation = "sdpa"
    rollout = TransformersEngine(copy.deepcopy(model), tok, autocast_dtype=torch.bfloat16)
    rollout.record_routing = True
    prompts = ["abc", "hello there", "xyz", "ab", "q"]
    ids = [tok(p).input_ids for p in prompts]
    out = rollout.generate(ids, SamplingParams(max_new_tokens=9, temperature=1.0, seed=3))
    batch = batch_from_output(ids, prompts, out, tok, "cpu")
    # other experts than the routers would choose (the same on both ranks): parity then proves the record is
    # what routes every shard's tokens
    g = torch.Generator().manual_seed(5)
    for name in ("prompt_routed_experts", "completion_routed_experts"):
        record = getattr(batch, name)
        other = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(record[..., 0].numel())])
        setattr(batch, name, torch.where(record >= 0, other.view(record.shape).to(record.dtype), record))
    results = {}
    for name, dims, backend, acc in (("one", ParallelDims(), BackendSpec(), None),
                                     ("sp2", ParallelDims.data_parallel(world, rank, shard=False, sp=2), BackendSpec("ddp"),
                                      accelerator)):
        engine = AccelerateEngine(copy.deepcopy(model), role="actor", dims=dims, backend=backend, accelerator=acc)
        engine.router_replay = True
        engine.configure_optimizer(OptimizerSpec(torch.optim.SGD, {"lr": 0.5}))
        results[name] = step(engine, batch)
    (lp1, loss1, m1, w1), (lp2, loss2, m2, w2) = results["one"], results["sp2"]
    report = {"max_diff_logp": (lp1 - lp2).abs().max().item(), "diff_loss": abs(loss1 - loss2),
              "metrics_one": m1, "metrics_sp2": m2}
    if rank == 0:
        report["max_diff_weights"] = max((w1[n] - w2[n]).abs().max().item() for n in w1)
        report["weights_moved"] = max((w1[n] - v).abs().max().item() for n, v in model.state_dict().items())
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    leave_together()


if __name__ == "__main__":
    main(sys.argv[1])
