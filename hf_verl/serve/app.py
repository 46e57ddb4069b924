"""The rollout server's routes: a FastAPI application over a :class:`~hf_verl.serve.server.RolloutServer`.

Generation runs in worker threads (it blocks on the engine); a weight upload is read into one tensor as it
arrives, after its token is checked, then staged and applied on a thread of its own, so that uploads never wait
behind queued generation requests for a worker. Bodies of the generation routes are capped by
`max_request_bytes` (413) and read as JSON whatever their content type.
"""

from __future__ import annotations

import asyncio
import json
import logging

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.security import HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from hf_verl.serve.auth import check_bearer
from hf_verl.serve.errors import ServeError, error_body, install_error_handlers
from hf_verl.serve.responses import dumps, json_response
from hf_verl.serve.schema import ChatCompletionRequest, CompletionRequest, WeightPath
from hf_verl.serve.streaming import server_sent_events
from hf_verl.serve.weights import bucket_query

logger = logging.getLogger(__name__)

WEIGHTS_BODY = {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary",
                                            "description": "a safetensors file of HF-named tensors (one bucket)"}},
    "application/json": {"schema": WeightPath.model_json_schema()}}}


class JSONBodies:
    """ASGI middleware for the generation routes: a body longer than the server's `max_request_bytes` is a 413,
    and a body sent without a JSON content type (`curl -d`, `urllib`) is read as JSON, as before FastAPI."""

    def __init__(self, app, server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/v1/weights":  # the weight route checks its own
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if scope["method"] == "POST" and b"json" not in headers.get(b"content-type", b""):
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        limit, seen = self.server.max_request_bytes, 0
        message = f"the request body exceeds this server's limit of {limit} bytes"
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > limit:
            body = dumps(error_body(413, message))
            await send({"type": "http.response.start", "status": 413, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]})
            return await send({"type": "http.response.body", "body": body})

        async def limited():
            nonlocal seen
            event = await receive()
            seen += len(event.get("body", b""))
            if seen > limit:
                raise ServeError(413, message, close=True)
            return event

        return await self.app(scope, limited, send)


async def read_body_tensor(request: Request, length: int, timeout_s: float) -> torch.Tensor:
    """The body copied chunk by chunk, as it arrives, into one uint8 tensor of its declared `length` (the whole
    body is never held as `bytes`)."""
    body = torch.empty(length, dtype=torch.uint8)
    view, got = memoryview(body.numpy()), 0
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), timeout_s)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise ServeError(408, f"the body stalled after {got} of {length} bytes; nothing was staged",
                             close=True) from None
        except ClientDisconnect:
            raise ServeError(400, f"the client went away after {got} of {length} bytes; nothing was staged",
                             close=True) from None
        if got + len(chunk) > length:
            raise ServeError(400, f"the body is longer than its Content-Length {length}", close=True)
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    if got != length:
        raise ServeError(400, f"body ended after {got} of {length} bytes; nothing was staged", close=True)
    return body


def build_app(server) -> FastAPI:
    """The FastAPI application of `server` (a :class:`~hf_verl.serve.server.RolloutServer`)."""
    from hf_verl import __version__

    app = FastAPI(title="hf-verl serve", version=__version__, description=(
        "OpenAI-compatible rollout server with versioned, token-protected weight updates. Every choice carries "
        "`token_ids`, its sampled tokens' log-probs and the `weight_version` it was generated with."))
    app.add_middleware(JSONBodies, server=server)
    install_error_handlers(app)
    bearer = HTTPBearer(auto_error=False, description="The server's token (--token-file or HF_VERL_SERVE_TOKEN).")

    @app.get("/health", summary="Liveness and the current weight version")
    async def health():
        return json_response({"status": "ok", "weight_version": server.engine.weight_version})

    @app.get("/v1/models", summary="The served model names")
    async def models():
        return json_response({"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "hf_verl"} for name in server.served_model_names]})

    @app.get("/v1/weights/version", summary="The current weight version (and the served weights' dtype)")
    async def weight_version():
        return json_response({"weight_version": server.engine.weight_version, "dtype": server.weight_dtype,
                              "in_flight": bool(server.engine.supports_in_flight_updates)})

    async def answer(body, chat: bool):
        if body.stream:
            produce = await run_in_threadpool(server.stream, body, chat)
            return StreamingResponse(server_sent_events(produce), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        handler = server.chat_completions if chat else server.completions
        return json_response(await run_in_threadpool(handler, body))

    @app.post("/v1/completions", summary="OpenAI completions (streamed token by token with stream=true)")
    async def completions(body: CompletionRequest):
        return await answer(body, chat=False)

    @app.post("/v1/chat/completions", summary="OpenAI chat completions through the tokenizer's chat template")
    async def chat_completions(body: ChatCompletionRequest):
        return await answer(body, chat=True)

    @app.post("/v1/weights", summary="A weight update: a safetensors bucket, or a path on the server",
              dependencies=[Depends(bearer)], openapi_extra={"requestBody": WEIGHTS_BODY})
    async def weights(request: Request, update: str | None = None, index: str | None = None,
                      last: str | None = None, in_flight: str | None = None):
        try:
            check_bearer(server.token, request.headers.get("authorization"))  # before reading the body
        except ServeError as err:
            err.close = True  # the body is left unread
            raise
        loop = asyncio.get_running_loop()
        if request.headers.get("content-type", "").startswith("application/json"):
            spec = await _json_body(request, limit=2**20)
            if not isinstance(spec, dict) or "path" not in spec:
                raise ServeError(400, 'a JSON weight update needs {"path": ...}', "path", close=True)
            result = await loop.run_in_executor(server.weights_pool, server.weights.receive_path, spec["path"])
            return json_response(result)
        bucket = bucket_query(update, index, last)
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            raise ServeError(411, "a weight bucket needs a Content-Length header", close=True)
        if int(length) > server.max_upload_bytes:
            raise ServeError(413, f"body of {length} bytes exceeds the limit of {server.max_upload_bytes}",
                             close=True)
        payload = await read_body_tensor(request, int(length), server.body_timeout_s)
        result = await loop.run_in_executor(server.weights_pool, server.weights.receive_bucket, *bucket, payload,
                                            in_flight == "1")
        return json_response(result)

    async def _adapter_route(request: Request, handler):
        check_bearer(server.token, request.headers.get("authorization"))  # an adapter changes what is served
        body = await _json_body(request, limit=2**20)
        loop = asyncio.get_running_loop()
        return json_response(await loop.run_in_executor(server.weights_pool, handler, body))

    @app.post("/v1/load_lora_adapter", summary="Load a LoRA adapter (vLLM's body; or an inline lora_config)",
              dependencies=[Depends(bearer)])
    async def load_lora_adapter(request: Request):
        return await _adapter_route(request, server.adapters.load)

    @app.post("/v1/unload_lora_adapter", summary="Unload a LoRA adapter", dependencies=[Depends(bearer)])
    async def unload_lora_adapter(request: Request):
        return await _adapter_route(request, server.adapters.unload)

    return app


async def _json_body(request: Request, limit: int):
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise ServeError(413, f"a JSON weight update is at most {limit} bytes", close=True)
    try:
        return json.loads(data or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ServeError(400, f"body is not JSON: {err}", close=True) from None
