"""`hf-verl serve` for a sequence-classification model (a reward model): vLLM's `/classify` route.

Routes (FastAPI on uvicorn, the OpenAPI page at `/docs`):

- `GET /health`, `GET /v1/models`;
- `POST /classify` (also `/v1/classify`): vLLM's classification request
  (:class:`~hf_verl.serve.schema.ClassifyRequest`: `input` as text, token ids or a list of either,
  `use_activation`, `add_special_tokens`, `truncate_prompt_tokens`) answered in vLLM's shape:
  `{"id", "object": "list", "created", "model", "data": [{"index", "label", "probs", "num_classes"}], "usage"}`.

`probs` holds the model's logits after vLLM's default activation (sigmoid for one label, softmax for several),
or the raw logits with `use_activation: false`; a reward model (`num_labels=1`) is read that way by
:class:`~hf_verl.rewards.remote.RemoteRewardModel`, so the same client scores through this server or through
`vllm serve <reward model> --runner pooling`. `label` is `id2label` of the largest entry, as vLLM answers.
Inputs are padded on the right and scored `batch_size` at a time; the score is read at each input's last token
(the model's `pad_token_id` is set to the tokenizer's padding, as :class:`~hf_verl.rewards.reward_model.
RewardModelScorer` does). The server binds 127.0.0.1 by default; it has no weight routes.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from hf_verl.serve.errors import ServeError, install_error_handlers
from hf_verl.serve.host import UvicornHost
from hf_verl.serve.responses import json_response
from hf_verl.serve.schema import ClassifyRequest

logger = logging.getLogger(__name__)


def is_classifier(config) -> bool:
    """Whether a model config describes a sequence-classification model (what `--task auto` serves on `/classify`)."""
    return any(str(name).endswith("ForSequenceClassification") for name in (getattr(config, "architectures", None)
                                                                           or ()))


def activation(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's default classification activation of `(N, num_labels)` logits: sigmoid for one label, else softmax."""
    return logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(dim=-1)


class ClassifyServer(UvicornHost):
    """Serve a sequence-classification model on vLLM's `/classify` route (see the module docstring).

    Args:
        model (`PreTrainedModel`): an `AutoModelForSequenceClassification` model.
        tokenizer: its tokenizer (encodes text inputs; its padding is the model's `pad_token_id`).
        model_name (`str`): the id `/v1/models` reports; requests may name it (or any of `served_model_names`).
        host (`str`, defaults to `"127.0.0.1"`), port (`int`, defaults to 8000; 0 picks a free port).
        served_model_names (`list[str]`, *optional*): names a request may give as `model`.
        max_prompts (`int`, defaults to 1024): inputs per request, at most.
        batch_size (`int`, defaults to 32): inputs per forward pass.
        max_request_bytes (`int`, defaults to 64 MiB): largest accepted body.

    Raises:
        ValueError: a host other than loopback (this server has no token: serve on 127.0.0.1 and forward), or a
            model that is not a sequence classifier.
    """

    def __init__(self, model, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000, *,
                 served_model_names: list[str] | None = None, max_prompts: int = 1024, batch_size: int = 32,
                 max_request_bytes: int = 64 * 2**20) -> None:
        from hf_verl.serve.auth import is_loopback

        if not is_loopback(host):
            raise ValueError(f"refusing to serve a reward model on non-loopback host {host!r}: serve on 127.0.0.1 "
                             "and put an authenticating proxy in front of it.")
        if not hasattr(getattr(model, "config", None), "num_labels"):
            raise ValueError(f"{type(model).__name__} is not a sequence-classification model: load it with "
                             "AutoModelForSequenceClassification (num_labels=1 for a reward model).")
        self.model, self.tokenizer, self.model_name = model.eval(), tokenizer, model_name
        self.served_model_names = list(served_model_names or [model_name])
        self.max_prompts, self.batch_size, self.max_request_bytes = max_prompts, batch_size, max_request_bytes
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.lock = threading.Lock()  # one forward at a time; a fast tokenizer is not thread-safe either
        self._listen(host, port)

    _thread_name = "hf-verl-serve-classify"
    _what = "classification server"

    def _build_app(self):
        return build_classify_app(self)

    def _banner(self) -> str:
        return (f"hf-verl classification server on {self.address} (model {self.model_name}, "
                f"{self.model.config.num_labels} label(s); POST {self.address}/classify)")

    # ------------------------------------------------------------------ scoring
    def classify(self, body: ClassifyRequest | dict) -> dict:
        """Answer a classification request as vLLM does; blocks until scored."""
        from hf_verl.serve.server import _validated

        req = _validated(ClassifyRequest, body)
        if req.model is not None and req.model not in self.served_model_names:
            raise ServeError(404, f"The model `{req.model}` does not exist. This server serves "
                                  f"{', '.join(repr(m) for m in self.served_model_names)}.", "model")
        if len(req.inputs) > self.max_prompts:
            raise ServeError(400, f"{len(req.inputs)} inputs exceed this server's cap of {self.max_prompts} per "
                                  "request", "input")
        with self.lock:
            ids = [self._ids(item, req) for item in req.inputs]
            logits = self._logits(ids)
        probs = logits if req.use_activation is False else activation(logits)
        id2label = getattr(self.model.config, "id2label", None) or {}
        data = [{"index": i, "label": id2label.get(int(row.argmax())), "probs": row.tolist(),
                 "num_classes": row.shape[0]} for i, row in enumerate(probs)]
        tokens = sum(len(x) for x in ids)
        return {"id": f"classify-{time.time_ns():x}", "object": "list", "created": int(time.time()),
                "model": req.model or self.model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}

    def _ids(self, item: str | list[int], req: ClassifyRequest) -> list[int]:
        vocab = self.model.get_input_embeddings().num_embeddings
        if isinstance(item, str):
            item = self.tokenizer(item, add_special_tokens=req.add_special_tokens)["input_ids"]
            if not item:
                raise ServeError(400, "a text input encodes to no tokens", "input")
        elif any(t >= vocab for t in item):
            raise ServeError(400, f"input token ids must be below the vocabulary size {vocab}", "input")
        keep = req.truncate_prompt_tokens
        if keep == -1:
            keep = getattr(self.model.config, "max_position_embeddings", None)
        return list(item)[-keep:] if keep else list(item)

    @torch.no_grad()
    def _logits(self, ids: list[list[int]]) -> torch.Tensor:
        from hf_verl.data.batch import pad_sequences

        device = next(self.model.parameters()).device
        out = []
        for i in range(0, len(ids), self.batch_size):
            input_ids, mask = pad_sequences(ids[i : i + self.batch_size], self.tokenizer.pad_token_id, side="right",
                                            device=device)
            out.append(self.model(input_ids=input_ids, attention_mask=mask).logits.float().cpu())
        return torch.cat(out)


def build_classify_app(server: ClassifyServer) -> FastAPI:
    """The FastAPI application of a :class:`ClassifyServer`."""
    from hf_verl import __version__
    from hf_verl.serve.app import JSONBodies

    app = FastAPI(title="hf-verl serve (classification)", version=__version__, description=(
        "vLLM-compatible classification / reward scoring: POST /classify with `input`; a reward model's score is "
        "`probs[0]` with `use_activation: false`."))
    app.add_middleware(JSONBodies, server=server)
    install_error_handlers(app)

    @app.get("/health", summary="Liveness")
    async def health():
        return json_response({"status": "ok"})

    @app.get("/v1/models", summary="The served model names")
    async def models():
        return json_response({"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "hf_verl"} for name in server.served_model_names]})

    async def classify(body: ClassifyRequest):
        return json_response(await run_in_threadpool(server.classify, body))

    for path in ("/classify", "/v1/classify"):
        app.post(path, summary="vLLM's classification request: scores of each input")(classify)
    return app
