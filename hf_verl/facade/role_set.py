"""`FacadeRoles`: the facade's roles, loaded on first use and built by the role builder the trainers use.

The facade takes its roles as arguments (a Hub id, a path, a model object, an engine, a URL in `placement`) and
loads nothing at construction: the launch's layout is decided on first use (the planner's, with
`config.parallel="auto"`; Megatron with `config.backend="megatron"`), then each role's model is loaded for its
layout (sharded under FSDP2 / ZeRO-3) and handed to :class:`~hf_verl.pipeline.role_builder.RoleBuilder`, which
makes its engine, the served reference, the generator (its weight-update token from `HF_VERL_SERVE_TOKEN`) and the
reward models' placement exactly as for `GRPOTrainer` / `PPOTrainer`.

Also here: the actor's tokenizer, the vocabulary checks between roles, and the re-tokenisation of a reference on
another tokenizer (:class:`~hf_verl.pipeline.cross_tokenizer.CrossTokenizer`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from hf_verl.data.prompts import ensure_pad_token
from hf_verl.data.vision import text_tokenizer
from hf_verl.engine.registry import ENGINES, launch_role_layout
from hf_verl.engine.step import OptimizerSpec
from hf_verl.facade.roles import LazyModel, vocab_size
from hf_verl.parallel import watchdog
from hf_verl.pipeline.cross_tokenizer import CrossTokenizer, same_tokenizer
from hf_verl.pipeline.placement import check_placement
from hf_verl.pipeline.role_builder import RoleBuilder
from hf_verl.rollout.base import RolloutEngine

logger = logging.getLogger(__name__)

MODEL_ROLES = ("actor", "critic", "reference")


class FacadeRoles:
    """The facade's roles (see the module docstring).

    Args:
        config ([`TrainerConfig`]): the facade's live config (device, dtype, layout and optimizer settings).
        actor_model / critic_model / reference_model: as the facade's constructor takes them.
        tokenizer / reference_tokenizer (*optional*): the actor's and the reference's tokenizers.
        rollout_engine ([`RolloutEngine`] or `str`, *optional*): an engine object, or a registered engine's name.
        placement (`dict`, *optional*): where roles run (:mod:`hf_verl.pipeline.placement`).
        reward_funcs (`list`): the resolved reward sources (reward models are placed beside the actor).
    """

    def __init__(self, config: Any, *, actor_model: Any, critic_model: Any, reference_model: Any, tokenizer: Any,
                 reference_tokenizer: Any, rollout_engine: Any, placement: Any, reward_funcs: list) -> None:
        self.config, self.reward_funcs = config, reward_funcs
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.placement = check_placement(placement, has_reference=reference_model is not None,
                                         has_critic=critic_model is not None, world_size=world,
                                         engines=tuple(ENGINES))
        self.builder = RoleBuilder(None, self.placement, accelerator=None, engine_options=self._engine_options)
        if isinstance(actor_model, RolloutEngine):
            rollout_engine, actor_model = actor_model, getattr(actor_model, "model", None)
            if actor_model is None:
                raise ValueError(f"the actor engine {type(rollout_engine).__name__} has no `.model` to train; pass "
                                 "the model as actor_model and the engine as rollout_engine=.")
        if self.builder.remote_url("generator") is not None and isinstance(rollout_engine, RolloutEngine):
            raise ValueError("placement['generator'] is a URL but a rollout engine was given too: pass one of them.")
        place = {"device": config.device, "dtype": config.dtype}
        self.actor = LazyModel("actor", actor_model, "causal_lm", **place)
        self.critic = None if critic_model is None else LazyModel("critic", critic_model, "value", **place)
        self.reference = None if reference_model is None else LazyModel("reference", reference_model, "causal_lm",
                                                                        **place)
        self.remote_reference = self.builder.reference()  # a served reference (None: a model, or adapters off)
        self._engine_spec = rollout_engine  # an engine, a registered name, or None (chosen from the placement)
        self._engine: RolloutEngine | None = rollout_engine if isinstance(rollout_engine, RolloutEngine) else None
        self._tokenizer, self._reference_tokenizer = tokenizer, reference_tokenizer
        self._cross: CrossTokenizer | None | bool = False  # False: not decided yet
        self._layout = None  # (RoleLayout, accelerator), decided on first use
        self._replica = None  # a whole copy of a sharded actor, for the default generator
        self.engines: dict[str, Any] = {}
        self.sharded_rewards = 0
        self.layout_plan = None  # the planner's Plan when config.parallel / model_size asked for one
        for role in self.models():
            role.on_load.append(lambda _role: self.check_vocab())
        self.check_vocab()

    def models(self) -> list[LazyModel]:
        return [r for r in (self.actor, self.critic, self.reference) if r is not None]

    def role(self, name: str) -> LazyModel | None:
        return {"actor": self.actor, "critic": self.critic, "reference": self.reference}[name]

    # ------------------------------------------------------------------ the launch's layout
    def launch(self):
        """The launch's default [`RoleLayout`] and its accelerator (decided once, on first use)."""
        if self._layout is None:
            from datetime import timedelta

            from accelerate import Accelerator
            from accelerate.utils import InitProcessGroupKwargs

            from hf_verl.parallel.backend import check_accelerate_parallelism
            from hf_verl.parallel.megatron.launch import resolve_expert_parallel_size, resolve_megatron_settings

            check_accelerate_parallelism()  # before accelerate builds groups of its own
            self._plan_layout()
            cfg = self.config
            backend, tp, pp = resolve_megatron_settings(  # an accelerate MEGATRON_LM launch is hf_verl's to run
                "TrainerConfig", cfg.backend, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                cfg.sequence_parallel_size)
            ep = resolve_expert_parallel_size("TrainerConfig", backend, cfg.expert_model_parallel_size)
            accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[
                InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout))])
            # a rank stalled past ddp_timeout is named instead of hanging; the process group is left cleanly at exit
            watchdog.start(cfg.ddp_timeout)
            layout = launch_role_layout(accelerator.num_processes, sequence_parallel_size=cfg.sequence_parallel_size,
                                        tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel_size=ep,
                                        engine="megatron" if backend == "megatron" else None)
            self.builder.launch, self.builder.accelerator = layout, accelerator
            self._layout = (layout, accelerator)
        return self._layout

    @property
    def launched(self) -> bool:
        return self._layout is not None

    def _plan_layout(self) -> None:
        """`config.parallel="auto"`, or a `config.model_size` set with `parallel` left at None: the planner's layout
        for this launch, written into the config before any role is loaded (:mod:`hf_verl.planner.apply`);
        an explicit layout wins and the log says so."""
        cfg = self.config
        if cfg.parallel == "manual" or (cfg.parallel is None and cfg.model_size is None):
            return
        from hf_verl.planner.apply import apply_facade_plan

        self.layout_plan = apply_facade_plan(cfg, cfg.model_size if cfg.model_size is not None else self.actor.source)

    @property
    def dims(self):
        return self.launch()[0].dims

    def layout(self, name: str):
        """The [`RoleLayout`] role `name` runs on: the launch's, or its placement's over the launch's processes."""
        self.launch()
        return self.builder.layout(name)

    # ------------------------------------------------------------------ models and engines
    def model(self, name: str) -> torch.nn.Module:
        """Role `name`'s model; loaded for its layout under a multi-process launch (sharded where that applies)."""
        role = self.role(name)
        if role.loaded or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return role.get()
        return role.get(layout=self.layout(name))

    def engine(self, name: str):
        """The training engine of role `name` ("actor", "critic", "reference"; the reference may be served), made
        on first use; None for a role not given."""
        if name == "reference" and self.remote_reference is not None:
            return self.remote_reference
        role = self.role(name)
        if role is None:
            return None
        if name not in self.engines:
            _, accelerator = self.launch()
            layout = self.layout(name)
            model = role.get(layout=layout)  # an id or path loads sharded under FSDP2 / ZeRO-3 over 2+ shards
            if name == "actor" and self._engine is None and self.builder.remote_url("generator") is None:
                self._replica = self.builder.actor_replica(model, accelerator.device)  # before the actor is sharded
            engine = self.builder.engine(model, name, trainable=name != "reference")
            self.engines[name] = engine
            if name != "reference":
                engine.configure_optimizer(self.optimizer_spec(name))
            if name == "actor":  # reward models shard with the policy; loading them is a main-thread step
                self.sharded_rewards = self.builder.place_rewards(self.reward_funcs,
                                                                  async_rollout=self.config.use_async_rollout)
        return self.engines[name]

    def _engine_options(self, role: str, trainable: bool) -> dict:
        cfg = self.config
        options = {"seed": cfg.seed, "micro_batch_size": cfg.rollout_batch_size * cfg.num_generations,
                   "max_grad_norm": cfg.max_grad_norm}
        if role == "critic":
            options["pad_token_id"] = self.tokenizer.pad_token_id
        return options

    def optimizer_spec(self, name: str) -> OptimizerSpec:
        """AdamW over every trainable parameter (`critic_learning_rate` for the critic), clipping to
        `max_grad_norm`, a constant learning rate (changed live through `trainer.config`)."""
        cfg = self.config
        lr = cfg.learning_rate if name == "actor" else (cfg.critic_learning_rate or cfg.learning_rate)
        return OptimizerSpec(torch.optim.AdamW, {"lr": lr}, weight_decay=cfg.weight_decay,
                             max_grad_norm=cfg.max_grad_norm)

    @property
    def generator(self) -> RolloutEngine:
        """The rollout engine, built on first use by the role builder (on the actor's weights, a replica of a
        sharded actor, or a server)."""
        actor = self.engine("actor")
        if self._engine is None:
            cfg = self.config
            self._engine = self.builder.generator(
                cfg, actor=actor, replica=self._replica, tokenizer=self.tokenizer, engine=self._engine_spec,
                max_new_tokens=cfg.max_completion_length, seed=cfg.seed + self.dims.dp_rank)
        return self._engine

    @property
    def generator_given(self) -> RolloutEngine | None:
        """The engine object the user handed in (None until one is built otherwise)."""
        return self._engine

    # ------------------------------------------------------------------ tokenizers
    @property
    def tokenizer(self):
        """The actor's tokenizer (loaded on first access when the actor was given by id)."""
        if self._tokenizer is None:
            if self._engine is not None and getattr(self._engine, "tokenizer", None) is not None:
                self._tokenizer = self._engine.tokenizer
            else:
                source = self.actor.source if isinstance(self.actor.source, str) else self.actor.name
                if not isinstance(source, str) or not source or source == type(self.actor.get()).__name__:
                    raise ValueError("the actor was given as an object without a Hub id: pass tokenizer=.")
                from transformers import AutoTokenizer

                self.model("actor")  # fails first, naming the role, when the id cannot be resolved
                self._tokenizer = AutoTokenizer.from_pretrained(source)
            ensure_pad_token(text_tokenizer(self._tokenizer))
        return text_tokenizer(self._tokenizer)  # a vision-language model's processor holds its tokenizer

    @property
    def processor(self):
        """The processor given as `tokenizer=` when it has an image processor (rows with images are tokenised
        through it, :mod:`hf_verl.data.vision`), else None."""
        given = self._tokenizer
        return given if getattr(given, "image_processor", None) is not None else None

    def tokenizer_at_hand(self) -> bool:
        return self._tokenizer is not None or getattr(self._engine, "tokenizer", None) is not None

    def check_vocab(self) -> None:
        """A critic, and a reference on the actor's tokenizer, read the actor's token ids: their embeddings must
        agree with the actor's. A reference on another tokenizer (decided from the tokenizers, not from sizes) reads
        its own re-tokenised ids and is not checked here."""
        if not self.actor.loaded:
            return
        actor_v = vocab_size(self.actor.get())
        for role in (self.reference, self.critic):
            if role is not None and role.loaded:
                if role is self.reference and self._reference_tokenizer_known() and self.cross():
                    continue
                other = vocab_size(role.get())
                if None not in (actor_v, other) and actor_v != other:
                    hint = (" or, if it has another tokenizer, pass reference_tokenizer= (it is then scored on the "
                            "re-tokenised text)") if role is self.reference else ""
                    raise ValueError(
                        f"the actor ({self.actor.name}) has a vocabulary of {actor_v} tokens but the {role.role} "
                        f"({role.name}) has {other}: the {role.role} reads the actor's token ids, so both need "
                        f"the same tokenizer and embedding size{hint}."
                    )

    def _reference_tokenizer_known(self) -> bool:
        """Whether both tokenizers can be had without loading from an object that has no id."""
        ref_ok = self._reference_tokenizer is not None or (self.reference is not None
                                                           and isinstance(self.reference.source, str))
        actor_ok = self.tokenizer_at_hand() or isinstance(self.actor.source, str)
        return ref_ok and actor_ok

    def cross(self) -> CrossTokenizer | None:
        """The re-tokenisation of a reference on another tokenizer, or None when it shares the actor's (decided
        once, from the tokenizers: :func:`~hf_verl.pipeline.cross_tokenizer.same_tokenizer`)."""
        if self._cross is False:
            self._cross = None
            if (self.reference is not None or self.remote_reference is not None) and \
                    self._reference_tokenizer_known():
                if self._reference_tokenizer is None:
                    from transformers import AutoTokenizer

                    self._reference_tokenizer = AutoTokenizer.from_pretrained(self.reference.source)
                if not same_tokenizer(self.tokenizer, self._reference_tokenizer):
                    self._cross = CrossTokenizer(self.tokenizer, self._reference_tokenizer, role="reference")
                    logger.info("the reference (%s) has another tokenizer than the actor: it scores the decoded text "
                                "re-tokenised with its own, aligned to the actor's tokens by character offsets",
                                self.remote_reference.url if self.reference is None else self.reference.name)
        return self._cross
