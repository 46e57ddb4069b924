"""Routing replay on the Megatron engine against the accelerate engine, one process (a gloo group of one).

For each bridged MoE family (tests/distributed/megatron_moe.py's tiny models), a rollout batch gets a routing
record of other experts than the routers would choose; the Megatron engine (Megatron-Core's RouterReplay driven
by `router_replay`) and the accelerate engine (hf_verl's router tap) score it with replay, and without. Writes
`OUT/result.json`: per family the largest log-prob difference between the engines with replay, and how far
replay moved each engine's log-probs."""

import copy
import json
import os
import sys

import torch

from hf_verl.engine.registry import RoleLayout, make_engine
from hf_verl.engine.step import LogProbs
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims
from hf_verl.parallel.megatron.launch import ensure_process_group
from tests.distributed.megatron_moe import FAMILIES, batch, model


def with_record(b, layers: int, experts: int = 4, top_k: int = 2):
    g = torch.Generator().manual_seed(9)
    real = b.attention_mask.bool()
    B, T = real.shape
    record = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(B * T * layers)])
    record = record.view(B, T, layers, top_k)
    record[~real] = -1
    P = b.prompt_ids.shape[1]
    b.prompt_routed_experts, b.completion_routed_experts = record[:, :P].clone(), record[:, P:].clone()
    return b.validate()


def main(out: str) -> None:
    from hf_verl.engine.megatron import MegatronEngine

    ensure_process_group()
    import torch.distributed as dist

    pp = int(os.environ.get("MEGATRON_PP", "1"))  # under torchrun: a pipeline of pp stages replays too
    dims = ParallelDims.data_parallel(dist.get_world_size(), dist.get_rank(), shard=False, pp=pp)
    result = {}
    for family in FAMILIES:
        hf = model(family)
        b = with_record(batch(), hf.config.num_hidden_layers)
        megatron = MegatronEngine(copy.deepcopy(hf), role="actor", dims=dims, trainable=False)
        accelerate = make_engine(copy.deepcopy(hf), "actor", RoleLayout(BackendSpec(), ParallelDims()), trainable=False)
        got = {}
        metrics = {}
        for name, engine in (("megatron", megatron), ("accelerate", accelerate)):
            own = engine.infer(b, LogProbs())
            engine.router_replay = True
            replayed = engine.infer(b, LogProbs())
            got[name] = (replayed.logp, own.logp)
            metrics[name] = replayed.routing
        mask = b.completion_mask.bool()
        result[family] = {
            "replayed": (got["megatron"][0] - got["accelerate"][0])[mask].abs().max().item(),
            "own": (got["megatron"][1] - got["accelerate"][1])[mask].abs().max().item(),
            "moved_megatron": (got["megatron"][0] - got["megatron"][1])[mask].abs().max().item(),
            "moved_accelerate": (got["accelerate"][0] - got["accelerate"][1])[mask].abs().max().item(),
            "metrics": metrics}
    if dist.get_rank() == 0:
        with open(f"{out}/result.json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
