"""The registry of rollout engines: the names a front-end chooses its generator by.

Every built-in engine registers here as a user's would, and both front-ends build theirs through
:func:`make_rollout_engine` (the trainers from `rollout_engine=` / `use_vllm` / `vllm_mode`, the facade from
`rollout_engine=` / `placement["generator"]`); an engine object is always accepted as it is.

| name | engine | generates with |
|---|---|---|
| `transformers` | :class:`~hf_verl.rollout.hf_engine.TransformersEngine` | the actor's own tensors, or a replica of a sharded actor |
| `vllm` | :class:`~hf_verl.rollout.vllm_engine.VLLMEngine` | in-process vLLM on a copy of the actor, kept in step by bucketed weight sync |
| `remote` | :class:`~hf_verl.rollout.remote.RemoteEngine` | an OpenAI-compatible `/v1/completions` server (`hf-verl serve`, `vllm serve`) |
| `fleet` | :class:`~hf_verl.rollout.fleet.FleetEngine` | several `hf-verl serve` servers as one (a list of URLs), surviving a server's death and restart |

A factory takes one :class:`RolloutEngineContext` and returns a
:class:`~hf_verl.rollout.base.RolloutEngine`:

```python
from hf_verl.rollout import RolloutEngineContext, register_rollout_engine


@register_rollout_engine("my_engine")
def my_engine(context: RolloutEngineContext):
    return MyEngine(context.model, context.tokenizer, seed=context.seed)

# GRPOConfig(rollout_engine="my_engine", ...)   or   hf_verl.Trainer(..., rollout_engine="my_engine")
```

The weight-update token of a server engine comes from :data:`SERVE_TOKEN_ENV` (`HF_VERL_SERVE_TOKEN`), the
variable `hf-verl serve` reads, unless the context carries one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_verl.rollout.base import RolloutEngine

SERVE_TOKEN_ENV = "HF_VERL_SERVE_TOKEN"
"""The environment variable holding the bearer token of weight-changing requests: `hf-verl serve` requires it,
every engine hf_verl builds for a server sends it."""


@dataclass
class RolloutEngineContext:
    """What a rollout-engine factory is built from.

    Attributes:
        model (`torch.nn.Module`, *optional*): the weights to generate with (the actor's own tensors, or a whole
            replica of a sharded actor); None for a server.
        tokenizer: the actor's tokenizer.
        settings: the front-end's config (sampling, `generation_kwargs`, vLLM and server fields), read as needed.
        url (`str`, *optional*): a server's base URL (a fleet's first).
        urls (`tuple[str, ...]`): every server's base URL (a fleet, `placement={"generator": [url, ...]}`).
        token (`str`, *optional*): the server's weight-update token; default: the `HF_VERL_SERVE_TOKEN` variable.
        seed (`int`): this rank's sampling seed.
        max_new_tokens (`int`, *optional*): the completion limit (a colocated engine sizes its context from it).
        autocast_dtype (`torch.dtype`, *optional*): mixed precision of a transformers engine's forwards.
    """

    model: Any = None
    tokenizer: Any = None
    settings: Any = None
    url: str | None = None
    urls: tuple[str, ...] = ()
    token: str | None = None
    seed: int = 0
    max_new_tokens: int | None = None
    autocast_dtype: Any = None

    def setting(self, name: str, default: Any = None) -> Any:
        """A field of the front-end's config, or `default` where it has none."""
        return getattr(self.settings, name, default) if self.settings is not None and hasattr(self.settings, name) \
            else default

    @property
    def weight_token(self) -> str | None:
        return self.token if self.token is not None else (os.environ.get(SERVE_TOKEN_ENV) or None)


ROLLOUT_ENGINES: dict[str, Callable[[RolloutEngineContext], RolloutEngine]] = {}
"""Every registered rollout engine factory by name (the built-ins and the user's)."""


def register_rollout_engine(name: str, *, replace: bool = False) -> Callable[[Callable], Callable]:
    """Register `factory(context: RolloutEngineContext) -> RolloutEngine` under `name` (a decorator).

    Raises:
        ValueError: `name` is taken (without `replace=True`).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a rollout engine is registered under a non-empty string name, got {name!r}.")

    def decorate(factory: Callable) -> Callable:
        if name in ROLLOUT_ENGINES and not replace:
            raise ValueError(f"a rollout engine named {name!r} is already registered; pass replace=True to replace it.")
        ROLLOUT_ENGINES[name] = factory
        return factory

    return decorate


def make_rollout_engine(name: str, context: RolloutEngineContext) -> RolloutEngine:
    """The rollout engine registered as `name`, built from `context`.

    Raises:
        ValueError: an unknown name (listing the registered ones), or a factory that returned no engine.
    """
    factory = ROLLOUT_ENGINES.get(name)
    if factory is None:
        raise ValueError(f"unknown rollout engine {name!r}; choose one of {sorted(ROLLOUT_ENGINES)}, pass an engine "
                         "object, or register your own with @hf_verl.rollout.register_rollout_engine(name).")
    engine = factory(context)
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"rollout engine factory {name!r} returned {type(engine).__name__}, not a RolloutEngine.")
    return engine


@register_rollout_engine("transformers")
def _transformers(context: RolloutEngineContext) -> RolloutEngine:
    from hf_verl.rollout.base import split_generation_kwargs
    from hf_verl.rollout.hf_engine import TransformersEngine

    if context.model is None:
        raise ValueError("the transformers rollout engine needs a model to generate with.")
    return TransformersEngine(
        context.model, context.tokenizer, cache_implementation=context.setting("cache_implementation"),
        generate_kwargs=split_generation_kwargs(context.setting("generation_kwargs"))[1],
        autocast_dtype=context.autocast_dtype)


@register_rollout_engine("vllm")
def _vllm(context: RolloutEngineContext) -> RolloutEngine:
    from hf_verl.rollout.vllm_engine import VLLMEngine, colocate_max_model_len

    model = context.model
    if model is None:
        raise ValueError("the in-process vLLM engine needs a model to copy (the actor, or its replica).")
    length = colocate_max_model_len(context.settings, model.config, context.max_new_tokens or 512)
    return VLLMEngine.from_model(
        model, context.tokenizer, dtype=str(model.dtype).replace("torch.", ""), max_model_len=length,
        gpu_memory_utilization=context.setting("vllm_gpu_memory_utilization", 0.3),
        tensor_parallel_size=context.setting("vllm_tensor_parallel_size", 1),
        enable_sleep_mode=context.setting("vllm_enable_sleep_mode", False), seed=context.seed,
        model_impl=context.setting("vllm_model_impl", "vllm"),
        structured_outputs_regex=context.setting("vllm_structured_outputs_regex"),
        record_routing=bool(context.setting("router_replay", False)),
        enable_lora=context.setting("weight_sync") == "adapter",  # adapter-only sync: vLLM's LoRA slot
        trust_remote_code=context.setting("trust_remote_code", False))


@register_rollout_engine("remote")
def _remote(context: RolloutEngineContext) -> RolloutEngine:
    from hf_verl.rollout.remote import RemoteEngine

    if not context.url:
        raise ValueError("the remote rollout engine needs a server URL (placement={'generator': url}, or "
                         "use_vllm=True with vllm_mode='server' and vllm_server_base_url).")
    return RemoteEngine(context.url, token=context.weight_token,
                        timeout_s=context.setting("vllm_server_timeout", 240.0))


@register_rollout_engine("fleet")
def _fleet(context: RolloutEngineContext) -> RolloutEngine:
    from hf_verl.rollout.fleet import FleetEngine

    urls = context.urls or ((context.url,) if context.url else ())
    if not urls:
        raise ValueError("the fleet rollout engine needs its servers' URLs: placement={'generator': [url, ...]}.")
    return FleetEngine(urls, token=context.weight_token, timeout_s=context.setting("vllm_server_timeout", 240.0))
