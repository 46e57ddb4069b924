"""`RoleBuilder`: every role's engine built one way, for both front-ends.

The TRL-style trainers and the facade declare their roles differently (TRL's constructor arguments and a
`TrainingArguments` config; the facade's role arguments, loaded lazily), but the same builder turns them into
engines: each model role (actor, critic, reference) gets its layout (the launch's, or its own backend from
`placement`) and a training engine from the registry (:func:`~hf_verl.engine.registry.make_engine`); a reference
given by URL becomes a :class:`~hf_verl.engine.remote_reference.RemoteReference`; the generator becomes a rollout
engine from the registry (:func:`~hf_verl.rollout.registry.make_rollout_engine`: `transformers` on the actor's own
tensors or on a replica of a sharded actor, in-process `vllm`, `remote` for a URL, whose weight-update token is
`HF_VERL_SERVE_TOKEN`, or `fleet` for a list of URLs); reward models are placed beside the actor (sharded with it
under FSDP2 / ZeRO-3).

`placement` is `{role: choice}` as :func:`~hf_verl.pipeline.placement.check_placement` validates it (the facade's
`placement=` and the trainer configs' `placement` field alike; docs/placement.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from hf_verl.engine.registry import RoleLayout, make_engine
from hf_verl.moe.routing import is_moe_model
from hf_verl.parallel.sharded_load import loaded_sharded, reference_copy, whole_copy
from hf_verl.pipeline.placement import BACKENDS, COLOCATED, is_url
from hf_verl.pipeline.prefetch import frozen_copy
from hf_verl.pipeline.rewards import place_reward_models
from hf_verl.rollout.base import RolloutEngine
from hf_verl.rollout.registry import RolloutEngineContext, make_rollout_engine

logger = logging.getLogger(__name__)


class RoleBuilder:
    """Builds the roles of one run (see the module docstring).

    Args:
        launch ([`RoleLayout`]): the launch's layout, which every colocated role runs on.
        placement (`Mapping[str, str]`): the validated placement (`"colocated"` for every role not declared).
        accelerator: the run's `accelerate.Accelerator` (engines wrap DDP through it).
        engine_options (`Callable[[str, bool], dict]`): the front-end's engine options for a role (`micro_batch_size`,
            `max_grad_norm`, mixed precision, checkpointing, ...), given the role and whether it trains.
    """

    def __init__(self, launch: RoleLayout, placement: Mapping[str, str], *, accelerator: Any,
                 engine_options: Callable[[str, bool], dict]) -> None:
        self.launch, self.placement, self.accelerator = launch, dict(placement), accelerator
        self.engine_options = engine_options

    # ------------------------------------------------------------------ layouts
    def layout(self, role: str) -> RoleLayout:
        """The layout `role` runs on: the launch's, or its own backend over the launch's processes."""
        choice = self.placement.get(role, COLOCATED)
        if choice in BACKENDS and self.launch.dims.world_size > 1:
            return replace(self.launch.with_backend(BACKENDS[choice]), colocated=False)
        return self.launch

    def remote_url(self, role: str) -> str | tuple[str, ...] | None:
        """The URL `role` is served at, when placed behind one (a generator fleet's URLs, as a tuple)."""
        choice = self.placement.get(role, COLOCATED)
        return choice if isinstance(choice, tuple) or is_url(choice) else None

    # ------------------------------------------------------------------ model roles
    def engine(self, model: Any, role: str, *, trainable: bool, **extra: Any):
        """The training engine of `role` over `model` on its layout."""
        options = {**self.engine_options(role, trainable), **extra}
        return make_engine(model, role, self.layout(role), accelerator=self.accelerator, trainable=trainable,
                           **options)

    def reference(self, model: Any = None, *, trainable: bool = False, role: str = "reference"):
        """The reference: a served one when placed behind a URL (:class:`RemoteReference`), else an engine over
        `model`, else None (the actor with its adapters off). `role="teacher"`: distillation's teacher, placed and
        built the same way."""
        url = self.remote_url(role)
        if url is not None:
            from hf_verl.engine.remote_reference import RemoteReference

            return RemoteReference(url, role=role)
        if model is None:
            return None
        return self.engine(model, role, trainable=trainable)

    def reference_model(self, actor_model: Any, *, bf16: bool = False, fp16: bool = False) -> Any:
        """A frozen copy of the actor to serve as the reference, made before the actor is laid out: loaded sharded
        for the reference's layout when the actor was, else a detached copy. None when the reference is served."""
        if self.remote_url("reference") is not None:
            return None
        if loaded_sharded(actor_model):
            return reference_copy(actor_model, self.layout("reference"), bf16=bf16, fp16=fp16)
        return frozen_copy(actor_model)

    def actor_replica(self, actor_model: Any, device: Any = "cpu") -> Any:
        """A whole replica of the actor to generate with when its layout partitions parameters (FSDP2, ZeRO-3: no
        rank holds the model whole), made before the actor is laid out and kept in step by weight sync; None when
        the actor's own tensors can generate."""
        if not self.launch.backend.partitions_parameters:
            return None
        return whole_copy(actor_model, device) if loaded_sharded(actor_model) else frozen_copy(actor_model)

    def place_rewards(self, reward_funcs: list, *, async_rollout: bool) -> int:
        """Reward models placed beside the actor: loaded now, sharded with it under FSDP2 / ZeRO-3 (frozen engines);
        returns how many were sharded."""
        layout = self.launch
        return place_reward_models(
            reward_funcs, layout.backend, async_rollout=async_rollout,
            make_engine=lambda m: make_engine(m.to(self.accelerator.device), "reward", layout,
                                              accelerator=self.accelerator, trainable=False,
                                              **self.engine_options("reward", False)))

    # ------------------------------------------------------------------ the generator
    def generator(self, settings: Any, *, actor: Any, replica: Any = None, tokenizer: Any = None,
                  engine: RolloutEngine | str | None = None, max_new_tokens: int | None = None, seed: int = 0,
                  autocast_dtype: Any = None) -> RolloutEngine:
        """The rollout engine: `engine` when it is an engine object; else the registered engine named by `engine`,
        or chosen from the placement and the settings: `remote` for a generator URL (`placement["generator"]`, or
        TRL's `use_vllm=True, vllm_mode="server"` fields), `fleet` for a list of URLs, `vllm` for TRL's
        `use_vllm=True` colocated, else `transformers` on the actor's own tensors (on `replica` for a sharded actor).

        Raises:
            ValueError: a URL generator together with an engine object or a non-remote engine name.
        """
        served = self.remote_url("generator") or _trl_server_url(settings)
        urls = served if isinstance(served, tuple) else (served,) if served else ()
        url = urls[0] if urls else None
        if isinstance(engine, RolloutEngine):
            if self.remote_url("generator") is not None:
                raise ValueError("placement['generator'] is a URL but a rollout engine was given too: pass one of "
                                 "them.")
            configure_router_replay(settings, actor, engine)
            return engine
        name = engine or ("fleet" if len(urls) > 1 else "remote" if url else
                          "vllm" if getattr(settings, "use_vllm", False) else "transformers")
        if url is None and name == "remote":
            raise ValueError("rollout_engine='remote' needs the server's URL: placement={'generator': url}.")
        if len(urls) > 1 and name == "remote":
            raise ValueError(f"rollout_engine='remote' serves one URL but placement['generator'] lists {len(urls)}: "
                             "drop rollout_engine (a list gives the 'fleet' engine) or name 'fleet'.")
        model = None
        if name not in ("remote", "fleet"):
            model = replica if replica is not None else actor.rollout_model()
        context = RolloutEngineContext(model=model, tokenizer=tokenizer, settings=settings, url=url, urls=urls,
                                       seed=seed, max_new_tokens=max_new_tokens, autocast_dtype=autocast_dtype)
        built = make_rollout_engine(name, context)
        built.weight_sync_mode = getattr(settings, "weight_sync", "auto") or "auto"
        configure_router_replay(settings, actor, built)
        where = ", ".join(urls) or ("a replica of the actor" if replica is not None else
                                    "the actor's own weights" if name == "transformers" else "a copy of the actor")
        logger.info("rollout engine: %s (%s)", name, where)
        return built


def configure_router_replay(settings: Any, actor: Any, rollout: RolloutEngine) -> None:
    """`router_replay=True`: the rollout engine records the experts each token is routed to, and the actor's
    forwards route every token to them (:mod:`hf_verl.moe.routing`).

    Raises:
        ValueError: a dense actor (nothing to replay), or an actor engine that cannot replay.
    """
    if not getattr(settings, "router_replay", False):
        return
    model = getattr(actor, "model", None)
    if model is None or not is_moe_model(model):
        raise ValueError(f"router_replay=True needs a Mixture-of-Experts actor; {type(model).__name__} has no top-k "
                         "routers (a dense model routes nothing): set router_replay=False.")
    if not hasattr(actor, "router_replay"):
        raise ValueError(f"router_replay=True runs on the accelerate engines (one process, DDP, FSDP2, ZeRO); the "
                         f"{type(actor).__name__} cannot replay routing yet: set router_replay=False or use another "
                         "backend.")
    actor.router_replay = True
    rollout.record_routing = True
    logger.info("routing replay: %s records each token's experts, the actor's forwards route by them",
                type(rollout).__name__)


def _trl_server_url(settings: Any) -> str | None:
    """TRL's server fields: the URL of `use_vllm=True, vllm_mode="server"`, else None."""
    if not (getattr(settings, "use_vllm", False) and getattr(settings, "vllm_mode", "colocate") == "server"):
        return None
    return settings.vllm_server_base_url or f"http://{settings.vllm_server_host}:{settings.vllm_server_port}"
