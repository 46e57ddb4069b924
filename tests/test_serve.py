"""The rollout server over 127.0.0.1 with the remote engine: generation, versioned weight updates, auth."""

import copy
import http.client
import json
import socket
import time
import urllib.request
from urllib.parse import urlparse

import pytest
import torch

from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.rollout.remote import RemoteEngine, RolloutServerError
from hf_verl.serve.server import RolloutServer
from tests.conftest import build_char_tokenizer

TOKEN = "s3cret-token"
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def _model(tok, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tok),
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()


@pytest.fixture
def served():
    tok = build_char_tokenizer()
    model = _model(tok)
    server = RolloutServer(TransformersEngine(model, tok), tok, "tiny", port=0, token=TOKEN).start()
    yield server, tok, model
    server.shutdown()


def _prompts(tok):
    return [tok(p)["input_ids"] for p in ["abc", "hello", "xy"]]


def test_generation_matches_the_local_engine(served):
    server, tok, model = served
    remote = RemoteEngine(server.address, token=TOKEN, prompts_per_request=2)
    assert remote.model == "tiny"
    out = remote.generate(_prompts(tok), GREEDY)
    local = TransformersEngine(copy.deepcopy(model), tok).generate(_prompts(tok), GREEDY)
    assert out.completion_ids == local.completion_ids
    for a, b in zip(out.logprobs, local.logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    assert out.finish_reasons == local.finish_reasons and out.weight_version == 0
    health = json.loads(urllib.request.urlopen(f"{server.address}/health").read())
    assert health == {"status": "ok", "weight_version": 0}


def test_weight_update_in_buckets_bumps_the_version_and_changes_outputs(served):
    server, tok, model = served
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    remote = RemoteEngine(server.address, token=TOKEN, bucket_bytes=4096)  # many buckets
    remote.sync_weights(perturbed.state_dict().items())
    assert remote.weight_version == 1 == remote.server_weight_version()
    out = remote.generate(_prompts(tok), GREEDY)
    want = TransformersEngine(perturbed, tok).generate(_prompts(tok), GREEDY)
    assert out.completion_ids == want.completion_ids and out.weight_version == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), perturbed.state_dict().values()))


def test_wrong_or_missing_token_is_rejected_and_weights_unchanged(served):
    server, tok, model = served
    before = {k: v.clone() for k, v in model.state_dict().items()}
    zeros = {k: torch.zeros_like(v) for k, v in before.items()}
    for token in ("wrong", None):
        with pytest.raises(RolloutServerError, match="401"):
            RemoteEngine(server.address, token=token).sync_weights(zeros.items())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert server.engine.weight_version == 0


def test_a_rejected_upload_larger_than_the_socket_buffers_still_reports_401(served):
    # the server answers 401 before reading the body and closes; the client is still sending 32 MiB
    server, tok, model = served
    big = [("model.embed_tokens.weight", torch.zeros(8 * 2**20))]
    with pytest.raises(RolloutServerError, match=r"401|token"):
        RemoteEngine(server.address, token="wrong", timeout_s=30).sync_weights(big)
    assert server.engine.weight_version == 0 and torch.count_nonzero(model.model.embed_tokens.weight) > 0


def test_a_killed_upload_leaves_the_old_weights_serving(served):
    server, tok, model = served
    from safetensors.torch import save

    before = RemoteEngine(server.address).generate(_prompts(tok), GREEDY).completion_ids
    address = urlparse(server.address)
    host, port = address.hostname, address.port
    # 1) a complete first bucket of an update whose last bucket never comes
    body = save({"model.norm.weight": torch.zeros_like(model.model.norm.weight)})
    conn = http.client.HTTPConnection(host, port)
    conn.request("POST", "/v1/weights?update=u1&index=0&last=0", body,
                 {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/octet-stream"})
    assert json.loads(conn.getresponse().read())["applied"] is False
    # 2) a client that dies halfway through its body
    sock = socket.create_connection((host, port))
    sock.sendall(f"POST /v1/weights?update=u2&index=0&last=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                 f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:20])
    sock.close()
    time.sleep(0.2)
    after = RemoteEngine(server.address).generate(_prompts(tok), GREEDY)
    assert after.completion_ids == before and after.weight_version == 0
    assert torch.count_nonzero(model.model.norm.weight) > 0


def test_bad_requests_say_what_is_wrong(served):
    server, tok, _ = served
    with pytest.raises(RolloutServerError, match="400.*unknown parameter name"):
        RemoteEngine(server.address, token=TOKEN).sync_weights([("not.a.weight", torch.zeros(2))])
    req = urllib.request.Request(f"{server.address}/v1/completions", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400 and "'prompt' is required" in err.value.read().decode()


def test_weights_from_a_path(served, tmp_path):
    server, tok, model = served
    from safetensors.torch import save_file

    state = {k: v.clone() + 1.0 for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "w.safetensors"))
    req = urllib.request.Request(f"{server.address}/v1/weights", data=json.dumps({"path": str(tmp_path)}).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {TOKEN}",
                                                         "Content-Type": "application/json"})
    assert json.loads(urllib.request.urlopen(req).read())["weight_version"] == 1
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])


def test_server_down_fails_within_the_retry_budget():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = RemoteEngine(f"http://127.0.0.1:{port}", model="m", max_retries=2, backoff_s=0.05, timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError, match=f"127.0.0.1:{port} is unreachable after 3 attempt"):
        remote.generate([[1, 2]], GREEDY)
    assert time.monotonic() - t0 < 5


def test_refuses_a_public_host_without_a_token():
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="refusing to serve on non-loopback host '0.0.0.0' without a token"):
        RolloutServer(TransformersEngine(_model(tok), tok), tok, "tiny", host="0.0.0.0", port=0)


@pytest.mark.slow
def test_hf_verl_serve_command(tmp_path):
    import os
    import subprocess
    import sys

    tok = build_char_tokenizer()
    _model(tok).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "token").write_text(TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", str(tmp_path / "m"), "--port", str(port),
                             "--token-file", str(tmp_path / "token")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        remote = RemoteEngine(f"http://127.0.0.1:{port}", token=TOKEN, max_retries=8, backoff_s=0.5)
        out = remote.generate([tok("abc")["input_ids"]], GREEDY)
        assert len(out.completion_ids) == 1 and out.weight_version == 0
        assert remote.model == str(tmp_path / "m")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _server_grpo_args(tmp_path, server, **overrides):
    """A small GRPOConfig generating on `server` (TRL's `vllm_mode="server"` fields)."""
    from hf_verl.trainers.grpo_config import GRPOConfig

    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=5, learning_rate=1e-2,
                  gradient_checkpointing=False, save_strategy="no", disable_tqdm=True, use_vllm=True,
                  vllm_mode="server", vllm_server_base_url=server.address)
    return GRPOConfig(**{**kwargs, **overrides})


def test_grpo_trains_against_the_server(tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_verl.trainers.grpo_trainer import GRPOTrainer

    tok = build_char_tokenizer()
    server_model = _model(tok, seed=1)  # different weights: the first sync must replace them
    server = RolloutServer(TransformersEngine(server_model, tok), tok, "tiny", port=0, token=TOKEN).start()
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", TOKEN)
    try:
        args = _server_grpo_args(tmp_path, server)
        policy = _model(tok, seed=0)

        def count_a(completions, **kwargs):
            return [float(c.count("a")) for c in completions]

        trainer = GRPOTrainer(model=policy, reward_funcs=count_a, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"] * 4}))
        trainer.train()
        # one sync per rollout round (steps 0, 1, 2), and one when train() ends: the server holds the final weights
        assert server.engine.weight_version == 4
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert all("sampling/importance_sampling_ratio/mean" in h and "timing_s/weight_sync" in h for h in logs)
        # same numerics on both sides: the engine/trainer log-prob gap is float noise
        assert all(h["sampling/sampling_logp_difference/max"] < 1e-3 for h in logs)
        assert trainer.state.global_step == 3
        trainer._sync_engine()  # nothing left to push: the server already equals the trained policy
        assert server.engine.weight_version == 4
        assert all(torch.equal(v, server_model.state_dict()[k]) for k, v in policy.state_dict().items())
    finally:
        server.shutdown()


def test_async_grpo_with_the_remote_engine(tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_verl.trainers.grpo_trainer import GRPOTrainer

    tok = build_char_tokenizer()
    server = RolloutServer(TransformersEngine(_model(tok, seed=1), tok), tok, "tiny", port=0, token=TOKEN).start()
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", TOKEN)
    try:
        args = _server_grpo_args(tmp_path, server, use_async_rollout=True)
        trainer = GRPOTrainer(model=_model(tok), reward_funcs=lambda completions, **kw: [float(c.count("a"))
                                                                                       for c in completions],
                              args=args, processing_class=tok, train_dataset=Dataset.from_dict({"prompt": ["ab"] * 8}))
        trainer.train()
        stale = [h["rollout/staleness"] for h in trainer.state.log_history if "rollout/staleness" in h]
        assert stale == [0.0, 1.0, 1.0]
        # syncs at step 0 (rounds 0 and 1 are generated from it), at step 1 (round 2), and the final weights when
        # train() ends
        assert server.engine.weight_version == 3
        assert trainer._async_engine is None  # the server holds its own weights: no local copy
    finally:
        server.shutdown()


def test_reward_scoring_overlaps_generation_on_a_server(tmp_path, monkeypatch):
    # each finished request is scored while the later ones still generate; results equal the plain path
    import threading

    from datasets import Dataset

    from hf_verl.trainers.grpo_trainer import GRPOTrainer

    tok = build_char_tokenizer()
    server = RolloutServer(TransformersEngine(_model(tok, seed=1), tok), tok, "tiny", port=0, token=TOKEN).start()
    monkeypatch.setenv("HF_VERL_SERVE_TOKEN", TOKEN)
    calls, served = [], []
    original = server.completions

    def recording(body):  # the server serves one request at a time (generation holds its lock)
        out = original(body)
        served.append(time.perf_counter())
        return out

    server.completions = recording
    try:
        args = _server_grpo_args(tmp_path, server, max_steps=1, per_device_train_batch_size=16,
                                 max_completion_length=12, temperature=0.0)

        def count_a(prompts, completions, **kwargs):
            calls.append((time.perf_counter(), list(prompts), threading.current_thread().name))
            return [float(c.count("a")) for c in completions]

        prompts = ["abc", "xyz", "aaa", "bab"]
        rows = [{"prompt": p} for p in prompts for _ in range(4)]
        trainer = GRPOTrainer(model=_model(tok, seed=0), reward_funcs=count_a, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": prompts}))
        trainer.engine.prompts_per_request, trainer.engine.max_concurrency = 5, 4  # -> 4 requests of one group
        streamed = trainer._collect(rows, trainer.engine)
        assert [len(c[1]) for c in calls] == [4, 4, 4, 4]  # whole groups per reward call
        assert all(len(set(c[1])) == 1 for c in calls)
        assert calls[0][0] < max(served)  # the first request was scored before the last was generated
        calls.clear()
        from hf_verl.pipeline import generation

        batch = generation.generate(trainer.engine, [tok(r["prompt"])["input_ids"] for r in rows],
                                    [r["prompt"] for r in rows], trainer._sampling_params(), tok, trainer.args.device)
        plain = generation.score(trainer.reward_funcs, batch, generation.row_columns(rows))
        assert len(calls) == 1 and torch.equal(streamed.rewards_per_func, plain)
        assert streamed.batch.meta["prompts"] == [r["prompt"] for r in rows]
    finally:
        server.shutdown()


# ---------------------------------------------------------------------- as OpenAI clients see it
def _client(server):
    openai = pytest.importorskip("openai")
    return openai, openai.OpenAI(base_url=f"{server.address}/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_openai_client_streams_and_gets_the_same_completion(served):
    server, tok, model = served
    openai, client = _client(server)
    whole = client.completions.create(model="tiny", prompt=["abc", "hello"], max_tokens=5, temperature=0, logprobs=1)
    assert [c.index for c in whole.choices] == [0, 1] and all(c.text is not None for c in whole.choices)
    chunks = list(client.completions.create(model="tiny", prompt=["abc", "hello"], max_tokens=5, temperature=0,
                                            stream=True))
    streamed = {}
    for chunk in chunks:  # a chunk per choice per token, each with its choice; no usage unless asked
        assert len(chunk.choices) == 1 and chunk.usage is None
        streamed[chunk.choices[0].index] = streamed.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert streamed == {c.index: c.text for c in whole.choices}  # greedy: the same text, served as events
    assert len(chunks) == whole.usage.completion_tokens
    chunks = list(client.completions.create(model="tiny", prompt=["abc", "hello"], max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_an_unknown_model_is_404_and_served_names_are_configurable(served):
    server, tok, model = served
    openai, client = _client(server)
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.completions.create(model="gpt-4", prompt="abc", max_tokens=2)
    other = RolloutServer(TransformersEngine(model, tok), tok, "tiny", port=0, served_model_names=["a", "b"]).start()
    try:
        _, client = _client(other)
        assert [m.id for m in client.models.list().data] == ["a", "b"]
        assert client.completions.create(model="b", prompt="abc", max_tokens=2, temperature=0).choices
    finally:
        other.shutdown()


def test_requests_beyond_the_caps_are_refused_naming_the_cap(served):
    server, tok, model = served
    openai, client = _client(server)
    with pytest.raises(openai.BadRequestError, match="n=100000 exceeds this server's cap of 64"):
        client.completions.create(model="tiny", prompt="abc", max_tokens=2, n=100000)
    with pytest.raises(openai.BadRequestError, match="max_tokens=100000 exceeds this server's cap of 8192"):
        client.completions.create(model="tiny", prompt="abc", max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="2000 prompts exceed this server's cap of 1024"):
        client.completions.create(model="tiny", prompt=["a"] * 2000, max_tokens=2)


def test_bad_weight_uploads_are_4xx_with_the_reason_and_keep_the_weights(served, tmp_path):
    import http.client
    import json as _json
    from urllib.parse import urlparse

    server, tok, model = served
    before = {k: v.clone() for k, v in model.state_dict().items()}
    not_weights = tmp_path / "notes.safetensors"
    not_weights.write_text("these are not weights")
    address = urlparse(server.address)

    def post(path, body, content_type):
        conn = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {TOKEN}",
                                                       "Content-Type": content_type})
        response = conn.getresponse()
        # an error closes the connection, and says so: a pooling client must not reuse the socket
        assert response.getheader("Connection") == "close"
        return response.status, _json.loads(response.read())["error"]["message"]

    status, message = post("/v1/weights", _json.dumps({"path": str(not_weights)}), "application/json")
    assert status == 400 and "is not a readable safetensors file" in message
    status, message = post("/v1/weights?update=u1&index=0&last=1", b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage",
                           "application/octet-stream")
    assert status == 400 and "not a safetensors bucket" in message
    status, message = post("/v1/weights", _json.dumps({"path": 42}), "application/json")
    assert status == 400 and "'path' must be a string" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert server.engine.weight_version == 0
