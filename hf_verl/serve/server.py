"""`hf-verl serve`: an OpenAI-compatible rollout server with versioned, token-protected weight updates.

Routes (FastAPI on uvicorn; the OpenAPI page is `/docs`, its schema `/openapi.json`):

- `GET /health`, `GET /v1/models`, `GET /v1/weights/version`;
- `POST /v1/completions`: OpenAI's completions request (:class:`~hf_verl.serve.schema.CompletionRequest`:
  `prompt` as text, token ids, or a list of either; `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`,
  `repetition_penalty`, `stop`, `n`, `seed`, `logprobs`, `stream`, `stream_options`); every choice carries
  `token_ids` and its sampled-token log-probs, and the response the `weight_version` it was generated with;
  `echo` (with `max_tokens: 0`: score only) and vLLM's `prompt_logprobs` add the prompt's log-probs
  (:mod:`hf_verl.serve.prompt_logprobs`);
- `POST /v1/chat/completions`: the same over `messages`, rendered by the tokenizer's chat template (400 when
  it has none);
- `POST /v1/weights` (bearer token required): one bucket of HF-named tensors as a safetensors body
  (`?update=<id>&index=<i>&last=0|1`), or a JSON body `{"path": "<safetensors file or folder>"}`
  (:mod:`hf_verl.serve.weights`: staged, checked, applied at once under the generation lock).

With `stream=true` the answer is server-sent events, one chunk per choice per generated token
(:mod:`hf_verl.serve.streaming`), every chunk with one choice; a last chunk with `usage` (and empty
`choices`) only with `stream_options.include_usage`; then `data: [DONE]`. A malformed request is a 400 that
names the field (:mod:`hf_verl.serve.errors`); a `model` other than the served names is a 404, as vLLM
answers; requests beyond the caps on `n`, `max_tokens` and prompts are a 400 naming the cap. Concurrent
requests that sample alike are generated in one engine call (:mod:`hf_verl.serve.batching`); with
`continuous_batching` (`--continuous-batching`) every request's rows join one running decode loop instead.

The server binds 127.0.0.1 by default and refuses another interface without a token (:mod:`hf_verl.serve.auth`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from hf_verl.moe.routing import is_moe_model
from hf_verl.rollout.base import RolloutEngine, SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.serve.adapters import AdapterHost
from hf_verl.serve.auth import TOKEN_ENV, is_loopback, read_token  # noqa: F401 (the public names of this module)
from hf_verl.serve.batching import GenerationLock, RequestBatcher
from hf_verl.serve.errors import ServeError, describe_validation_error
from hf_verl.serve.host import UvicornHost
from hf_verl.serve.responses import Answer, usage
from hf_verl.serve.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from hf_verl.serve.streaming import steppable, stepped_deltas, whole_deltas
from hf_verl.serve.weights import WeightReceiver

logger = logging.getLogger(__name__)

def _validated(model_cls: type[SamplingRequest], body) -> SamplingRequest:
    """`body` as `model_cls` (a dict from a Python caller is validated here; a route hands a model)."""
    from pydantic import ValidationError

    if isinstance(body, model_cls):
        return body
    try:
        return model_cls.model_validate(body)
    except ValidationError as err:
        message, field = describe_validation_error(err.errors())
        raise ServeError(400, message, field) from None


class RolloutServer(UvicornHost):
    """Serve a :class:`~hf_verl.rollout.base.RolloutEngine` over HTTP (see the module docstring).

    Args:
        engine ([`RolloutEngine`]): the engine (its `model`, when it has one, receives weight updates).
        tokenizer: decodes completions, encodes text prompts, renders chat templates.
        model_name (`str`): the id reported by `/v1/models`.
        host (`str`, defaults to `"127.0.0.1"`), port (`int`, defaults to 8000; 0 picks a free port).
        token (`str`, *optional*): bearer token of the weight routes; required off loopback.
        max_upload_bytes (`int`): largest accepted weight-upload body.
        staging_timeout_s (`float`): staged buckets of an update not completed within this expire.
        served_model_names (`list[str]`, *optional*): the names a request may give as `model` (default
            `[model_name]`); `/v1/models` lists them.
        max_n (`int`), max_tokens (`int`), max_prompts (`int`): caps per request (choices per prompt, tokens per
            choice, prompts); one request cannot hold the server for longer than that.
        max_batch_rows (`int`, defaults to 256): completions that concurrent requests may share in one engine call.
        max_request_bytes (`int`, defaults to 64 MiB): largest accepted body of the generation routes.
        body_timeout_s (`float`, defaults to 60): a weight upload whose body stalls this long is dropped.
    """

    def __init__(self, engine: RolloutEngine, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 token: str | None = None, max_upload_bytes: int = 2 * 2**30, staging_timeout_s: float = 600.0,
                 served_model_names: list[str] | None = None, max_n: int = 64, max_tokens: int = 8192,
                 max_prompts: int = 1024, max_batch_rows: int = 256, max_request_bytes: int = 64 * 2**20,
                 body_timeout_s: float = 60.0, continuous_batching: bool = False) -> None:
        if not is_loopback(host) and not token:
            raise ValueError(
                f"refusing to serve on non-loopback host {host!r} without a token: weight updates would be open to "
                f"the network. Set {TOKEN_ENV} or pass --token-file, or serve on 127.0.0.1."
            )
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        model = getattr(engine, "model", None)
        dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()] if isinstance(model, torch.nn.Module) \
            else []
        self.weight_dtype = str(dtypes[0]).replace("torch.", "") if dtypes else None  # what delta sync casts to
        if engine.supports_in_flight_updates:
            engine.tag_token_versions = True  # in-flight updates: each token's weight version (when asked)
        if isinstance(engine, TransformersEngine) and is_moe_model(engine.model):
            engine.record_routing = True  # an MoE's answers can carry their routing (return_routed_experts)
        if continuous_batching:
            if not isinstance(engine, TransformersEngine):
                raise ValueError(f"--continuous-batching is the transformers engine's; {type(engine).__name__} "
                                 "batches requests itself (vLLM does continuously): drop the flag.")
            engine.model.requires_grad_(False)  # the served model only generates
            engine.enable_continuous_batching(max_rows=max_batch_rows)
        self.served_model_names = list(served_model_names or [model_name])
        self.max_n, self.max_tokens, self.max_prompts = max_n, max_tokens, max_prompts
        self.token = token
        self.max_upload_bytes, self.max_request_bytes = max_upload_bytes, max_request_bytes
        self.body_timeout_s = body_timeout_s
        # generation and weight application never interleave: an update takes the lock's exclusive side; continuous
        # generations share it (:class:`~hf_verl.serve.batching.GenerationLock`)
        self.lock = GenerationLock()
        self.weights = WeightReceiver(engine, self.lock, staging_timeout_s)
        self.adapters = AdapterHost(engine, self.lock)
        self.batcher = RequestBatcher(engine, self.lock, max_batch_rows, adapters=self.adapters)
        self.weights_pool = ThreadPoolExecutor(1, thread_name_prefix="hf-verl-serve-weights")
        self._encode_lock = threading.Lock()  # a fast tokenizer must not be encoding in two threads at once
        self._listen(host, port)

    _what = "rollout server"

    def _build_app(self):
        from hf_verl.serve.app import build_app

        return build_app(self)

    def _banner(self) -> str:
        return (f"hf-verl rollout server on {self.address} (model {self.model_name}, weight version "
                f"{self.engine.weight_version}; API page {self.address}/docs)")

    def _release(self) -> None:
        self.batcher.close()
        self.weights_pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.engine, TransformersEngine):
            self.engine.close()  # its continuous decode loop, if one runs
        super()._release()

    # ------------------------------------------------------------------ generation
    def completions(self, body: CompletionRequest | dict) -> dict:
        """Answer a completions request (not streamed) as OpenAI's JSON; blocks until generated."""
        req = _validated(CompletionRequest, body)
        if req.scores_prompt:
            return self.scored_completions(req)
        if req.return_routed_experts and not self.engine.record_routing:
            raise ServeError(400, "return_routed_experts needs a Mixture-of-Experts model served by the transformers "
                                  f"engine; this server's {type(self.engine).__name__} does not record routing",
                             "return_routed_experts")
        prompts, sampling = self.prepare(req, self.prompt_ids(req.prompts), req.max_tokens or 16)
        out = self.batcher.generate(prompts, sampling, self.adapter_of(req))
        return Answer(False, self.model_name, self.tokenizer).response(
            list(zip(out.completion_ids, out.logprobs, out.finish_reasons)), prompts, out.weight_version,
            routed=out.routed_experts if req.return_routed_experts else None,
            token_versions=out.extra.get("token_versions") if req.return_token_weight_versions else None)

    def scored_completions(self, req: CompletionRequest) -> dict:
        """A completions request with `echo` or `prompt_logprobs`: the prompts scored by the model (and, unless
        `max_tokens` is 0, completed), answered as vLLM does (:mod:`hf_verl.serve.prompt_logprobs`). The scores and
        the completions are of one weight version: a weight update between the two is followed by a re-score."""
        from hf_verl.serve.prompt_logprobs import add_prompt_scores, score_prompts

        model = getattr(self.engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ServeError(400, f"echo and prompt_logprobs need the model's forward pass, which this server's "
                                  f"{type(self.engine).__name__} does not expose: serve with --engine transformers "
                                  "(or use vLLM's own server, `vllm serve`)", "echo")
        ids = self.prompt_ids(req.prompts)
        rows, sampling = self.prepare(req, ids, max(1, 16 if req.max_tokens is None else req.max_tokens))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for _ in range(3):
            with self.lock:
                version = self.engine.weight_version
                scores, alternatives = score_prompts(model, ids, temperature=req.temperature, pad_token_id=pad,
                                                     top=req.prompt_logprobs)
            if req.max_tokens == 0:
                out = [([], [], "length") for _ in rows]
                break
            generated = self.batcher.generate(rows, sampling, self.adapter_of(req))
            out = list(zip(generated.completion_ids, generated.logprobs, generated.finish_reasons))
            if generated.weight_version == version:
                break
        answer = Answer(False, self.model_name, self.tokenizer).response(out, rows, version)
        return add_prompt_scores(answer, req, ids, scores, alternatives, self.tokenizer)

    def chat_completions(self, body: ChatCompletionRequest | dict) -> dict:
        """Answer a chat completions request (not streamed) as OpenAI's JSON; blocks until generated."""
        req = _validated(ChatCompletionRequest, body)
        prompt = self.chat_prompt_ids(req)
        prompts, sampling = self.prepare(req, [prompt], self._chat_max_tokens(req, prompt))
        out = self.batcher.generate(prompts, sampling, self.adapter_of(req))
        return Answer(True, self.model_name, self.tokenizer, logprobs=req.logprobs).response(
            list(zip(out.completion_ids, out.logprobs, out.finish_reasons)), prompts, out.weight_version)

    def stream(self, body: SamplingRequest, chat: bool) -> Callable[[threading.Event], Iterator[dict]]:
        """Check a streamed request and return what produces its chunks (see :mod:`hf_verl.serve.streaming`);
        a bad request raises here, before the stream starts."""
        if self.adapters.names:
            raise ServeError(400, "stream=true is not supported while LoRA adapters are loaded on hf-verl serve; "
                                  "send the request without stream", "stream")
        if chat:
            req = _validated(ChatCompletionRequest, body)
            prompt = self.chat_prompt_ids(req)
            prompts, sampling = self.prepare(req, [prompt], self._chat_max_tokens(req, prompt))
            answer = Answer(True, self.model_name, self.tokenizer, logprobs=req.logprobs)
        else:
            req = _validated(CompletionRequest, body)
            prompts, sampling = self.prepare(req, self.prompt_ids(req.prompts), req.max_tokens or 16)
            answer = Answer(False, self.model_name, self.tokenizer)
        return lambda cancel: self._chunks(answer, req, prompts, sampling, cancel)

    def adapter_of(self, req: SamplingRequest) -> str | None:
        """The loaded LoRA adapter a request names as its `model` (None: the base model, adapters off)."""
        return req.model if req.model in self.adapters.names else None

    def _chunks(self, answer: Answer, req: SamplingRequest, prompts: list[list[int]], sampling: SamplingParams,
                cancel: threading.Event) -> Iterator[dict]:

        if steppable(self.engine):
            deltas = stepped_deltas(self.engine, self.lock, self.tokenizer, prompts, sampling, cancel)
        else:
            deltas = whole_deltas(self.batcher.generate, self.tokenizer, prompts, sampling)
        started, generated, prompt_tokens = set(), 0, sum(len(p) for p in prompts)
        with contextlib.closing(deltas):
            for step, version in deltas:
                for delta in step:
                    chunk = answer.chunk(delta, None if delta.row in started else prompts[delta.row], version)
                    started.add(delta.row)
                    generated += delta.token_id is not None
                    if req.continuous_usage:
                        chunk["usage"] = usage(prompt_tokens, generated)
                    yield chunk
        if req.include_usage and not cancel.is_set():
            yield answer.usage_chunk(usage(prompt_tokens, generated))

    # ------------------------------------------------------------------ request checks
    def prepare(self, req: SamplingRequest, prompts: list[list[int]],
                max_new_tokens: int) -> tuple[list[list[int]], SamplingParams]:
        """Check `req` against the served names and the caps; return the rows (each prompt `n` times) and
        the sampling parameters."""
        if req.model is not None and req.model not in self.served_model_names + self.adapters.names:
            raise ServeError(404, f"The model `{req.model}` does not exist. This server serves "
                                  f"{', '.join(repr(m) for m in self.served_model_names + self.adapters.names)}.",
                             "model")
        if req.n > self.max_n:
            raise ServeError(400, f"n={req.n} exceeds this server's cap of {self.max_n} completions per prompt", "n")
        if max_new_tokens > self.max_tokens:
            raise ServeError(400, f"max_tokens={max_new_tokens} exceeds this server's cap of {self.max_tokens}",
                             "max_tokens")
        if len(prompts) > self.max_prompts:
            raise ServeError(400, f"{len(prompts)} prompts exceed this server's cap of {self.max_prompts} per "
                                  "request", "prompt")
        vocab = self._vocab_size()
        if any(t >= vocab for p in prompts for t in p):
            raise ServeError(400, f"prompt token ids must be below the vocabulary size {vocab}", "prompt")
        try:
            sampling = req.sampling(max_new_tokens)
        except ValueError as err:
            raise ServeError(400, f"bad sampling parameters: {err}") from None
        return [p for p in prompts for _ in range(req.n)], sampling

    def prompt_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt (text is tokenized as the tokenizer does by default)."""
        out = []
        for item in prompts:
            if isinstance(item, str):
                with self._encode_lock:
                    item = self.tokenizer(item)["input_ids"]
                if not item:
                    raise ServeError(400, "a text prompt encodes to no tokens", "prompt")
            out.append(list(item))
        return out

    def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The messages rendered by the tokenizer's chat template, as token ids."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ServeError(400, "this model's tokenizer has no chat template, so /v1/chat/completions cannot "
                                  "render messages: send a formatted prompt to /v1/completions, or serve a "
                                  "tokenizer with a `chat_template`", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.for_template() for m in req.messages], tokenize=False,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
        except Exception as err:  # noqa: BLE001 (jinja and template errors: the messages do not fit the template)
            raise ServeError(400, f"the chat template cannot render these messages ({type(err).__name__}: {err})",
                             "messages") from None
        with self._encode_lock:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own
        if not ids:
            raise ServeError(400, "the chat template rendered the messages as no tokens", "messages")
        return ids

    def _chat_max_tokens(self, req: ChatCompletionRequest, prompt: list[int]) -> int:
        """`max_completion_tokens` or `max_tokens`; else what the context leaves, at most the server's cap."""
        asked = req.max_completion_tokens or req.max_tokens
        if asked:
            return asked
        config = getattr(getattr(self.engine, "model", None), "config", None)
        context = getattr(config, "max_position_embeddings", None)
        return self.max_tokens if not context else max(1, min(self.max_tokens, context - len(prompt)))

    def _vocab_size(self) -> int:
        model = getattr(self.engine, "model", None)
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        return getattr(embeddings, "num_embeddings", None) or len(self.tokenizer)
