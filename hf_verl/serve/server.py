"""`hf-verl serve`: an OpenAI-compatible rollout server with versioned, token-protected weight updates.

Routes:

- `GET /health`, `GET /v1/models`, `GET /v1/weights/version`;
- `POST /v1/completions`: OpenAI's completions request (`prompt` as text, token ids, or a list of
  either; `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `stop`,
  `n`, `seed`, `logprobs`, `stream`); every choice carries `token_ids` and its sampled-token
  log-probs, and the response carries the `weight_version` it was generated with. With
  `stream=true` the answer is server-sent events (one chunk per choice, then `data: [DONE]`: the
  engine generates whole completions, so a chunk holds a whole choice). A `model` other than the
  served name is answered 404, as vLLM does. Requests beyond the caps on `n`, `max_tokens` and
  prompts per request are answered 400 with the cap;
- `POST /v1/weights` (bearer token required): one bucket of HF-named tensors as a safetensors
  body (`?update=<id>&index=<i>&last=0|1`), or a JSON body `{"path": "<safetensors file or
  folder>"}`. Buckets are staged and applied together when the last one arrives, under the lock
  that generation holds, so a partial update is never served; a client that dies mid-upload
  leaves the old weights serving (its staged buckets expire).

Bucket bodies are read straight into tensors and staged as views into them
(:mod:`hf_verl.rollout.tensor_wire`), so staging holds one copy of the update in host memory
until it completes (one model copy on the server side; the trainer side streams bucket by
bucket, sending from the parameters' own memory). Uses only the standard library's
HTTP server (threaded), so it runs wherever hf_verl runs.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import torch

from hf_verl.rollout.base import RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)

TOKEN_ENV = "HF_VERL_SERVE_TOKEN"


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token_file: str | None) -> str | None:
    """The server token: from `token_file`, else the `HF_VERL_SERVE_TOKEN` variable, else None."""
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty.")
        return token
    return os.environ.get(TOKEN_ENV) or None


class RolloutServer:
    """Serve a :class:`~hf_verl.rollout.base.RolloutEngine` over HTTP (see the module docstring).

    Args:
        engine: the engine (its `model`, when it has one, receives weight updates).
        tokenizer: decodes completions and encodes text prompts.
        model_name (`str`): the id reported by `/v1/models`.
        host (`str`, defaults to `"127.0.0.1"`), port (`int`, defaults to 8000; 0 picks a free port).
        token (`str`, *optional*): bearer token of the weight routes; required off loopback.
        max_upload_bytes (`int`): largest accepted request body.
        staging_timeout_s (`float`): staged buckets of an update not completed within this expire.
        served_model_names (`list[str]`, *optional*): the names a request may give as `model` (default
            `[model_name]`); `/v1/models` lists them.
        max_n (`int`), max_tokens (`int`), max_prompts (`int`): caps per completions request (choices per
            prompt, tokens per choice, prompts); one request cannot hold the server for longer than that.
    """

    def __init__(self, engine: RolloutEngine, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 token: str | None = None, max_upload_bytes: int = 2 * 2**30, staging_timeout_s: float = 600.0,
                 served_model_names: list[str] | None = None, max_n: int = 64, max_tokens: int = 8192,
                 max_prompts: int = 1024) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(
                f"refusing to serve on non-loopback host {host!r} without a token: weight updates would be open to "
                f"the network. Set {TOKEN_ENV} or pass --token-file, or serve on 127.0.0.1."
            )
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.served_model_names = list(served_model_names or [model_name])
        self.max_n, self.max_tokens, self.max_prompts = max_n, max_tokens, max_prompts
        self.token = token
        self.max_upload_bytes, self.staging_timeout_s = max_upload_bytes, staging_timeout_s
        self.lock = threading.Lock()  # generation and weight application never interleave
        self._staged: dict[str, dict] = {}
        self._staged_lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RolloutServer:
        """Serve in a background thread (tests, notebooks)."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        logger.info("hf-verl rollout server on %s (model %s, weight version %d)", self.address, self.model_name,
                    self.engine.weight_version)
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ routes
    def completions(self, body: dict) -> dict:
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in self.served_model_names:
            raise HTTPError(404, f"The model `{model}` does not exist. This server serves "
                                 f"{', '.join(repr(m) for m in self.served_model_names)}.")
        prompts = self._prompt_ids(body.get("prompt"))
        try:
            n, max_new = int(body.get("n", 1)), int(body.get("max_tokens", 16))
        except (TypeError, ValueError):
            raise HTTPError(400, "n and max_tokens must be integers") from None
        if n < 1:
            raise HTTPError(400, "n must be >= 1")
        if n > self.max_n:
            raise HTTPError(400, f"n={n} exceeds this server's cap of {self.max_n} completions per prompt")
        if max_new > self.max_tokens:
            raise HTTPError(400, f"max_tokens={max_new} exceeds this server's cap of {self.max_tokens}")
        if len(prompts) > self.max_prompts:
            raise HTTPError(400, f"{len(prompts)} prompts exceed this server's cap of {self.max_prompts} per request")
        stop = body.get("stop")
        try:
            sampling = SamplingParams(
                max_new_tokens=max_new, temperature=float(body.get("temperature", 1.0)),
                top_p=float(body.get("top_p", 1.0)), top_k=int(body.get("top_k", 0) or 0),
                min_p=body.get("min_p"), repetition_penalty=float(body.get("repetition_penalty", 1.0)),
                stop=tuple([stop] if isinstance(stop, str) else (stop or ())),
                seed=body.get("seed"),
            )
        except (TypeError, ValueError) as err:
            raise HTTPError(400, f"bad sampling parameters: {err}") from None
        expanded = [p for p in prompts for _ in range(n)]
        with self.lock:
            out = self.engine.generate(expanded, sampling)
        choices = []
        for i, (ids, lps, reason) in enumerate(zip(out.completion_ids, out.logprobs, out.finish_reasons)):
            choices.append({
                "index": i, "text": self.tokenizer.decode(ids, skip_special_tokens=True), "finish_reason": reason,
                "token_ids": list(ids), "prompt_token_ids": list(expanded[i]),
                "logprobs": {"tokens": self.tokenizer.convert_ids_to_tokens(list(ids)), "token_logprobs": list(lps)},
                "weight_version": out.weight_version,
            })
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        prompt_tokens = sum(len(p) for p in expanded)
        return {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "weight_version": out.weight_version,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def _prompt_ids(self, prompt) -> list[list[int]]:
        if prompt is None or (isinstance(prompt, (list, str)) and len(prompt) == 0):
            raise HTTPError(400, "'prompt' is required: text, token ids, or a list of either")
        items = prompt if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt) else [prompt]
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(self.tokenizer(item)["input_ids"])
            elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
                out.append(item)
            else:
                raise HTTPError(400, f"each prompt must be text or a non-empty list of token ids, got {item!r:.80}")
        return out

    def check_token(self, header: str | None) -> None:
        if not self.token:
            raise HTTPError(403, f"weight updates are disabled: start the server with a token ({TOKEN_ENV} or "
                                 "--token-file)")
        given = header[7:] if header and header.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise HTTPError(401, "missing or wrong bearer token")

    def receive_bucket(self, query: dict, payload: torch.Tensor) -> dict:
        """Stage one bucket (`payload`: the body as a 1-D uint8 tensor); apply the update at its last."""
        from hf_verl.rollout.tensor_wire import WireFormatError, decode

        update = query.get("update", [""])[0]
        try:
            index, last = int(query.get("index", ["0"])[0]), query.get("last", ["0"])[0] == "1"
        except ValueError:
            raise HTTPError(400, "index must be an integer") from None
        if not update:
            raise HTTPError(400, "a bucket needs ?update=<id>&index=<i>&last=0|1")
        try:
            tensors = decode(payload)  # views into the body: the bucket is held once
        except (WireFormatError, TypeError, ValueError, KeyError, RuntimeError) as err:
            raise HTTPError(400, f"body is not a safetensors bucket: {err}; the weights are unchanged") from None
        self._check_tensors(tensors)
        now = time.monotonic()
        with self._staged_lock:
            for key in [k for k, v in self._staged.items() if now - v["t"] > self.staging_timeout_s]:
                logger.warning("dropping incomplete weight update %s (no last bucket in time)", key)
                del self._staged[key]
            entry = self._staged.setdefault(update, {"t": now, "buckets": {}, "last": None})
            entry["t"] = now
            entry["buckets"][index] = tensors
            if last:
                entry["last"] = index
            complete = entry["last"] is not None and len(entry["buckets"]) == entry["last"] + 1
            if complete:
                del self._staged[update]
        if not complete:
            return {"applied": False, "received": index, "weight_version": self.engine.weight_version}
        merged = {}
        for i in sorted(entry["buckets"]):
            merged.update(entry["buckets"][i])
        return self.apply(merged)

    def receive_path(self, path: str) -> dict:
        from safetensors.torch import load_file

        if not isinstance(path, str):
            raise HTTPError(400, f"'path' must be a string, got {type(path).__name__}")
        if os.path.isdir(path):
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        elif os.path.isfile(path):
            files = [path]
        else:
            raise HTTPError(400, f"no safetensors file or folder at {path!r}")
        if not files:
            raise HTTPError(400, f"{path!r} holds no .safetensors files")
        tensors = {}
        for f in files:
            try:
                tensors.update(load_file(f))
            except Exception as err:  # not a safetensors file (safetensors raises its own error types)
                raise HTTPError(400, f"{f!r} is not a readable safetensors file ({type(err).__name__}: {err}); "
                                     "the weights are unchanged") from None
        self._check_tensors(tensors)
        return self.apply(tensors)

    def _check_tensors(self, tensors: dict) -> None:
        model = getattr(self.engine, "model", None)
        if model is None:
            return
        targets = model.state_dict()
        unknown = [k for k in tensors if k not in targets]
        if unknown:
            raise HTTPError(400, f"unknown parameter name(s) {unknown[:5]}; names must be the model's state_dict keys")
        bad = [k for k, v in tensors.items() if tuple(v.shape) != tuple(targets[k].shape)]
        if bad:
            raise HTTPError(400, f"shape mismatch for {bad[:5]}")
        odd = [k for k, v in tensors.items() if not v.is_floating_point() and targets[k].is_floating_point()]
        if odd:
            raise HTTPError(400, f"non-floating tensors for floating weights {odd[:5]}")

    def apply(self, tensors: dict[str, torch.Tensor]) -> dict:
        with self.lock:
            self.engine.sync_weights(tensors.items())
            version = self.engine.weight_version
        logger.info("applied a weight update of %d tensors; weight version %d", len(tensors), version)
        return {"applied": True, "weight_version": version, "num_tensors": len(tensors)}

    # ------------------------------------------------------------------ HTTP plumbing
    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 60  # a client that stalls mid-body is dropped; nothing of its upload is applied

            def log_message(self, fmt, *args):
                logger.debug("%s " + fmt, self.address_string(), *args)

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:  # say so: a client must not send its next request on this socket
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, response: dict) -> None:
                """The completion as server-sent events: one chunk per choice, then [DONE]; the connection
                closes at the end (no length is known up front)."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                head = {k: response[k] for k in ("id", "object", "created", "model", "weight_version")}
                for choice in response["choices"]:
                    chunk = dict(head, choices=[choice])
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.write(b"data: " + json.dumps(dict(head, choices=[], usage=response["usage"])).encode()
                                 + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def _error(self, status: int, message: str) -> None:
                kind = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                        404: "NotFoundError", 413: "BadRequestError"}.get(status, "InternalServerError")
                self._send(status, {"error": {"message": message, "type": kind, "code": status}})

            def _length(self) -> int:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    raise HTTPError(400, "Content-Length is not an integer") from None
                if length > server.max_upload_bytes:
                    raise HTTPError(413, f"body of {length} bytes exceeds the limit of {server.max_upload_bytes}")
                return length

            def _body(self) -> bytes:
                length = self._length()
                data = self.rfile.read(length)
                if len(data) != length:
                    raise HTTPError(400, f"body ended after {len(data)} of {length} bytes")
                return data

            def _body_tensor(self) -> torch.Tensor:
                """The body read straight into one uint8 tensor (no intermediate `bytes`)."""
                length = self._length()
                body = torch.empty(length, dtype=torch.uint8)
                view, got = memoryview(body.numpy()), 0
                while got < length:
                    n = self.rfile.readinto(view[got:])
                    if not n:
                        raise HTTPError(400, f"body ended after {got} of {length} bytes")
                    got += n
                return body

            def do_GET(self):
                path = urlparse(self.path).path
                if path == "/health":
                    self._send(200, {"status": "ok", "weight_version": server.engine.weight_version})
                elif path == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": name, "object": "model", "owned_by": "hf_verl"} for name in server.served_model_names]})
                elif path == "/v1/weights/version":
                    self._send(200, {"weight_version": server.engine.weight_version})
                else:
                    self._error(404, f"no route GET {path}")

            def do_POST(self):
                url = urlparse(self.path)
                try:
                    if url.path == "/v1/completions":
                        try:
                            body = json.loads(self._body() or b"{}")
                        except json.JSONDecodeError as err:
                            raise HTTPError(400, f"body is not JSON: {err}") from None
                        if isinstance(body, dict) and body.get("stream"):
                            self._stream(server.completions(body))
                        else:
                            self._send(200, server.completions(body))
                    elif url.path == "/v1/weights":
                        server.check_token(self.headers.get("Authorization"))  # before reading the body
                        if self.headers.get("Content-Type", "").startswith("application/json"):
                            try:
                                spec = json.loads(self._body() or b"{}")
                            except json.JSONDecodeError as err:
                                raise HTTPError(400, f"body is not JSON: {err}") from None
                            if not isinstance(spec, dict) or "path" not in spec:
                                raise HTTPError(400, 'a JSON weight update needs {"path": ...}')
                            self._send(200, server.receive_path(spec["path"]))
                        else:
                            self._send(200, server.receive_bucket(parse_qs(url.query), self._body_tensor()))
                    else:
                        self._error(404, f"no route POST {url.path}")
                except HTTPError as err:
                    self.close_connection = True  # a body may be left unread
                    self._error(err.status, err.message)
                except (ConnectionError, TimeoutError) as err:
                    logger.warning("client %s went away: %s", self.address_string(), err)
                except Exception as err:  # noqa: BLE001 (the server keeps serving)
                    logger.exception("request failed")
                    self._error(500, f"{type(err).__name__}: {err}")

        return Handler
