"""Adapter-only weight sync (`weight_sync="adapter"`) and `hf-verl serve`'s vLLM-compatible LoRA routes.

GRPO with a LoRA actor against `hf-verl serve`: the base weights go once, then only the adapters; the server ends
on the trained policy (its greedy completions, asked for by the adapter's name, equal the actor's), and every sync
after the first moves the adapters' bytes only. The routes: `/v1/load_lora_adapter` with vLLM's body (a PEFT folder
on the server's disk) and `/v1/unload_lora_adapter`, both behind the token; a request naming the adapter is
generated with it, one naming the served model without it.
"""

import copy
import json
import logging
import urllib.error
import urllib.request

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import TrainerCallback

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.serve.server import RolloutServer
from tests.conftest import build_char_tokenizer

TOKEN = "s3cret"


def _model(tok, seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))


def _post(url, path, body, token=TOKEN):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())


def _greedy(url, model_name, prompt):
    out = _post(url, "/v1/completions", {"model": model_name, "prompt": [prompt], "max_tokens": 6,
                                         "temperature": 0.0}, token=None)
    return out["choices"][0]["token_ids"]


@pytest.mark.slow
def test_grpo_with_a_lora_actor_syncs_only_the_adapters(tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_verl.trainers.grpo_trainer import GRPOTrainer
    from tests.test_grpo_trainer import count_a
    from tests.test_serve import _server_grpo_args

    tok = build_char_tokenizer()
    server = RolloutServer(TransformersEngine(_model(tok, 1), tok), tok, "tiny", port=0, token=TOKEN).start()
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", TOKEN)
    try:
        args = _server_grpo_args(tmp_path, server, max_steps=3, weight_sync="adapter", learning_rate=5e-2)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=_model(tok, 0), reward_funcs=count_a, args=args, processing_class=tok,
                              peft_config=lora, train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
        trainer.train()
        actor = trainer.model
        adapter_bytes = sum(p.numel() * p.element_size() for n, p in actor.named_parameters() if "lora_" in n)
        full_bytes = sum(p.numel() * p.element_size() for n, p in actor.named_parameters() if "lora_" not in n)
        assert trainer.engine.last_sync_stats == {"adapter_bytes": adapter_bytes, "base_bytes": 0}
        assert adapter_bytes < full_bytes / 20
        assert trainer.engine.model == "default" and server.adapters.names == ["default"]
        served = server.engine.model
        for name, p in actor.state_dict().items():  # the base and the adapters, under the PEFT names
            assert torch.equal(served.state_dict()[name], p), name
        local = TransformersEngine(actor, tok)
        for prompt in (tok("abc").input_ids, tok("hello").input_ids):
            expected = local.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0)).completion_ids[0]
            assert _greedy(server.address, "default", prompt) == expected
    finally:
        server.shutdown()


def test_the_vllm_compatible_routes_load_and_unload_an_adapter_behind_the_token(tmp_path):
    tok = build_char_tokenizer()
    base = _model(tok, 0)
    server = RolloutServer(TransformersEngine(_model(tok, 0), tok), tok, "tiny", port=0, token=TOKEN).start()
    try:
        torch.manual_seed(5)
        peft = get_peft_model(_model(tok, 0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                          init_lora_weights=False))
        peft.save_pretrained(tmp_path / "a1")
        prompt = tok("abc").input_ids
        base_ids = _greedy(server.address, "tiny", prompt)
        with pytest.raises(urllib.error.HTTPError) as err:
            _post(server.address, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(tmp_path / "a1")},
                  token=None)
        assert err.value.code == 401
        answer = _post(server.address, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(tmp_path / "a1")})
        assert answer == {"loaded": "a1", "weight_version": 1}
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        with_adapter = TransformersEngine(peft, tok).generate([prompt], greedy).completion_ids[0]
        assert _greedy(server.address, "a1", prompt) == with_adapter != base_ids
        assert _greedy(server.address, "tiny", prompt) == base_ids  # the served name: adapters off
        with pytest.raises(urllib.error.HTTPError) as err:
            _post(server.address, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(tmp_path / "none")})
        assert err.value.code == 400 and "adapter_config.json" in err.value.read().decode()
        assert _post(server.address, "/v1/unload_lora_adapter", {"lora_name": "a1"})["unloaded"] == "a1"
        with pytest.raises(urllib.error.HTTPError) as err:
            _greedy(server.address, "a1", prompt)
        assert err.value.code == 404
        assert _greedy(server.address, "tiny", prompt) == base_ids
        assert isinstance(server.engine.model, type(base)) and not isinstance(server.engine.model, PeftModel)
    finally:
        server.shutdown()


def test_adapter_sync_is_refused_where_it_cannot_run():
    from hf_verl.engine.registry import RoleLayout, make_engine
    from hf_verl.parallel.backend import BackendSpec
    from hf_verl.parallel.dims import ParallelDims
    from hf_verl.pipeline.sync import sync_weights

    tok = build_char_tokenizer()
    actor = make_engine(_model(tok, 0), "actor", RoleLayout(BackendSpec(), ParallelDims()), trainable=False)
    engine = TransformersEngine(_model(tok, 1), tok)
    engine.weight_sync_mode = "adapter"
    with pytest.raises(ValueError, match="weight_sync='adapter' needs a PEFT LoRA actor"):
        sync_weights(actor, engine)
    saving = get_peft_model(_model(tok, 0), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    actor = make_engine(saving, "actor", RoleLayout(BackendSpec(), ParallelDims()), trainable=False)
    with pytest.raises(ValueError, match="sends the LoRA tensors only, but the actor also trains"):
        sync_weights(actor, engine)


# ---------------------------------------------------------------------- into the transformers engine's own model
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _parts(model, lora):
    from hf_verl.parallel.weight_export import iter_weight_buckets

    return [pair for part in iter_weight_buckets(model, lora=lora) for pair in part]


def test_the_transformers_engine_takes_the_base_once_then_adapters_in_flight():
    """A plain model (a replica) gets the base and the adapter, then generates as the PEFT actor; a later adapter
    sync lands between two decode steps of a running generation."""
    from tests.test_in_flight import update_while_held

    tok = build_char_tokenizer()
    torch.manual_seed(3)
    actor = get_peft_model(_model(tok, 0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    config = actor.peft_config["default"].to_dict()
    # the forward hook that holds a decode step needs the model's own forward: no direct decode steps
    served = TransformersEngine(_model(tok, 1), tok, direct_decode=False)
    served.eos_token_ids = set()
    served.sync_adapter("default", config, _parts(actor, "base"), _parts(actor, "adapter"))
    assert isinstance(served.model, PeftModel) and served.weight_version == 1
    for name, p in actor.state_dict().items():
        assert torch.equal(served.model.state_dict()[name], p), name
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    prompt = [tok("abc").input_ids]
    before = TransformersEngine(actor, tok).generate(prompt, greedy).completion_ids[0]
    assert served.generate(prompt, greedy).completion_ids[0] == before
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.mul_(-3.0)
    served.tag_token_versions = True
    held = 3
    out = update_while_held(served, held, lambda: served.generate(prompt, greedy),
                            lambda: served.sync_adapter("default", config, None, _parts(actor, "adapter")))
    assert out.extra["token_versions"] == [[1] * held + [2] * (10 - held)]
    assert out.completion_ids[0][:held] == before[:held]
    served.tag_token_versions = False
    after = TransformersEngine(actor, tok).generate(prompt, greedy).completion_ids[0]
    assert served.generate(prompt, greedy).completion_ids[0] == after != before
    with pytest.raises(ValueError, match="no tensor 'nope'"):
        served.sync_adapter("default", config, None, [("nope", torch.zeros(1))])
    # a PEFT model of another base: the plain names reach its wrapped layers' base weights
    other = TransformersEngine(get_peft_model(_model(tok, 2), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])),
                               tok)
    other.sync_adapter("default", config, _parts(actor, "base"), _parts(actor, "adapter"))
    for name, p in actor.state_dict().items():
        assert torch.equal(other.model.state_dict()[name], p), name


def _async_grpo(tmp_path, tok, weight_sync, **kw):
    from datasets import Dataset

    from hf_verl.trainers.grpo_trainer import GRPOTrainer
    from tests.test_grpo_trainer import _args, count_a

    args = _args(tmp_path / weight_sync, max_steps=3, use_async_rollout=True, weight_sync=weight_sync,
                 learning_rate=5e-2, seed=0, per_row_sampling_seed=True, **kw)
    return GRPOTrainer(model=_model(tok, 0), reward_funcs=count_a, args=args, processing_class=tok, peft_config=LORA,
                       train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))


class _CopyEngines(TrainerCallback):
    """Keeps the actor copy asynchronous rollout generated on (the trainer frees it when training ends)."""

    def __init__(self, trainer):
        self.trainer, self.engine, self.continuous = trainer, None, []

    def on_step_end(self, args, state, control, **kwargs):
        self.engine = self.trainer._async_engine or self.engine
        self.continuous.append(self.engine is not None and self.engine.continuous_batching)


def _adapter_syncs(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("adapter weight sync")]


@pytest.mark.slow
def test_async_grpo_syncs_only_the_adapters_into_the_actor_copy(tmp_path, caplog):
    """Asynchronous rollout with a LoRA actor: the copy keeps the base unmerged and each sync copies the adapters
    only; the losses equal a merged-sync run's, and the copy ends generating as the actor's merged model."""
    from hf_verl.pipeline.sync import sync_weights

    tok = build_char_tokenizer()
    merged = _async_grpo(tmp_path, tok, "auto")
    merged.train()
    with caplog.at_level(logging.DEBUG, logger="hf_verl.pipeline.sync"):
        trainer = _async_grpo(tmp_path, tok, "adapter")
        seen = _CopyEngines(trainer)
        trainer.add_callback(seen)
        trainer.train()
        actor_copy = seen.engine
        assert isinstance(actor_copy.model, PeftModel) and actor_copy.weight_sync_mode == "adapter"
        sync_weights(trainer.actor, actor_copy)  # to the last step's weights
    actor = trainer.model
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in actor.named_parameters() if "lora_" in n)
    syncs = _adapter_syncs(caplog)
    assert len(syncs) >= 2 and set(syncs) == {f"adapter weight sync: {adapter_bytes} adapter bytes, 0 base bytes"}
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (trainer, merged)]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], abs=1e-5)
    for name, p in actor.state_dict().items():  # the base unmerged, the adapters the actor's
        assert torch.equal(actor_copy.model.state_dict()[name], p), name
    reference = TransformersEngine(copy.deepcopy(actor).merge_and_unload(), tok)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompts = [tok("abc").input_ids, tok("hello").input_ids]
    assert actor_copy.generate(prompts, greedy).completion_ids == reference.generate(prompts, greedy).completion_ids


@pytest.mark.slow
def test_in_flight_grpo_with_continuous_batching_syncs_only_the_adapters(tmp_path, caplog):
    tok = build_char_tokenizer()
    with caplog.at_level(logging.DEBUG, logger="hf_verl.pipeline.sync"):
        trainer = _async_grpo(tmp_path, tok, "adapter", in_flight_weight_updates=True, async_rollout_depth=2,
                              max_staleness=2, max_completion_length=12)
        seen = _CopyEngines(trainer)
        trainer.add_callback(seen)
        trainer.train()
    actor_copy = seen.engine
    assert any(seen.continuous) and isinstance(actor_copy.model, PeftModel)  # rounds decoded together
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "lora_" in n)
    syncs = _adapter_syncs(caplog)
    assert len(syncs) >= 2 and set(syncs) == {f"adapter weight sync: {adapter_bytes} adapter bytes, 0 base bytes"}
    served = [h for h in trainer.state.log_history if "rollout/token_version_spread" in h]
    assert served and all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
