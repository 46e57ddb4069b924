"""Reward models served on vLLM's `/classify` route (`hf-verl serve`) and scored through a URL, over 127.0.0.1."""

import http.server
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
import torch

from hf_verl.rewards.remote import RemoteRewardModel, RewardServerError, classify_endpoint, parse_scores
from hf_verl.rewards.reward_model import RewardModelScorer, resolve_reward_sources
from hf_verl.serve.classify import ClassifyServer
from tests.conftest import build_char_tokenizer

TEXTS = ["abc", "hello world", "xy", "the answer is 42", "a", "zz top"]


def _reward_model(tok, seed=0, num_labels=1):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    return LlamaForSequenceClassification(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, num_labels=num_labels,
    )).eval()


@pytest.fixture(scope="module")
def served():
    tok = build_char_tokenizer()
    model = _reward_model(tok)
    server = ClassifyServer(model, tok, "tiny-rm", port=0, batch_size=4).start()
    yield server, tok, model
    server.shutdown()


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_scores_equal_the_local_reward_model(served):
    server, tok, model = served
    local = RewardModelScorer(model, tok)
    prompts, completions = [t[:2] for t in TEXTS], [t[2:] for t in TEXTS]
    expected = local(prompts=prompts, completions=completions)
    remote = RemoteRewardModel(server.address, batch_size=4)  # 6 texts: two requests
    got = remote(prompts=prompts, completions=completions, completion_ids=[[0]] * 6)
    assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(round(v, 4) for v in got)) > 1  # the texts score differently
    # the URL resolves to this client as a reward source, the /classify endpoint spelled either way
    (func,) = resolve_reward_sources(server.address)
    assert isinstance(func, RemoteRewardModel) and func.url == f"{server.address}/classify"
    assert RemoteRewardModel(f"{server.address}/v1/classify").score_texts(TEXTS[:2]) == pytest.approx(
        expected[:2], abs=1e-5)


def test_the_answer_has_vllms_classification_shape(served):
    server, tok, model = served
    status, answer = _post(f"{server.address}/classify", {"model": "tiny-rm", "input": TEXTS[:3]})
    assert status == 200
    assert set(answer) == {"id", "object", "created", "model", "data", "usage"}
    assert answer["object"] == "list" and answer["id"].startswith("classify-") and answer["model"] == "tiny-rm"
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    assert all(set(d) == {"index", "label", "probs", "num_classes"} and d["num_classes"] == 1 for d in answer["data"])
    ids = [tok(t)["input_ids"] for t in TEXTS[:3]]
    assert answer["usage"]["prompt_tokens"] == sum(len(i) for i in ids) and answer["usage"]["completion_tokens"] == 0
    # default activation: sigmoid of the one logit, as vLLM's; use_activation=false gives the logit itself
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([i])).logits[0, 0].item() for i in ids]
    assert [d["probs"][0] for d in answer["data"]] == pytest.approx(torch.tensor(logits).sigmoid().tolist(), abs=1e-5)
    status, raw = _post(f"{server.address}/v1/classify", {"input": ids, "use_activation": False})
    assert status == 200 and [d["probs"][0] for d in raw["data"]] == pytest.approx(logits, abs=1e-5)


def test_bad_requests_say_what_is_wrong(served):
    server, tok, _ = served
    status, answer = _post(f"{server.address}/classify", {"model": "other", "input": "abc"})
    assert status == 404 and "tiny-rm" in answer["error"]["message"]
    status, answer = _post(f"{server.address}/classify", {"input": []})
    assert status == 400 and answer["error"]["param"] == "input"
    status, answer = _post(f"{server.address}/classify", {"input": [[len(tok) + 5]]})
    assert status == 400 and "vocabulary size" in answer["error"]["message"]


def test_a_server_that_is_down_fails_naming_the_role_and_url():
    url = f"http://127.0.0.1:{_free_port()}"
    remote = RemoteRewardModel(url, max_retries=2, backoff_s=0.01, timeout_s=2)
    with pytest.raises(RewardServerError, match=rf"reward model at {url}/classify is unreachable after 3 attempts"):
        remote(prompts=["a"], completions=["b"])


class _Scripted(http.server.BaseHTTPRequestHandler):
    """A real HTTP server answering a scripted sequence of (status, body) to POSTs (garbage and failures)."""

    script: list = []
    seen: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        status, payload = type(self).script.pop(0)
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Scripted.script, _Scripted.seen = [], []
    yield f"http://127.0.0.1:{httpd.server_address[1]}", _Scripted
    httpd.shutdown()


def _answer(*scores):
    return {"object": "list", "data": [{"index": i, "label": None, "probs": [s], "num_classes": 1}
                                        for i, s in enumerate(scores)]}


@pytest.mark.parametrize("payload, message", [
    (b"<html>oops</html>", "answered garbage \\(not JSON\\)"),
    ({"data": "nope"}, "no 'data' list"),
    (_answer(1.0), "1 results for 2 texts"),
    ({"data": [{"index": 0, "probs": [0.1, 0.9]}, {"index": 1, "probs": [0.1, 0.9]}]}, "2 labels"),
    ({"data": [{"index": 0, "probs": [1.0]}, {"index": 0, "probs": [2.0]}]}, "repeated"),
])
def test_garbage_fails_naming_the_role_and_url(scripted, payload, message):
    url, handler = scripted
    handler.script = [(200, payload)]
    remote = RemoteRewardModel(url, role="reward", max_retries=0)
    with pytest.raises(RewardServerError, match=rf"reward model at {url}/classify .*{message}"):
        remote.score_texts(["a", "b"])


def test_retries_5xx_then_scores_and_refuses_4xx_at_once(scripted):
    url, handler = scripted
    handler.script = [(503, {"error": "busy"}), (200, {"data": [{"index": 1, "probs": [2.0]},
                                                                {"index": 0, "probs": [-1.0]}]})]
    remote = RemoteRewardModel(url, model="rm", max_retries=2, backoff_s=0.01)
    assert remote.score_texts(["x", "y"]) == [-1.0, 2.0]  # read by index, not by position
    assert handler.seen[-1] == {"input": ["x", "y"], "use_activation": False, "add_special_tokens": False,
                                "model": "rm"}
    handler.script = [(400, {"error": {"message": "bad input"}})]
    with pytest.raises(RewardServerError, match="refused the request: HTTP 400"):
        remote.score_texts(["x"])
    assert handler.script == []


def test_parse_and_endpoint_helpers():
    assert parse_scores(_answer(0.5, -2.0), 2) == [0.5, -2.0]
    with pytest.raises(ValueError, match="not a finite number"):
        parse_scores({"data": [{"index": 0, "probs": [float("nan")]}]}, 1)
    assert classify_endpoint("http://h:1/") == "http://h:1/classify"
    assert classify_endpoint("http://h:1/v1/classify") == "http://h:1/v1/classify"
    with pytest.raises(ValueError, match="must look like http://127.0.0.1:8000"):
        classify_endpoint("ftp://h")


def test_facade_scores_through_a_reward_url(served):
    from hf_verl import Trainer
    from tests.test_facade import tiny_llama

    server, tok, model = served
    trainer = Trainer(actor_model=tiny_llama(tok), reward_model=server.address, tokenizer=tok,
                      config=dict(group_size=2, max_new_tokens=4, seed=0, use_async_rollout=False))
    out = trainer.rollout(["abc=", "hello"])
    local = RewardModelScorer(model, tok)(prompts=out.prompts, completions=out.completions)
    assert out.rewards.tolist() == pytest.approx(local, abs=1e-5)


def test_facade_step_fails_naming_the_reward_url_when_the_server_is_down():
    from hf_verl import Trainer
    from tests.test_facade import tiny_llama

    tok = build_char_tokenizer()
    url = f"http://127.0.0.1:{_free_port()}"
    trainer = Trainer(actor_model=tiny_llama(tok), reward_model=url, tokenizer=tok,
                      config=dict(group_size=2, max_new_tokens=2, seed=0, use_async_rollout=False))
    trainer.reward_funcs[0].max_retries, trainer.reward_funcs[0].backoff_s = 1, 0.01
    with pytest.raises(RewardServerError, match=rf"reward model at {url}/classify is unreachable"):
        trainer.rollout(["abc="])


@pytest.mark.slow
def test_hf_verl_serve_serves_a_saved_reward_model_on_classify(tmp_path):
    import os
    import subprocess
    import sys

    tok = build_char_tokenizer()
    model = _reward_model(tok, seed=3)
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hf_verl", "serve", str(tmp_path / "rm"), "--port", str(port),
                             "--served-model-name", "rm"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    try:
        remote = RemoteRewardModel(f"http://127.0.0.1:{port}", model="rm", max_retries=10, backoff_s=0.5)
        got = remote.score_texts(TEXTS)
        expected = RewardModelScorer(model, tok)(prompts=TEXTS, completions=[""] * len(TEXTS))
        assert got == pytest.approx(expected, abs=1e-5)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0].decode()
    assert "classification server on" in out
