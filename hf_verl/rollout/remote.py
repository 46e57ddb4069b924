"""`RemoteEngine`: a :class:`~hf_verl.rollout.base.RolloutEngine` over an OpenAI-compatible server.

Generation goes to `POST {base_url}/v1/completions` with the prompts as token ids, split into
requests of `prompts_per_request` and sent `max_concurrency` at a time. Token ids come back from
the choice's `token_ids` (hf_verl's server; vLLM with `return_token_ids`) or, failing that, from
`logprobs.tokens` written as `token_id:<n>` (vLLM's `return_tokens_as_token_ids`); log-probs from
`logprobs.token_logprobs`. Connection failures, timeouts and 5xx answers are retried with
exponential backoff up to `max_retries` times; then, or on an answer that is not a completions
response, the error names the URL and what came back.

Weight sync streams (name, tensor) pairs in buckets of `bucket_bytes` as safetensors bodies to
`POST /v1/weights` (hf_verl's server, bearer token), the last one flagged so the server applies
the update atomically. With `backend="vllm"` (a `vllm serve` started with
`VLLM_SERVER_DEV_MODE=1`), the buckets are written as safetensors shards into `shared_dir` (a
folder the server can read), then one `POST /collective_rpc` `reload_weights(weights_path=...)`
reloads them all in place and `POST /reset_prefix_cache` drops cached prefixes.

A server that cannot be reached (every attempt failed, or the connection dropped during an upload) raises
:class:`ServerUnreachable`, a :class:`RolloutServerError`, so that a fleet of servers
(:mod:`hf_verl.rollout.fleet`) can tell a server that is gone from a request that is wrong.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch

from hf_verl.rollout.base import FINISH_LENGTH, FINISH_STOP, GenerationOutput, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)


class RolloutServerError(RuntimeError):
    """The rollout server is unreachable or answered something unusable."""


class ServerUnreachable(RolloutServerError):
    """The rollout server did not answer: every attempt failed (connection errors, timeouts, 5xx), or the
    connection dropped during a weight upload."""


def tensor_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (an oversized tensor alone)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class RequestBatchedEngine(RolloutEngine):
    """An engine that sends rows to servers in requests: `generate` gathers its own `generate_stream` in prompt
    order. Rows of one request share the server's sampler, so per-row sampling seeds cannot be honoured."""

    engine_kind = "a remote engine"  # how the refusal of row seeds names the engine

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 row_seeds: Sequence[int] | None = None) -> GenerationOutput:
        if row_seeds is not None:
            raise NotImplementedError(f"{self.engine_kind} batches rows into requests and cannot seed each row; "
                                      "turn per-row sampling seeds off for server mode.")
        parts = sorted(self.generate_stream(prompt_ids, sampling), key=lambda part: part[0])
        return GenerationOutput.concat([out for _, out in parts])


class RemoteEngine(RequestBatchedEngine):
    """Generate on a remote OpenAI-compatible server (see the module docstring).

    Args:
        base_url (`str`): e.g. `"http://127.0.0.1:8000"`.
        model (`str`, *optional*): the `model` field of requests; default: the server's first model.
        token (`str`, *optional*): bearer token for weight updates.
        timeout_s (`float`, defaults to 120): per request.
        max_retries (`int`, defaults to 3): retries after the first attempt.
        backoff_s (`float`, defaults to 0.5): first retry delay, doubled each time.
        max_concurrency (`int`, defaults to 8): requests in flight.
        prompts_per_request (`int`, defaults to 16).
        bucket_bytes (`int`, defaults to 256 MiB): weight-sync bucket size.
    """

    serves_every_rank = True  # one server for every rank: the main rank sends the weights

    def __init__(self, base_url: str, *, model: str | None = None, token: str | None = None, timeout_s: float = 120.0,
                 max_retries: int = 3, backoff_s: float = 0.5, max_concurrency: int = 8, prompts_per_request: int = 16,
                 bucket_bytes: int = 256 * 2**20, backend: str = "hf_verl", shared_dir: str | None = None) -> None:
        super().__init__()
        if backend not in ("hf_verl", "vllm"):
            raise ValueError(f"backend must be 'hf_verl' or 'vllm', got {backend!r}.")
        self.backend, self.shared_dir = backend, shared_dir
        self.base_url = base_url.rstrip("/")
        self.token, self.timeout_s = token, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.max_concurrency, self.prompts_per_request = max_concurrency, prompts_per_request
        self.bucket_bytes = bucket_bytes
        self._model = model

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json",
                 auth: bool = False, retry: bool = True, timeout_s: float | None = None) -> dict:
        url = f"{self.base_url}{path}"
        headers = {"Content-Type": content_type}
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        attempts = 1 + (self.max_retries if retry else 0)
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(url, data=body, method=method, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as err:
                detail = err.read()[:300].decode(errors="replace")
                if err.code >= 500:
                    last = RolloutServerError(f"{url} answered {err.code}: {detail}")
                    continue
                raise RolloutServerError(f"{url} answered {err.code}: {detail}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
                last = err
                logger.warning("request to %s failed (attempt %d of %d): %s", url, attempt + 1, attempts, err)
                continue
            if not raw.strip():
                return {}
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                raise RolloutServerError(f"{url} did not answer JSON: {raw[:200]!r}") from None
        raise ServerUnreachable(
            f"rollout server at {self.base_url} is unreachable after {attempts} attempt(s): {last}. Start it "
            "(`hf-verl serve MODEL`) or check the URL."
        )

    @property
    def model(self) -> str:
        if self._model is None:
            data = self._request("GET", "/v1/models").get("data") or []
            if not data:
                raise RolloutServerError(f"{self.base_url}/v1/models lists no model.")
            self._model = data[0]["id"]
        return self._model

    @property
    def accepts_adapters(self) -> bool:
        """hf_verl's server takes LoRA adapters inline (`/v1/load_lora_adapter` with a `lora_config`)."""
        return self.backend != "vllm"

    def sync_adapter(self, name: str, config: dict, base: Iterable[tuple[str, torch.Tensor]] | None,
                     adapter: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Adapter-only weight sync: the first time, the base weights (`base`, unmerged) and the adapter's
        creation (`/v1/load_lora_adapter` with `config`); every time, the adapter's tensors (PEFT names) through
        `/v1/weights`. Later requests name the adapter as their `model`."""
        if base is not None:
            self.sync_weights(base)
            url = f"{self.base_url}/v1/load_lora_adapter"
            body = json.dumps({"lora_name": name, "lora_config": config, "load_inplace": True}).encode()
            answer = self._request("POST", "/v1/load_lora_adapter", body, auth=True)
            if answer.get("loaded") != name:
                raise RolloutServerError(f"{url} did not load the adapter: {answer}")
            self._model = name  # requests name the adapter from now on
        self.sync_weights(adapter)

    @property
    def accepts_weight_deltas(self) -> bool:
        """hf_verl's server applies sparse deltas (a vLLM server takes whole tensors only)."""
        return self.backend != "vllm"

    def weight_dtype(self):
        """The served weights' dtype, as the server reports it (`GET /v1/weights/version`; asked once)."""
        if getattr(self, "_weight_dtype", None) is None:
            name = self._request("GET", "/v1/weights/version").get("dtype")
            self._weight_dtype = getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None
        return self._weight_dtype

    def server_weight_version(self, *, retry: bool = True, timeout_s: float | None = None) -> int:
        """The weight version the server reports (`GET /v1/weights/version`); `retry=False` with a short
        `timeout_s` makes it a quick probe of whether the server is up."""
        return int(self._request("GET", "/v1/weights/version", retry=retry, timeout_s=timeout_s)["weight_version"])

    # ------------------------------------------------------------------ generation
    def generate_stream(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                        chunk_rows: int | None = None) -> Iterator[tuple[int, GenerationOutput]]:
        """Generate like :meth:`generate`, yielding `(offset, output)` per request as each one
        completes (in completion order), so the caller can score finished rows while the others are
        still generating. Requests carry `chunk_rows` prompts (default `prompts_per_request`), and
        up to `max_concurrency` are in flight."""
        prompts = check_prompts(prompt_ids)
        size = max(1, chunk_rows or self.prompts_per_request)
        chunks = [(i, prompts[i : i + size]) for i in range(0, len(prompts), size)]
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(chunks))))
        try:
            futures = {pool.submit(self.complete, chunk, sampling): offset for offset, chunk in chunks}
            for future in as_completed(futures):
                yield futures[future], future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def complete(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        """One `/v1/completions` request for `prompts` (token id lists): one completion each, in order.

        Raises:
            ServerUnreachable: every attempt failed.
            RolloutServerError: the server refused the request or answered something unusable.
        """
        body = {"model": self.model, "prompt": [list(map(int, p)) for p in prompts],
                "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k, "repetition_penalty": sampling.repetition_penalty, "logprobs": 1,
                "return_token_ids": True, "return_tokens_as_token_ids": True}
        if sampling.min_p is not None:
            body["min_p"] = sampling.min_p
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if self.record_routing:
            body["return_routed_experts"] = True
        if self.tag_token_versions:
            body["return_token_weight_versions"] = True
        resp = self._request("POST", "/v1/completions", json.dumps(body).encode())
        ids, lps, reasons, versions = self._parse(resp, len(prompts))
        extra: dict = {"weight_versions": versions}
        if self.tag_token_versions:
            extra["token_versions"] = self._token_versions(resp, ids)
        return GenerationOutput(completion_ids=ids, logprobs=lps, finish_reasons=reasons,
                                weight_version=min(versions) if versions else self.weight_version,
                                extra=extra,
                                routed_experts=self._routing(resp, prompts, ids) if self.record_routing else None)

    def _token_versions(self, resp: dict, completions: list[list[int]]) -> list[list[int]]:
        """Each choice's `token_weight_versions` (in-flight weight updates), one per completion token."""
        out = []
        for c, ids in zip(sorted(resp["choices"], key=lambda c: c.get("index", 0)), completions):
            versions = c.get("token_weight_versions")
            if not isinstance(versions, list) or len(versions) != len(ids):
                raise RolloutServerError(f"{self.base_url}/v1/completions returned no token_weight_versions for its "
                                         f"{len(ids)} tokens: serve with hf-verl serve's transformers engine, or set "
                                         "in_flight_weight_updates=False.")
            out.append([int(v) for v in versions])
        return out

    @property
    def supports_in_flight_updates(self) -> bool:
        """Whether the server applies weights between two decode steps (`hf-verl serve` on its transformers
        engine says so on `GET /v1/weights/version`; asked once)."""
        if self.backend == "vllm":
            return False
        if getattr(self, "_in_flight", None) is None:
            self._in_flight = bool(self._request("GET", "/v1/weights/version").get("in_flight", False))
        return self._in_flight

    def _routing(self, resp: dict, prompts: Sequence[Sequence[int]], completions: list[list[int]]) -> list:
        """Each choice's `routed_experts` (routing replay) as a `(prompt + completion tokens, layers, top_k)` tensor."""
        choices = sorted(resp["choices"], key=lambda c: c.get("index", 0))
        out = []
        for c, p, ids in zip(choices, prompts, completions):
            record = c.get("routed_experts")
            if record is None:
                raise RolloutServerError(f"{self.base_url}/v1/completions returned no routed_experts although "
                                         "router_replay asked for them: serve a Mixture-of-Experts model with "
                                         "hf-verl serve (transformers engine), or set router_replay=False.")
            record = torch.tensor(record, dtype=torch.int16)
            if record.dim() != 3 or record.shape[0] != len(p) + len(ids):
                raise RolloutServerError(f"{self.base_url} returned routed_experts of shape {tuple(record.shape)} for "
                                         f"{len(p)} prompt and {len(ids)} completion tokens.")
            out.append(record)
        return out

    def _parse(self, resp: dict, expected: int):
        url = f"{self.base_url}/v1/completions"
        choices = resp.get("choices")
        if not isinstance(choices, list) or len(choices) != expected:
            raise RolloutServerError(f"{url} answered {len(choices) if isinstance(choices, list) else 'no'} choices "
                                     f"for {expected} prompts: {str(resp)[:200]}")
        choices = sorted(choices, key=lambda c: c.get("index", 0))
        ids, lps, reasons, versions = [], [], [], []
        for c in choices:
            logprobs = c.get("logprobs") or {}
            token_ids = c.get("token_ids")
            if token_ids is None:
                tokens = logprobs.get("tokens") or []
                if not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                    raise RolloutServerError(f"{url} returns no token ids; use hf_verl's server or a vLLM server "
                                             "that honours return_tokens_as_token_ids.")
                token_ids = [int(t.split(":", 1)[1]) for t in tokens]
            token_lps = logprobs.get("token_logprobs")
            if token_lps is None or len(token_lps) != len(token_ids):
                raise RolloutServerError(f"{url} returned {len(token_ids)} tokens but no matching token_logprobs.")
            ids.append([int(t) for t in token_ids])
            lps.append([float(x) for x in token_lps])
            reasons.append(FINISH_STOP if c.get("finish_reason") == "stop" else FINISH_LENGTH)
            versions.append(int(c.get("weight_version", resp.get("weight_version", self.weight_version))))
        return ids, lps, reasons, versions

    # ------------------------------------------------------------------ weights
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Upload full HF-named tensors bucket by bucket; the server applies them at the last one.

        Each bucket is one safetensors body written straight from the tensors' memory
        (:mod:`hf_verl.rollout.tensor_wire`) over one kept-alive connection; uploads are not
        retried blindly (a 4xx must surface), and any failure names the URL.
        """
        if self.backend == "vllm":
            self._sync_vllm_server(named_tensors)
            return
        upload = WeightUpload(self)
        buckets = tensor_buckets(named_tensors, self.bucket_bytes)
        pending = next(buckets, None)
        if pending is None:
            raise ValueError("sync_weights got no tensors.")
        try:
            while pending is not None:
                following = next(buckets, None)
                upload.send(pending, last=following is None)
                pending = following
        finally:
            upload.close()
        upload.finish()
        logger.info("synced %d bucket(s) to %s; weight version %d", upload.index, self.base_url, self._weight_version)

    def _upload(self, conn, path: str, bucket: list[tuple[str, torch.Tensor]]):
        """POST one bucket on `conn` (opened when None or dropped); returns `(conn, answer)`."""
        import http.client

        from hf_verl.rollout.tensor_wire import encode

        url = f"{self.base_url}{path}"
        prefix, chunks = encode(bucket)
        length = len(prefix) + sum(c.nbytes for c in chunks)
        if conn is None:
            parts = urllib.parse.urlsplit(self.base_url)
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = cls(parts.hostname, parts.port, timeout=self.timeout_s)
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(length)}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        sent_error: Exception | None = None
        try:
            conn.putrequest("POST", urllib.parse.urlsplit(self.base_url).path + path, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders(prefix)
            for chunk in chunks:
                conn.send(chunk)
        except OSError as err:  # the server may have answered (401, 413) and closed before the body ended
            sent_error = err
        try:
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as err:
            conn.close()
            why = sent_error or err
            raise ServerUnreachable(f"uploading weights to {url} failed: {why}. Is the server up (and the token "
                                    "right)?") from None
        if resp.will_close:
            conn.close()
            conn = None
        if resp.status != 200:
            error = ServerUnreachable if resp.status >= 500 else RolloutServerError
            raise error(f"{url} answered {resp.status}: {raw[:300].decode(errors='replace')}")
        try:
            return conn, json.loads(raw)
        except json.JSONDecodeError:
            raise RolloutServerError(f"{url} did not answer JSON: {raw[:200]!r}") from None

    def _sync_vllm_server(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Shards in `shared_dir`, then one in-place `reload_weights` on the vLLM dev-mode server."""
        import os
        import shutil
        import tempfile

        from safetensors.torch import save_file

        root = tempfile.mkdtemp(prefix="hf_verl_sync_", dir=self.shared_dir)
        try:
            count = 0
            for i, bucket in enumerate(tensor_buckets(named_tensors, self.bucket_bytes)):
                save_file({n: t.detach().contiguous().cpu() for n, t in bucket},
                          os.path.join(root, f"model-{i:05d}.safetensors"))
                count += len(bucket)
            if not count:
                raise ValueError("sync_weights got no tensors.")
            body = json.dumps({"method": "reload_weights", "kwargs": {"weights_path": root}}).encode()
            self._request("POST", "/collective_rpc", body, retry=False)
            self._request_empty("POST", "/reset_prefix_cache")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        self._bump_version()
        logger.info("vLLM server %s reloaded %d tensors; weight version %d", self.base_url, count, self.weight_version)

    def _request_empty(self, method: str, path: str) -> None:
        req = urllib.request.Request(f"{self.base_url}{path}", data=b"", method=method)
        try:
            urllib.request.urlopen(req, timeout=self.timeout_s).read()
        except (urllib.error.URLError, OSError) as err:
            raise RolloutServerError(f"{self.base_url}{path} failed: {err}") from None


def check_prompts(prompt_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """The prompts as lists of ints; each must hold at least one token."""
    prompts = [list(map(int, p)) for p in prompt_ids]
    if any(not p for p in prompts):
        raise ValueError("every prompt must contain at least one token.")
    return prompts


class WeightUpload:
    """One weight update to one `hf-verl serve` server: buckets sent in order on one kept-alive connection under
    one update id; the server applies them together when the last arrives.

    Args:
        engine ([`RemoteEngine`]): the server's engine (its URL, token and timeout).
    """

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine, self.update, self.index = engine, uuid.uuid4().hex, 0
        self.conn, self.answer = None, None

    def send(self, bucket: list[tuple[str, torch.Tensor]], *, last: bool) -> dict:
        """Upload one bucket (`last`: the update's final one); returns the server's answer."""
        path = f"/v1/weights?update={self.update}&index={self.index}&last={int(last)}"
        if self.engine.tag_token_versions:  # in-flight weight updates: applied between two decode steps
            path += "&in_flight=1"
        self.conn, self.answer = self.engine._upload(self.conn, path, bucket)
        self.index += 1
        return self.answer

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def finish(self) -> int:
        """The server's weight version once it applied the update (also the engine's `weight_version`).

        Raises:
            RolloutServerError: the last answer does not say the update was applied.
        """
        if not (self.answer or {}).get("applied"):
            raise RolloutServerError(f"{self.engine.base_url} did not apply the weight update: {self.answer}")
        self.engine._weight_version = int(self.answer["weight_version"])
        return self.engine._weight_version
