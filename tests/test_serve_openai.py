"""`hf-verl serve` as OpenAI clients see it (the `openai` package): completions, chat completions, token-level
streaming, request validation, the OpenAPI page, request batching, and hostile weight uploads.

Every expected value comes from a local TransformersEngine on a copy of the served model (greedy, or seeded).
"""

import copy
import http.client
import json
import os
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import torch

from hf_verl.rollout.base import GenerationOutput, SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.serve.batching import RequestBatcher
from hf_verl.serve.server import RolloutServer
from tests.conftest import build_char_tokenizer
from tests.test_serve import TOKEN, _model

openai = pytest.importorskip("openai")


def _serve(tok=None, model=None, **kwargs):
    """A started server of `model` (a fresh tiny Llama by default) with the test token."""
    tok = tok or build_char_tokenizer()
    model = model or _model(tok)
    return RolloutServer(TransformersEngine(model, tok), tok, "tiny", port=0, token=TOKEN, **kwargs).start(), tok, model


@pytest.fixture(scope="module")
def served():
    started = _serve()
    yield started
    started[0].shutdown()


def _client(server):
    return openai.OpenAI(base_url=f"{server.address}/v1", api_key="unused", max_retries=0, timeout=60)


def _local(model, tok, prompts, **sampling):
    """What the engine itself generates for `prompts` (text) on a copy of the served model."""
    ids = [tok(p)["input_ids"] for p in prompts]
    return TransformersEngine(copy.deepcopy(model), tok).generate(ids, SamplingParams(**sampling))


def _joined(chunks):
    """Text per choice index from completion chunks, and the chunks' finish reasons per index."""
    text, reasons = {}, {}
    for chunk in chunks:
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        text[choice.index] = text.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            assert choice.index not in reasons  # once per choice, on its last chunk
            reasons[choice.index] = choice.finish_reason
    return text, reasons


# ---------------------------------------------------------------------- completions
def test_completions_of_a_list_of_prompts_equal_the_engine_with_logprobs(served):
    server, tok, model = served
    prompts = ["abc", "hello", "xy"]
    out = _client(server).completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, logprobs=1)
    want = _local(model, tok, prompts, max_new_tokens=6, temperature=0.0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice, ids, lps, reason in zip(out.choices, want.completion_ids, want.logprobs, want.finish_reasons):
        assert choice.text == tok.decode(ids, skip_special_tokens=True) and choice.finish_reason == reason
        assert choice.model_extra["token_ids"] == ids
        assert choice.logprobs.tokens == tok.convert_ids_to_tokens(ids)
        assert choice.logprobs.token_logprobs == pytest.approx(lps, abs=1e-5)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert out.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)
    assert out.usage.completion_tokens == sum(len(ids) for ids in want.completion_ids)
    assert out.model_extra["weight_version"] == 0


def test_n_choices_per_prompt_are_prompt_major_and_seeded_reproducibly(served):
    server, tok, model = served
    client = _client(server)
    ask = {"model": "tiny", "prompt": ["abc", "xy"], "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 7}
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    assert len(first.choices) == 6
    prompts = [c.model_extra["prompt_token_ids"] for c in first.choices]
    assert prompts == [tok("abc")["input_ids"]] * 3 + [tok("xy")["input_ids"]] * 3
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]  # a seeded request is generated alone
    rows = [tok(p)["input_ids"] for p in ("abc", "xy") for _ in range(3)]
    want = TransformersEngine(copy.deepcopy(model), tok).generate(
        rows, SamplingParams(max_new_tokens=5, temperature=1.0, seed=7))
    assert ids == want.completion_ids
    assert len({tuple(i) for i in ids}) > 1  # sampled: the choices of a prompt differ


def test_a_stop_string_ends_the_choice_keeping_it(served):
    server, _, _ = served
    client = _client(server)
    full = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0).choices[0].text
    stop = full[2]
    want = full[: full.index(stop) + 1]
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, stop=[stop])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    text, reasons = _joined(client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0,
                                                       stop=stop, stream=True))
    assert text == {0: want} and reasons == {0: "stop"}


def test_streaming_is_token_by_token_with_usage_only_when_asked(served):
    server, _, _ = served
    client = _client(server)
    ask = {"model": "tiny", "prompt": ["abc", "hello"], "n": 2, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True))
    assert all(chunk.usage is None for chunk in chunks)
    text, reasons = _joined(chunks)
    assert text == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert len(chunks) == whole.usage.completion_tokens  # one chunk per generated token
    for choice in whole.choices:  # each chunk carries its token and log-prob
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert [t for c in mine for t in c.model_extra["token_ids"]] == choice.model_extra["token_ids"]
        assert [lp for c in mine for lp in c.logprobs.token_logprobs] == pytest.approx(
            choice.logprobs.token_logprobs, abs=1e-5)
        assert mine[0].model_extra["prompt_token_ids"] == choice.model_extra["prompt_token_ids"]
    with_usage = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert all(c.choices for c in with_usage[:-1]) and with_usage[-1].choices == []
    assert with_usage[-1].usage.model_dump() == whole.usage.model_dump()


def test_an_engine_that_cannot_step_streams_whole_completions_as_token_chunks():
    tok = build_char_tokenizer()
    model = _model(tok)
    server = RolloutServer(TransformersEngine(model, tok, use_generate=True), tok, "tiny", port=0).start()
    try:
        client = _client(server)
        ask = {"model": "tiny", "prompt": ["abc", "hello"], "max_tokens": 5, "temperature": 0, "logprobs": 1}
        whole = client.completions.create(**ask)
        chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        text, reasons = _joined(chunks[:-1])
        assert text == {c.index: c.text for c in whole.choices}
        assert reasons == {c.index: c.finish_reason for c in whole.choices}
        assert len(chunks) - 1 == whole.usage.completion_tokens and chunks[-1].usage.model_dump() == \
            whole.usage.model_dump()
    finally:
        server.shutdown()


def test_stream_events_on_the_wire_end_with_done(served):
    server, _, _ = served
    address = urlparse(server.address)
    conn = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "ab", "max_tokens": 3, "temperature": 0,
                                                         "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert len(events) == 4 and all(json.loads(e[6:])["choices"] for e in events[:-1])


def test_an_unknown_model_is_a_404(served):
    server, _, _ = served
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        _client(server).completions.create(model="gpt-4", prompt="abc", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        _client(server).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def test_concurrent_clients_get_their_own_completions(served):
    server, tok, model = served
    prompts = ["abc", "hello", "xy", "ab", "qq", "zzz", "a b", "count"]
    want = _local(model, tok, prompts, max_new_tokens=6, temperature=0.0).completion_ids
    got, streamed, errors = {}, {}, []

    def ask(i):
        try:
            client = _client(server)
            if i % 4 == 3:  # a quarter stream, beside the others
                text, _ = _joined(client.completions.create(model="tiny", prompt=prompts[i], max_tokens=6,
                                                            temperature=0, stream=True))
                streamed[i] = text[0]
            else:
                out = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=6, temperature=0)
                got[i] = out.choices[0].model_extra["token_ids"]
        except Exception as err:  # noqa: BLE001 (reported by the test)
            errors.append(err)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert got == {i: want[i] for i in got} and len(got) == 6
    assert streamed == {i: tok.decode(want[i], skip_special_tokens=True) for i in streamed} and len(streamed) == 2


# ---------------------------------------------------------------------- chat completions
def test_chat_completions_apply_the_chat_template(served):
    server, tok, model = served
    client = _client(server)
    messages = [{"role": "system", "content": "be short"}, {"role": "user", "content": "hello"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    want = TransformersEngine(copy.deepcopy(model), tok).generate([ids], SamplingParams(max_new_tokens=6,
                                                                                       temperature=0.0))
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == tok.decode(want.completion_ids[0], skip_special_tokens=True)
    assert choice.model_extra["token_ids"] == want.completion_ids[0]
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(want.logprobs[0], abs=1e-5)
    assert out.usage.prompt_tokens == len(ids)
    # the same as a completion of the rendered prompt
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0).choices[0].text == \
        choice.message.content
    # text parts are joined as text
    parts = [{"role": "system", "content": "be short"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert client.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0) \
        .choices[0].message.content == choice.message.content


def test_chat_streams_deltas_with_usage_when_asked(served):
    server, _, _ = served
    client = _client(server)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 5, "temperature": 0, "n": 2}
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    text, roles = {}, {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and len(chunk.choices) == 1
        choice = chunk.choices[0]
        roles.setdefault(choice.index, choice.delta.role)
        text[choice.index] = text.get(choice.index, "") + choice.delta.content
    assert roles == {0: "assistant", 1: "assistant"}
    assert text == {c.index: c.message.content for c in whole.choices}


def test_a_tokenizer_without_a_chat_template_is_a_clear_400():
    tok = build_char_tokenizer()
    tok.chat_template = None
    server, _, _ = _serve(tok)
    try:
        with pytest.raises(openai.BadRequestError, match="has no chat template.*/v1/completions"):
            _client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    finally:
        server.shutdown()


# ---------------------------------------------------------------------- bad requests
@pytest.mark.parametrize("fields, message", [
    ({"n": 0}, "'n': Input should be greater than or equal to 1"),
    ({"temperature": "hot"}, "'temperature'"),
    ({"top_p": 0}, "'top_p'"),
    ({"max_tokens": 100000}, "max_tokens=100000 exceeds this server's cap of 8192"),
    ({"prompt": [[-1]]}, "'prompt': each prompt must be"),
    ({"prompt": [10_000]}, "prompt token ids must be below the vocabulary size"),
    ({"prompt": ""}, "'prompt'"),
    ({"stop": [""]}, "'stop'"),
    ({"echo": True, "stream": True}, "echo and prompt_logprobs are not supported with stream=true"),
    ({"max_tokens": 0}, "max_tokens=0 generates nothing: it is allowed only with echo=true"),
    ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
])
def test_malformed_completions_are_400_naming_the_field(served, fields, message):
    server, _, _ = served
    ask = {"model": "tiny", "prompt": "abc", "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError, match=message):
        _client(server).completions.create(**ask)


def test_malformed_bodies_and_chat_requests_are_400(served):
    server, _, _ = served
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="'messages'"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="no images"):
        client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])
    address = urlparse(server.address)
    for body, message in [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                          (b"{}", "'prompt' is required")]:
        conn = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 400 and message in json.loads(response.read())["error"]["message"]


def test_an_oversized_request_body_is_a_413():
    server, _, _ = _serve(max_request_bytes=1000)
    try:
        with pytest.raises(openai.APIStatusError) as err:
            _client(server).completions.create(model="tiny", prompt="a" * 5000, max_tokens=2)
        assert err.value.status_code == 413 and "limit of 1000 bytes" in err.value.message
    finally:
        server.shutdown()


def test_the_openapi_page(served):
    import urllib.request

    server, _, _ = served
    schema = json.loads(urllib.request.urlopen(f"{server.address}/openapi.json").read())
    assert {"/v1/completions", "/v1/chat/completions", "/v1/weights", "/v1/models", "/health"} <= set(schema["paths"])
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "n", "max_tokens", "stream", "stream_options", "logprobs"} <= set(fields)
    assert "application/octet-stream" in schema["paths"]["/v1/weights"]["post"]["requestBody"]["content"]
    page = urllib.request.urlopen(f"{server.address}/docs")
    assert page.status == 200 and "swagger" in page.read().decode().lower()


# ---------------------------------------------------------------------- weight uploads
def _post(server, path, body, content_type="application/octet-stream", **headers):
    address = urlparse(server.address)
    conn = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type,
                                                   **headers})
    response = conn.getresponse()
    return response.status, response.read().decode()


def test_hostile_weight_uploads_are_4xx_and_the_old_weights_keep_serving(tmp_path):
    from safetensors.torch import save

    server, _, model = _serve()
    client = _client(server)
    ask = {"model": "tiny", "prompt": ["abc", "hello"], "max_tokens": 6, "temperature": 0, "logprobs": 1}

    def outputs():
        out = client.completions.create(**ask)
        return [(c.model_extra["token_ids"], c.logprobs.token_logprobs) for c in out.choices]

    try:
        before = outputs()
        norm = model.model.norm.weight
        good = save({"model.norm.weight": torch.zeros_like(norm)})
        bucket = "/v1/weights?update=u1&index=0&last=1"
        rng = torch.Generator().manual_seed(0)
        hostile = [(bucket, os.urandom(4096), "not a safetensors bucket") for _ in range(8)]
        hostile += [
            (bucket, b"", "not a safetensors bucket"),
            (bucket, save({"not.a.weight": torch.zeros(3)}), "unknown parameter name"),
            (bucket, save({"model.norm.weight": torch.zeros(norm.numel() + 1)}), "shape mismatch"),
            (bucket, save({"model.norm.weight": torch.zeros(norm.shape, dtype=torch.int32)}), "non-floating"),
            (bucket, good[: len(good) // 2], "not a safetensors bucket"),  # a truncated file
            (bucket, good[:8] + b"x" + good[9:], "not a safetensors bucket"),  # a broken header
            ("/v1/weights", good, "update=<id>"),
            ("/v1/weights?update=u1&index=-1&last=1", good, "index must be"),
            ("/v1/weights?update=u1&index=x&last=1", good, "index must be"),
            ("/v1/weights?update=u1&index=0&last=2", good, "last must be"),
            ("/v1/weights?update=../etc&index=0&last=1", good, "update must be"),
        ]
        for path, body, message in hostile:
            status, answer = _post(server, path, body)
            assert 400 <= status < 500 and message in json.loads(answer)["error"]["message"], (path, status, answer)
        for _ in range(20):  # random bytes in the header of a real bucket
            mutated = bytearray(good)
            i = int(torch.randint(8, 8 + int.from_bytes(good[:8], "little"), (1,), generator=rng))
            mutated[i] = int(torch.randint(0, 256, (1,), generator=rng))
            status, answer = _post(server, bucket, bytes(mutated))
            assert status < 500, answer
        for body, message in [(b"\xff\xfe", "not JSON"), (b'{"nopath": 1}', '{"path": ...}'),
                              (json.dumps({"path": str(tmp_path / "missing")}).encode(), "no safetensors file")]:
            status, answer = _post(server, "/v1/weights", body, "application/json")
            assert status == 400 and message in json.loads(answer)["error"]["message"]
        # a body over the limit, without a length, and cut off by a client that goes away
        status, answer = _post(server, bucket, b"x", **{"Content-Length": str(3 * 2**30)})
        assert status == 413 and "exceeds the limit" in answer
        address = urlparse(server.address)
        conn = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        conn.request("POST", bucket, body=iter([good]), encode_chunked=True,
                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/octet-stream"})
        assert conn.getresponse().status == 411
        with socket.create_connection((address.hostname, address.port)) as sock:
            sock.sendall(f"POST {bucket} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: "
                         f"application/octet-stream\r\nContent-Length: {len(good)}\r\n\r\n".encode() + good[:20])
        # a valid first bucket whose update ends with a hostile one
        assert json.loads(_post(server, "/v1/weights?update=u9&index=0&last=0", good)[1])["applied"] is False
        assert _post(server, "/v1/weights?update=u9&index=1&last=1", os.urandom(512))[0] == 400
        time.sleep(0.2)
        assert server.engine.weight_version == 0 and torch.count_nonzero(model.model.norm.weight) > 0
        assert outputs() == before
        # and the server still takes a real update
        status, answer = _post(server, "/v1/weights?update=ok&index=0&last=1", good)
        assert status == 200 and json.loads(answer)["weight_version"] == 1
        assert torch.count_nonzero(model.model.norm.weight) == 0 and outputs() != before
    finally:
        server.shutdown()


def test_a_client_that_leaves_a_stream_frees_the_engine():
    tok = build_char_tokenizer()
    model = _model(tok)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 0.0  # greedy never ends on EOS: only max_tokens or the client
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    server, _, _ = _serve(tok, model)
    try:
        stream = _client(server).completions.create(model="tiny", prompt="abc", max_tokens=5000, temperature=0,
                                                    stream=True)
        assert next(iter(stream)).choices[0].text
        stream.close()
        deadline = time.monotonic() + 60
        while server.lock.locked() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.lock.locked() and len(forwards) < 5000  # stopped early, not at max_tokens
        out = _client(server).completions.create(model="tiny", prompt="abc", max_tokens=2, temperature=0)
        assert len(out.choices[0].model_extra["token_ids"]) == 2
    finally:
        server.shutdown()


# ---------------------------------------------------------------------- request batching
class _GatedEngine:
    """Records each generate call; the first one waits until released, so that others queue meanwhile."""

    def __init__(self):
        self.calls, self.gate, self.weight_version = [], threading.Event(), 0

    def generate(self, prompts, sampling):
        self.calls.append((list(prompts), sampling))
        if len(self.calls) == 1:
            self.gate.wait(30)
        return GenerationOutput(completion_ids=[[p[0], 9] for p in prompts], logprobs=[[-1.0, -2.0] for _ in prompts],
                                finish_reasons=["length"] * len(prompts), weight_version=len(self.calls))


def test_queued_requests_that_sample_alike_share_one_engine_call():
    engine = _GatedEngine()
    batcher = RequestBatcher(engine, threading.Lock(), max_rows=4)
    greedy, hot = SamplingParams(max_new_tokens=2, temperature=0.0), SamplingParams(max_new_tokens=2)
    seeded = SamplingParams(max_new_tokens=2, temperature=0.0, seed=1)
    jobs = [([[1]], greedy), ([[2], [3]], greedy), ([[4]], hot), ([[5]], greedy), ([[6]], seeded), ([[7], [8]], greedy)]
    results = {}

    def run(i):
        results[i] = batcher.generate(*jobs[i])

    threads = [threading.Thread(target=run, args=(0,))]
    threads[0].start()
    while not engine.calls:
        time.sleep(0.01)
    for i in range(1, len(jobs)):  # queued in order while the first call runs
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        while len(batcher._queue) < i:
            time.sleep(0.01)
    engine.gate.set()
    for t in threads:
        t.join(timeout=30)
    batcher.close()
    # greedy jobs 1 and 3 together (jobs 5 would exceed 4 rows), then the sampled one, the seeded one alone, job 5
    assert [c[0] for c in engine.calls] == [[[1]], [[2], [3], [5]], [[4]], [[6]], [[7], [8]]]
    assert {i: r.completion_ids for i, r in results.items()} == {
        0: [[1, 9]], 1: [[2, 9], [3, 9]], 2: [[4, 9]], 3: [[5, 9]], 4: [[6, 9]], 5: [[7, 9], [8, 9]]}
    assert results[1].weight_version == results[3].weight_version == 2


# ---------------------------------------------------------------------- incremental text
def test_streamed_text_pieces_join_to_the_whole_decode():
    from hf_verl.serve.streaming import IncrementalText
    from tests.conftest import build_bpe_tokenizer

    tok = build_bpe_tokenizer()  # byte-level: a token can hold part of a character
    generator = torch.Generator().manual_seed(0)
    held = 0
    for _ in range(200):
        ids = torch.randint(0, len(tok), (16,), generator=generator).tolist()
        text = IncrementalText(tok)
        pieces = [text.push(i) for i in ids]
        assert all("\ufffd" not in p[-1:] for p in pieces)  # an incomplete character is held back
        held += sum(p == "" for p in pieces)
        assert "".join(pieces) + text.flush() == tok.decode(ids, skip_special_tokens=True)
    assert held > 0
