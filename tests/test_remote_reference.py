"""A KL reference behind a URL: `hf-verl serve` answers `echo` / `prompt_logprobs` as vLLM does, and the facade's
`placement={"reference": URL}` reads it, equal to the same reference run locally (same tokenizer, and another one
through the cross-tokenizer alignment); a server that is down or answers garbage fails naming the role and URL."""

import http.server
import json
import threading

import openai
import pytest
import torch

from hf_verl.engine.step import LogProbs
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.engine.remote_reference import (
    ReferenceServerError,
    RemoteReference,
    completions_endpoint,
)
from hf_verl.serve.server import RolloutServer
from tests.conftest import build_bpe_tokenizer, build_char_tokenizer
from tests.test_facade import count_a, tiny_llama


def _serve(model, tok):
    return RolloutServer(TransformersEngine(model, tok), tok, "ref", port=0).start()


@pytest.fixture
def served():
    tok = build_char_tokenizer()
    model = tiny_llama(tok, seed=2).eval()
    server = _serve(model, tok)
    yield server, tok, model
    server.shutdown()


def _local_logprobs(model, ids, temperature=1.0):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def _client(server):
    return openai.OpenAI(base_url=f"{server.address}/v1", api_key="none", max_retries=0)


# ---------------------------------------------------------------------- the server: echo and prompt_logprobs
def test_echo_with_max_tokens_0_scores_the_prompt_as_vllm_answers(served):
    server, tok, model = served
    ids = tok("hello world")["input_ids"]
    answer = _client(server).completions.create(model="ref", prompt=ids, echo=True, max_tokens=0, logprobs=0,
                                                temperature=0.7)
    choice = answer.choices[0]
    assert choice.text == "hello world" and choice.finish_reason == "length"
    lps = choice.logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(ids) and choice.logprobs.tokens == tok.convert_ids_to_tokens(ids)
    torch.testing.assert_close(torch.tensor(lps[1:]), _local_logprobs(model, ids, 0.7), rtol=0, atol=1e-5)
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(ids)
    assert choice.model_extra["prompt_logprobs_temperature"] == 0.7 and choice.model_extra["token_ids"] == []


def test_echo_with_generation_puts_the_prompt_before_the_completion(served):
    server, tok, model = served
    plain = _client(server).completions.create(model="ref", prompt="abc", max_tokens=4, temperature=0, logprobs=1)
    echoed = _client(server).completions.create(model="ref", prompt="abc", max_tokens=4, temperature=0, logprobs=1,
                                                echo=True)
    a, b = plain.choices[0], echoed.choices[0]
    assert b.text == "abc" + a.text
    assert b.logprobs.token_logprobs[:1] == [None] and b.logprobs.token_logprobs[3:] == a.logprobs.token_logprobs
    assert b.logprobs.tokens == ["a", "b", "c"] + a.logprobs.tokens
    torch.testing.assert_close(torch.tensor(b.logprobs.token_logprobs[1:3]),
                               _local_logprobs(model, tok("abc")["input_ids"]), rtol=0, atol=1e-5)


def test_prompt_logprobs_give_each_prompt_token_its_rank_and_the_top_k(served):
    server, tok, model = served
    ids = tok("abcd")["input_ids"]
    answer = _client(server).completions.create(model="ref", prompt=ids, max_tokens=1, temperature=0,
                                                extra_body={"prompt_logprobs": 2})
    field = answer.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    for t, entry in enumerate(field[1:]):
        own = entry[str(ids[t + 1])]
        assert own["logprob"] == pytest.approx(logp[t, ids[t + 1]].item(), abs=1e-5)
        assert own["rank"] == int((logp[t] > logp[t, ids[t + 1]]).sum()) + 1
        assert own["decoded_token"] == tok.decode([ids[t + 1]])
        best = logp[t].topk(2).indices.tolist()
        assert {str(i) for i in best} <= set(entry) and entry[str(best[0])]["rank"] == 1
        assert len(entry) in (2, 3)  # the top 2, and the prompt token when it is not among them


@pytest.mark.parametrize("fields, message", [
    ({"echo": True, "stream": True}, "echo and prompt_logprobs are not supported with stream=true"),
    ({"max_tokens": 0}, "max_tokens=0 generates nothing: it is allowed only with echo=true"),
    ({"prompt_logprobs": 21}, "'prompt_logprobs'"),
])
def test_bad_scoring_requests_are_400_naming_the_field(served, fields, message):
    server, _, _ = served
    body = {"model": "ref", "prompt": "abc", "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError, match=message):
        _client(server).completions.create(**{k: body.pop(k) for k in ("model", "prompt", "max_tokens")},
                                           extra_body=body)


# ---------------------------------------------------------------------- the client
def test_remote_reference_equals_the_local_reference_engine(served):
    """The same rollout scored by the reference's own engine (a local reference) and through the server."""
    from hf_verl import Trainer

    server, tok, model = served
    config = dict(group_size=2, max_new_tokens=5, seed=0, use_async_rollout=False, beta=0.1, temperature=0.8)
    trainer = Trainer(actor_model=tiny_llama(tok), reference_model=tiny_llama(tok, seed=2), reward_model=count_a,
                      tokenizer=tok, config=config)
    out = trainer.rollout(["abc=", "hello", "xy"])
    remote = RemoteReference(f"{server.address}/v1", rows_per_request=2)
    got = remote.infer(out, LogProbs(temperature=0.8)).logp
    assert got.shape == out.ref_logprobs.shape and out.completion_mask.sum() > 6
    torch.testing.assert_close(got * out.completion_mask, out.ref_logprobs * out.completion_mask, rtol=0, atol=1e-5)


def test_facade_reference_behind_a_url_equals_the_local_one(served):
    from hf_verl import Trainer

    server, tok, _ = served
    config = dict(group_size=2, max_new_tokens=5, seed=0, use_async_rollout=False, beta=0.1,
                  per_row_sampling_seed=True)
    local = Trainer(actor_model=tiny_llama(tok), reference_model=tiny_llama(tok, seed=2), reward_model=count_a,
                    tokenizer=tok, config=config)
    remote = Trainer(actor_model=tiny_llama(tok), reward_model=count_a, tokenizer=tok, config=config,
                     placement={"reference": f"{server.address}/v1"})
    want, got = local.rollout(["abc=", "hello"]), remote.rollout(["abc=", "hello"])
    assert torch.equal(want.completion_ids, got.completion_ids)
    torch.testing.assert_close(got.ref_logprobs, want.ref_logprobs, rtol=0, atol=1e-5)
    assert remote.placement()[1] == (f"reference: backend=server where={server.address}/v1/completions "
                                     "layout=remote memory=n/a (remote)")
    a, b = local.step(local.compute_loss(want)), remote.step(remote.compute_loss(got))
    assert b["kl"] == pytest.approx(a["kl"], abs=1e-5) and b["kl"] > 0


def test_facade_reference_behind_a_url_on_another_tokenizer():
    """A served reference with a BPE tokenizer beside a character-level actor: aligned by character offsets, equal
    to the same reference run locally with `reference_tokenizer=`."""
    from hf_verl import Trainer

    char, bpe = build_char_tokenizer(), build_bpe_tokenizer()
    server = _serve(tiny_llama(bpe, seed=1).eval(), bpe)
    try:
        config = dict(group_size=2, max_new_tokens=5, seed=0, use_async_rollout=False, beta=0.1,
                      per_row_sampling_seed=True)
        local = Trainer(actor_model=tiny_llama(char), reference_model=tiny_llama(bpe, seed=1), reward_model=count_a,
                        tokenizer=char, reference_tokenizer=bpe, config=config)
        remote = Trainer(actor_model=tiny_llama(char), reward_model=count_a, tokenizer=char, reference_tokenizer=bpe,
                         config=config, placement={"reference": server.address})
        want, got = local.rollout(["the ", "hello "]), remote.rollout(["the ", "hello "])
        assert torch.equal(want.completion_ids, got.completion_ids)
        torch.testing.assert_close(got.ref_logprobs, want.ref_logprobs, rtol=0, atol=1e-5)
        assert remote.placement()[1].endswith("layout=remote (cross-tokenizer) memory=n/a (remote)")
    finally:
        server.shutdown()


# ---------------------------------------------------------------------- failures name the role and the URL
class _Scripted(http.server.BaseHTTPRequestHandler):
    """A real HTTP server answering every POST with one scripted (status, body)."""

    answer: tuple = (200, b"")

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        status, payload = type(self).answer
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
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _choice(lps, temperature=0.5, **extra):
    said = {} if temperature is None else {"prompt_logprobs_temperature": temperature}  # vLLM does not say
    return {"index": 0, "text": "", "logprobs": {"tokens": [], "token_logprobs": lps}, **said, **extra}


@pytest.mark.parametrize("payload, message", [
    (b"<html>oops</html>", "answered garbage \\(not JSON\\)"),
    ({"choices": []}, "0 choices for 1 sequences"),
    ({"choices": [_choice([None, -1.0])]}, "2 token_logprobs for 3 tokens \\(echo unsupported\\?\\)"),
    ({"choices": [_choice([None, -1.0, float("nan")])]}, "not finite numbers"),
    ({"choices": [_choice([None, -1.0, -2.0], prompt_token_ids=[9, 9, 9])]}, "scored other tokens"),
    ({"choices": [_choice([None, -1.0, -2.0], temperature=None)]}, "at temperature 1.0 but the run scores at 0.5"),
])
def test_garbage_fails_naming_the_role_and_url(scripted, payload, message):
    _Scripted.answer = (200, payload)
    remote = RemoteReference(f"{scripted}/v1", max_retries=0)
    with pytest.raises(ReferenceServerError, match=rf"reference at {scripted}/v1/completions .*{message}"):
        remote.score([[5, 6, 7]], temperature=0.5)


def test_a_reference_server_that_is_down_fails_the_step_naming_the_role_and_url():
    from hf_verl import Trainer
    from tests.test_reward_server import _free_port

    tok = build_char_tokenizer()
    url = f"http://127.0.0.1:{_free_port()}/v1"
    trainer = Trainer(actor_model=tiny_llama(tok), reward_model=count_a, tokenizer=tok, placement={"reference": url},
                      config=dict(group_size=2, max_new_tokens=2, seed=0, use_async_rollout=False, beta=0.1))
    trainer.roles.remote_reference.max_retries, trainer.roles.remote_reference.backoff_s = 1, 0.01
    with pytest.raises(ReferenceServerError, match=rf"reference at {url}/completions is unreachable after 2 "
                                                   r"attempts .*hf-verl serve"):
        trainer.rollout(["abc"])


def test_endpoint_and_construction_checks():
    from hf_verl import Trainer

    assert completions_endpoint("http://h:1") == "http://h:1/v1/completions"
    assert completions_endpoint("http://h:1/v1/") == "http://h:1/v1/completions"
    assert completions_endpoint("http://h:1/v1/completions") == "http://h:1/v1/completions"
    with pytest.raises(ValueError, match="must look like http://127.0.0.1:8000/v1"):
        completions_endpoint("h:1/v1")
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"placement\['reference'\] = 'http://h:1/v1' is a server.*drop "
                                         "reference_model="):
        Trainer(actor_model=tiny_llama(tok), reference_model=tiny_llama(tok), reward_model=count_a, tokenizer=tok,
                placement={"reference": "http://h:1/v1"})
    with pytest.raises(TypeError, match="only scores tokens"):
        RemoteReference("http://h:1").infer(None, LogProbs(with_entropy=True))


# ---------------------------------------------------------------------- vLLM's own server behind the URL
@pytest.mark.slow
@pytest.mark.optional_backend
def test_a_vllm_server_serves_the_reference(tmp_path):
    """A real `vllm serve` (OpenAI server) answers the client's echo request: the reference's log-probs equal the
    local model's (vLLM's float32 CPU kernels: 1e-3, as tests/test_vllm_engine.py compares them); at another
    temperature it says nothing of one, so the client refuses rather than read raw log-probs."""
    import sys

    from tests.test_vllm_engine import _server_process

    def argv(model_dir, port):
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
                "--port", str(port), "--dtype", "float32", "--max-model-len", "64", "--enforce-eager",
                "--gpu-memory-utilization", "0.25"]

    with _server_process(tmp_path, argv, {}) as (tok, model, url):
        remote = RemoteReference(f"{url}/v1", max_retries=40, backoff_s=1.0, timeout_s=120)
        sequences = [tok(text)["input_ids"] for text in ("hello world", "abc=cba", "xy")]
        scores = remote.score(sequences)
        for ids, got in zip(sequences, scores):
            torch.testing.assert_close(torch.tensor(got), _local_logprobs(model, ids), rtol=0, atol=1e-3)
        with pytest.raises(ReferenceServerError, match="at temperature 1.0 but the run scores at 0.5"):
            remote.score(sequences[:1], temperature=0.5)
