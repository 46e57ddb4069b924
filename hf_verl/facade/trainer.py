"""`Trainer`: the role-level facade for writing the RL loop by hand.

```python
trainer = Trainer(actor_model="Qwen/Qwen2.5-0.5B", reward_model=my_reward_fn, config={"num_generations": 8})
for batch in loader:
    rollout = trainer.rollout(batch)       # generate, score, reference, critic, advantages
    loss = trainer.compute_loss(rollout)   # PPO clip (+ value, KL, entropy terms)
    metrics = trainer.step(loss)           # backward, clip, optimizer steps, weight sync
```

The facade is a front-end of the same machinery as the TRL-style trainers: every role is a
training engine (:mod:`hf_verl.engine`, laid out by the launch's backend: one process, DDP, FSDP2
or ZeRO, `accelerate launch` as for the trainers), and every phase is a function of
:mod:`hf_verl.pipeline` (generation and scoring, reference / old log-probs, critic values,
advantages over the data-parallel round, the policy and value losses, weight sync, prefetching).
It adds only the loop API: roles that load lazily (:mod:`hf_verl.facade.roles`), a validated live
:class:`~hf_verl.facade.config.TrainerConfig` with the trainers' vocabulary, trace ids and debug
records (:mod:`hf_verl.facade.debug`), and asynchronous rollout over the user's batches
(`rollout()` / `rollouts(batches)`, through the trainers' :mod:`hf_verl.pipeline.orchestrator` on the worker of
:mod:`hf_verl.pipeline.prefetch`).

Departures from TRL's PPO: the KL to the reference is always a loss term (GRPO style,
`kl_estimator`, default k3), also with GAE, where TRL's PPO puts it into the token rewards; old
log-probs are always recomputed by the actor when a rollout is handed out (exact PPO ratios
whatever the engine and however stale the rollout).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import replace
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from hf_verl.data.prompts import check_prompt_column, ensure_pad_token
from hf_verl.data.batch import LossInputs
from hf_verl.engine.base import TrainingEngine
from hf_verl.engine.registry import ENGINES, launch_role_layout, make_engine
from hf_verl.engine.step import LogProbs, OptimizerSpec, PolicyOutput, Values
from hf_verl.facade.config import CRITIC_FREE_CHOICES, TrainerConfig
from hf_verl.facade.debug import (
    DEFAULT_DEBUG_FILE,
    DebugRecorder,
    TraceLogger,
    current_trace_id,
    new_trace_id,
    peak_memory_mb,
    trace,
)
from hf_verl.facade.placement import BACKENDS, COLOCATED, check_placement, memory_estimate, placement_line
from hf_verl.facade.roles import LazyModel, model_device_dtype, vocab_size
from hf_verl.facade.rollout import COLUMN_PREFIX, Rollout
from hf_verl.parallel import comm, watchdog
from hf_verl.parallel.capabilities import parallelism_report, supported_parallelisms
from hf_verl.pipeline import generation, losses, phases
from hf_verl.pipeline.cross_tokenizer import CrossTokenizer, same_tokenizer
from hf_verl.pipeline.orchestrator import END, Round, RoundHost, RoundOrchestrator
from hf_verl.pipeline.prefetch import frozen_copy
from hf_verl.parallel.sharded_load import loaded_sharded, whole_copy
from hf_verl.pipeline.rounds import Collected, RoundCollector
from hf_verl.pipeline.rewards import place_reward_models
from hf_verl.pipeline.tool_rollout import ToolRollout, tool_frequencies, tool_metrics
from hf_verl.rewards.callables import combine_rewards, reward_func_name
from hf_verl.rewards.remote import RemoteRewardModel, is_url
from hf_verl.rewards.reward_model import RewardModelScorer, resolve_reward_sources
from hf_verl.rollout.base import RolloutEngine

logger = TraceLogger(logging.getLogger(__name__), {})
_DATASET = "dataset"  # key of `rollout()`'s own prefetch (each `rollouts()` generator has its own key)


class Trainer:
    """RL post-training written as three calls per step: `rollout`, `compute_loss`, `step`.

    Args:
        actor_model (`str`, `PreTrainedModel`, `PeftModel` or [`RolloutEngine`]): the policy. A
            Hub id or path loads on first use; an engine with a `.model` (such as
            [`TransformersEngine`]) generates and its model is trained.
        critic_model (*optional*): a value model (`AutoModelForSequenceClassification`,
            `num_labels=1`, id or object), scored per token. With it the estimator is GAE.
        reward_model: a reward function `f(prompts, completions, completion_ids, **columns)`, a
            reward model (id, path or object, scored with its own tokenizer), or a list of these.
        reference_model (*optional*): the KL reference (id, path or object). Without it and with
            `beta > 0`, a PEFT actor with its adapters disabled serves as the reference.
        tokenizer (*optional*): the actor's tokenizer; defaults to the engine's or the actor id's.
        dataset (*optional*): rows with a `prompt` column, drawn by `rollout()` without a batch.
        config (`TrainerConfig` or `dict`, *optional*): settings (see [`TrainerConfig`]).
        reward_tokenizer (*optional*): tokenizer of a reward model given as an object.
        reward_weights (`list[float]`, *optional*): weights of the reward sources.
        rollout_engine ([`RolloutEngine`], *optional*): generation engine for `actor_model`;
            defaults to a [`TransformersEngine`] sharing the actor's weights (a replica of them when
            the actor is sharded).
        reference_tokenizer (*optional*): the reference's tokenizer. A reference given by id or path loads its
            own; one given as an object without it is taken to share the actor's. When it differs from the
            actor's (vocabulary or special tokens), the reference scores the decoded text re-tokenised with it and
            its log-probs are aligned to the actor's tokens by character offsets (docs/placement.md).
        placement (`dict`, *optional*): where roles run, `{"reference" | "critic": "colocated" | "ddp" | "fsdp2" |
            "zero1" | "zero2" | "zero3", "generator": "colocated" | "<URL of a /v1/completions server>"}`; the
            reference may also be the URL of a server that serves it (no `reference_model=` then)
            (every role colocated by default; :mod:`hf_verl.facade.placement`). `placement()` reports it.
        tools (`list[Callable]`, *optional*): functions (type hints, Google-style docstring) the actor
            may call while generating, as with `GRPOTrainer(tools=...)`: rollouts become multi-turn
            (at most `config.max_tool_calling_iterations` tool rounds, `max_completion_length` tokens in
            all), tool results are attended but masked out of the loss, and the reward functions get
            the completions as message lists. Needs conversational prompts and a chat template that
            renders tool calls.

    Construction loads nothing: roles given by id are fetched, and the parallel layout of the
    launch applied, the first time they are needed. With `use_async_rollout` a background worker
    prefetches rollouts; `close()` stops it (`with Trainer(...) as trainer:` closes on exit).
    """

    def __init__(self, actor_model: Any, critic_model: Any = None, reward_model: Any = None,
                 reference_model: Any = None, tokenizer: Any = None, dataset: Any = None,
                 config: TrainerConfig | Mapping | None = None, *, reward_tokenizer: Any = None,
                 reward_weights: Sequence[float] | None = None, rollout_engine: RolloutEngine | None = None,
                 tools: Sequence[Callable] | None = None, reference_tokenizer: Any = None,
                 placement: Mapping[str, str] | None = None) -> None:
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig(**dict(config or {}))
        self._placement = check_placement(placement, has_reference=reference_model is not None,
                                          has_critic=critic_model is not None,
                                          world_size=int(os.environ.get("WORLD_SIZE", "1")), engines=tuple(ENGINES))
        if is_url(self._placement["generator"]):
            if rollout_engine is not None or isinstance(actor_model, RolloutEngine):
                raise ValueError("placement['generator'] is a URL but a rollout engine was given too: pass one of "
                                 "them.")
            from hf_verl.rollout.remote import RemoteEngine

            rollout_engine = RemoteEngine(self._placement["generator"])
        if isinstance(actor_model, RolloutEngine):
            rollout_engine, actor_model = actor_model, getattr(actor_model, "model", None)
            if actor_model is None:
                raise ValueError(f"the actor engine {type(rollout_engine).__name__} has no `.model` to train; "
                                 "pass the model as actor_model and the engine as rollout_engine=.")
        if reward_model is None:
            raise ValueError("reward_model is required: a reward function, a reward model id/path/object, or a list.")
        place = {"device": self.config.device, "dtype": self.config.dtype}
        self.actor = LazyModel("actor", actor_model, "causal_lm", **place)
        self.critic = None if critic_model is None else LazyModel("critic", critic_model, "value", **place)
        self.reference = None if reference_model is None else LazyModel("reference", reference_model, "causal_lm",
                                                                        **place)
        self._remote_reference = None  # a reference served behind a URL (placement["reference"])
        if is_url(self._placement["reference"]):
            from hf_verl.engine.remote_reference import RemoteReference

            self._remote_reference = RemoteReference(self._placement["reference"])
        for role in self._model_roles():
            role.on_load.append(lambda _role: self._check_vocab())
        self._reference_tokenizer = reference_tokenizer
        self._tokenizer = tokenizer
        self._engine = rollout_engine
        self._cross: CrossTokenizer | None | bool = False  # False: not decided yet
        self._check_vocab()
        self.reward_funcs = resolve_reward_sources(reward_model, reward_tokenizer, defer_checks=True)
        self.reward_weights = reward_weights
        self._tool_rollout = ToolRollout(tools) if tools else None
        self._tools_checked = False
        if self._tool_rollout is not None and (tokenizer or getattr(rollout_engine, "tokenizer", None)) is not None:
            self._check_tools()  # a tokenizer at hand is checked now; one loaded from the actor id at first use
        self._engine = rollout_engine
        self.dataset = dataset
        self.debug_mode = False
        self._order: list[int] = []
        self._epoch = 0
        self._layout = None  # (backend, dims, accelerator), decided on first use
        self.layout_plan = None  # the planner's Plan when config.parallel / model_size asked for one
        self._engines: dict[str, TrainingEngine] = {}
        self._sharded_rewards = 0
        self._moves_logged: set[str] = set()
        self._loss_metrics: dict[str, Any] = {}
        self._loss_rollout: Rollout | None = None
        self._pending_loss: torch.Tensor | None = None  # compute_loss ran its backward; step() applies it
        self.global_step = 0
        self._collector: RoundCollector | None = None  # made on first use (the tokenizer may load lazily)
        # the schedule of rollouts (the trainers' too): weight sync, prefetches by source, row seeds
        self._rounds = RoundOrchestrator(RoundHost(
            settings=self.config, rows=self._rows, prepare=lambda rows: self._round_collector().tokenize(rows),
            collect=self._collect, engine=lambda: self.engine, actor=lambda: self.actor_engine,
            dims=lambda: self.dims, global_step=lambda: self.global_step, version=lambda: self.global_step,
            check_prefetch=self._check_prefetch), "hf_verl-facade-rollout")
        weakref.finalize(self, self._rounds.prefetcher.close, False)
        self._explicit_logged = False
        self._layout_logged = False
        self.config.add_listener(self._on_config_change)

    # ------------------------------------------------------------------ roles and engines
    def _model_roles(self) -> list[LazyModel]:
        return [r for r in (self.actor, self.critic, self.reference) if r is not None]

    def _check_vocab(self) -> None:
        """A critic, and a reference on the actor's tokenizer, read the actor's token ids: their embeddings must
        agree with the actor's. A reference on another tokenizer (decided from the tokenizers, not from sizes) reads
        its own re-tokenised ids and is not checked here."""
        if not self.actor.loaded:
            return
        actor_v = vocab_size(self.actor.get())
        for role in (self.reference, self.critic):
            if role is not None and role.loaded:
                if role is self.reference and self._reference_tokenizer_known() and self._reference_cross():
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
        actor_ok = self._tokenizer is not None or getattr(self._engine, "tokenizer", None) is not None or isinstance(
            self.actor.source, str)
        return ref_ok and actor_ok

    def _reference_cross(self) -> CrossTokenizer | None:
        """The re-tokenisation of a reference on another tokenizer, or None when it shares the actor's (decided
        once, from the tokenizers: :func:`~hf_verl.pipeline.cross_tokenizer.same_tokenizer`)."""
        if self._cross is False:
            self._cross = None
            if (self.reference is not None or self._remote_reference is not None) and \
                    self._reference_tokenizer_known():
                if self._reference_tokenizer is None:
                    from transformers import AutoTokenizer

                    self._reference_tokenizer = AutoTokenizer.from_pretrained(self.reference.source)
                if not same_tokenizer(self.tokenizer, self._reference_tokenizer):
                    self._cross = CrossTokenizer(self.tokenizer, self._reference_tokenizer, role="reference")
                    logger.info("the reference (%s) has another tokenizer than the actor: it scores the decoded text "
                                "re-tokenised with its own, aligned to the actor's tokens by character offsets",
                                self._remote_reference.url if self.reference is None else self.reference.name)
        return self._cross

    def placement(self) -> list[str]:
        """One line per role, also logged: its backend, its ranks or URL, its layout and a memory estimate (the
        planner's, "n/a" until it is installed). Lays out (and so loads) the model roles.

        Returns:
            `list[str]`: lines `"<role>: backend=... where=... layout=... memory=..."` for the actor, the
            reference (or the actor with adapters off), the critic, each reward source and the generator.
        """
        layout, _ = self._launch_layout()
        ranks = f"ranks 0-{layout.dims.world_size - 1}" if layout.dims.world_size > 1 else "rank 0"
        lines = []
        for name in ("actor", "reference", "critic"):
            if name == "reference" and self._remote_reference is not None:
                layout_ = "remote (cross-tokenizer)" if self._reference_cross() else "remote"
                lines.append(placement_line(name, "server", self._remote_reference.url, layout_, "n/a (remote)"))
                continue
            engine = self._role_engine(name)
            if engine is None:
                continue
            choice = self._placement.get(name, COLOCATED)
            axes = " ".join(f"{a}={getattr(engine.dims, a)}" for a in engine.dims.enabled) or "one process"
            extra = " cross-tokenizer" if name == "reference" and self._reference_cross() else ""
            where = f"{ranks} ({'colocated' if choice == COLOCATED else 'own layout'}{extra})"
            lines.append(placement_line(name, engine.backend.label, where, axes,
                                        memory_estimate(engine.model if hasattr(engine, "model") else None, layout)))
        for func in self.reward_funcs:
            label = f"reward[{reward_func_name(func)}]"
            if isinstance(func, RemoteRewardModel):
                lines.append(placement_line(label, "server", func.url, "remote", "n/a (remote)"))
            elif isinstance(func, RewardModelScorer):
                lines.append(placement_line(label, "local model", ranks, "replica on every rank" if not
                                            self._sharded_rewards else "sharded with the actor", "n/a"))
            else:
                lines.append(placement_line(label, "callable", ranks, "python", "n/a"))
        engine = self.engine
        url = getattr(engine, "base_url", None)
        lines.append(placement_line("generator", type(engine).__name__, url or ranks,
                                    "remote" if url else "colocated", "n/a" if url else "shares the actor's"))
        if self.dims.is_main:
            for line in lines:
                logger.info("placement: %s", line)
        return lines

    @property
    def model(self) -> torch.nn.Module:
        """The actor model (loaded on first access)."""
        return self._role_model("actor")

    @property
    def tokenizer(self):
        """The actor's tokenizer (loaded on first access when the actor was given by id)."""
        if self._tokenizer is None:
            if self._engine is not None and getattr(self._engine, "tokenizer", None) is not None:
                self._tokenizer = self._engine.tokenizer
            else:
                source = self.actor.source if isinstance(self.actor.source, str) else self.actor.name
                if not isinstance(source, str) or not source or source == type(self.model).__name__:
                    raise ValueError("the actor was given as an object without a Hub id: pass tokenizer=.")
                from transformers import AutoTokenizer

                self._role_model("actor")  # fails first, naming the role, when the id cannot be resolved
                self._tokenizer = AutoTokenizer.from_pretrained(source)
            ensure_pad_token(self._tokenizer)
        return self._tokenizer

    def _launch_layout(self):
        """The launch's default [`RoleLayout`] and its accelerator (decided once, on first use)."""
        if self._layout is None:
            from accelerate import Accelerator

            from hf_verl.parallel.backend import check_accelerate_parallelism

            from hf_verl.parallel.megatron.launch import resolve_megatron_settings

            check_accelerate_parallelism()  # before accelerate builds groups of its own
            self._plan_layout()
            cfg = self.config
            backend, tp, pp = resolve_megatron_settings(  # an accelerate MEGATRON_LM launch is hf_verl's to run
                "TrainerConfig", cfg.backend, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                cfg.sequence_parallel_size)
            from datetime import timedelta

            from accelerate.utils import InitProcessGroupKwargs

            accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[
                InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout))])
            # a rank stalled past ddp_timeout is named instead of hanging; the process group is left cleanly at exit
            watchdog.start(cfg.ddp_timeout)
            watchdog.set_step(self.global_step + 1)
            layout = launch_role_layout(accelerator.num_processes, sequence_parallel_size=cfg.sequence_parallel_size,
                                        tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        engine="megatron" if backend == "megatron" else None)
            self._layout = (layout, accelerator)
        return self._layout

    def _plan_layout(self) -> None:
        """`config.parallel="auto"`, or a `config.model_size` set with `parallel` left at None: the planner's layout
        for this launch, written into the config before any role is loaded (:mod:`hf_verl.parallel.planner.apply`);
        an explicit layout wins and the log says so."""
        cfg = self.config
        if cfg.parallel == "manual" or (cfg.parallel is None and cfg.model_size is None):
            return
        from hf_verl.parallel.planner.apply import apply_facade_plan

        self.layout_plan = apply_facade_plan(cfg, cfg.model_size if cfg.model_size is not None else self.actor.source)

    @property
    def dims(self):
        """The run's [`ParallelDims`] (data-parallel rank and size, groups)."""
        return self._launch_layout()[0].dims

    def _role_layout(self, name: str):
        """The [`RoleLayout`] role `name` runs on: the launch's, or its own placement's over the launch's processes."""
        layout, _ = self._launch_layout()
        choice = self._placement.get(name, COLOCATED)
        if choice != COLOCATED and layout.dims.world_size > 1:  # its own layout over the launch's processes
            layout = replace(layout.with_backend(BACKENDS[choice]), colocated=False)
        return layout

    def _role_model(self, name: str) -> torch.nn.Module:
        """Role `name`'s model; loaded for its layout under a multi-process launch (sharded where that applies)."""
        role = {"actor": self.actor, "critic": self.critic, "reference": self.reference}[name]
        if role.loaded or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return role.get()
        return role.get(layout=self._role_layout(name))

    def _role_engine(self, name: str) -> TrainingEngine | None:
        """The training engine of role `name` ("actor", "critic", "reference"), made on first use."""
        role = {"actor": self.actor, "critic": self.critic, "reference": self.reference}[name]
        if role is None:
            return None
        if name not in self._engines:
            _, accelerator = self._launch_layout()
            layout = self._role_layout(name)
            model = role.get(layout=layout)  # an id or path loads sharded under FSDP2 / ZeRO-3 over 2+ shards
            if name == "actor" and layout.backend.partitions_parameters and self._engine is None:
                # a sharded actor cannot generate: the default engine gets a replica, made before sharding (read whole
                # from the checkpoint when the actor was loaded sharded)
                from hf_verl.rollout.hf_engine import TransformersEngine

                replica = whole_copy(model, accelerator.device) if loaded_sharded(model) else frozen_copy(model)
                self._engine = TransformersEngine(replica, self.tokenizer)
            rows = self.config.rollout_batch_size * self.config.num_generations
            engine = make_engine(
                model, name, layout, accelerator=accelerator, trainable=name != "reference",
                micro_batch_size=rows, max_grad_norm=self.config.max_grad_norm,
                pad_token_id=self.tokenizer.pad_token_id if name == "critic" else None)
            self._engines[name] = engine
            if name != "reference":
                engine.configure_optimizer(self._optimizer_spec(name))
            if name == "actor":  # reward models shard with the policy; loading them is a main-thread step
                self._sharded_rewards = place_reward_models(
                    self.reward_funcs, layout.backend, async_rollout=self.config.use_async_rollout,
                    make_engine=lambda m: make_engine(m, "reward", layout, accelerator=accelerator, trainable=False))
        return self._engines[name]

    def _optimizer_spec(self, name: str) -> OptimizerSpec:
        """AdamW over every trainable parameter (`critic_learning_rate` for the critic), clipping to
        `max_grad_norm`, a constant learning rate (changed live through `trainer.config`)."""
        cfg = self.config
        lr = cfg.learning_rate if name == "actor" else (cfg.critic_learning_rate or cfg.learning_rate)
        return OptimizerSpec(torch.optim.AdamW, {"lr": lr}, weight_decay=cfg.weight_decay,
                             max_grad_norm=cfg.max_grad_norm)

    @property
    def actor_engine(self) -> TrainingEngine:
        """The actor's training engine."""
        return self._role_engine("actor")

    @property
    def engine(self) -> RolloutEngine:
        """The actor's rollout engine (a `TransformersEngine` on the actor's weights by default)."""
        actor = self.actor_engine
        if self._engine is None:
            from hf_verl.rollout.hf_engine import TransformersEngine

            self._engine = TransformersEngine(actor.rollout_model(), self.tokenizer)
        return self._engine

    def supported_parallelisms(self, reasons: bool = False) -> list[str] | dict[str, str]:
        """The parallelisms this installation and machine can run now: "data" (DDP), "fsdp" (FSDP2),
        "zero" (DeepSpeed), "sequence", "tensor", "pipeline" (see :mod:`hf_verl.parallel.capabilities`).

        Args:
            reasons (`bool`): return `{name: reason}` for every parallelism instead, the reason saying
                what it runs on or why it cannot run (missing backend, too few devices, not built yet).
        """
        if reasons:
            return {name: a.reason for name, a in parallelism_report().items()}
        return supported_parallelisms()

    # ------------------------------------------------------------------ role moves and debug
    def _into(self, role: str, engine: TrainingEngine, batch: Rollout) -> Rollout:
        """`batch` on `role`'s device; a device/dtype difference from the actor is logged once."""
        device, dtype = engine.device, engine.dtype
        a_device, a_dtype = model_device_dtype(self.model)
        if (device, dtype) != (a_device, a_dtype) and role not in self._moves_logged:
            self._moves_logged.add(role)
            logger.info("moving rollout tensors from actor (%s, %s) to %s (%s, %s); its outputs return to the "
                        "actor as float32 on %s", a_device, a_dtype, role, device, dtype, a_device)
        return batch if device == batch.device else batch.to(device)

    def _record(self, boundary: str, tensors: Mapping[str, Any]) -> None:
        if self.debug_mode:
            path = self.config.debug_path or DEFAULT_DEBUG_FILE
            DebugRecorder(path, logger).record(boundary, tensors, step=self.global_step)

    # ------------------------------------------------------------------ rollout
    def rollout(self, batch: Any = None) -> Rollout:
        """Generate `num_generations` completions per prompt, then score them and compute advantages.

        Args:
            batch: a list of prompt strings, a list of chat-message lists, a dict of lists with a
                `prompt` key (a DataLoader batch over a `datasets.Dataset`; the other keys reach
                the reward functions), a list of row dicts, or None to draw `rollout_batch_size`
                rows from `dataset` (this data-parallel rank's share of them).

        Returns:
            [`Rollout`]: prompts, completions, ids, masks, old / reference log-probs, values,
            rewards, advantages and returns, aligned and on the actor's device, with
            `rollout.metrics` and `rollout.trace_id`.

        With `use_async_rollout` and no batch, the next rollout's rows are drawn now and generated
        in the background while this one trains; the next call hands it out. An explicit `batch`
        is rolled out synchronously: use [`~Trainer.rollouts`] to prefetch batches.
        """
        if batch is None:
            return self._finish(self._rounds.serve(_DATASET, lambda: self._draw(self.config.rollout_batch_size)))
        with trace(new_trace_id()):
            if self.config.use_async_rollout and not self._explicit_logged:
                self._explicit_logged = True
                logger.info("rollout(batch) with an explicit batch is not prefetched (synchronous); for asynchronous "
                            "rollout over your batches use `for rollout in trainer.rollouts(loader): ...`")
            return self._finish(self._rounds.generate_now(batch))

    def rollouts(self, batches: Iterable[Any]) -> Iterator[Rollout]:
        """One [`Rollout`] per batch of `batches`, generating the next batch while the caller trains.

        Args:
            batches: an iterable of batches in any form `rollout(batch)` takes (a DataLoader, say).

        Yields:
            [`Rollout`]: as `rollout(batch)` returns it. With `use_async_rollout` the next batch is
            taken from `batches` and generated in the background as soon as a rollout is yielded;
            without it each batch is rolled out when it is asked for.

        Example:
            ```python
            for rollout in trainer.rollouts(loader):
                trainer.step(trainer.compute_loss(rollout))
            ```
        """
        iterator, key = iter(batches), object()
        try:
            while (served := self._rounds.serve(key, lambda: next(iterator, END))) is not None:
                yield self._finish(served)
        finally:
            self._rounds.drop(key)  # an early break drops the prefetch; its generation just ends

    def _collect(self, rows: list[dict], tokenized: tuple | None, engine: RolloutEngine, row_seeds: list[int] | None,
                 version: int | None) -> Collected:
        """Generate and score through the trainers' collector (the orchestrator's `collect`): reads no trainer
        role, so it may run off the main thread. Adds the facade's views: dataset columns in the meta, the
        combined reward, the trace id (the caller's, or a new one on the background thread)."""
        with trace(current_trace_id() or new_trace_id()) as trace_id:
            if tokenized is not None:  # None: a tool rollout tokenises per turn
                self._record("prompts->actor", {"prompt_ids": torch.tensor([len(p) for p in tokenized[0].ids])})
            c = self._round_collector().collect(rows, engine, device=self.actor_engine.device, row_seeds=row_seeds,
                                                version=version, tokenized=tokenized)
            out = c.batch
            self._record("actor->rollout", out.tensor_fields())
            for k, v in generation.row_columns(rows).items():
                out.meta[COLUMN_PREFIX + k] = v
            out.rewards = combine_rewards(c.rewards_per_func, self.reward_weights).to(out.device)
            self._record("reward->rollout", {"rewards": out.rewards})
            out.meta["trace_id"] = trace_id
        return c

    def _check_prefetch(self) -> None:
        if self._sharded_rewards:
            raise ValueError("reward models are sharded with the policy (FSDP2 / ZeRO-3) and score on the main "
                             "thread: set config.use_async_rollout = False.")

    def _finish(self, served: Round) -> Rollout:
        """The trainer-dependent phases of a rollout, on the main thread with the current roles."""
        if not self._layout_logged:  # once per run, when every role in use is laid out
            from hf_verl.engine.registry import describe_layout

            roles = {name: self._role_engine(name) for name in ("actor", "critic", "reference")}
            if self.dims.is_main:
                logger.info("hf_verl layout: %s", describe_layout(roles, self.engine))
            self._layout_logged = True
        if self.dims.replica_size > 1:  # the ranks of one data-parallel replica train on its first rank's rollout
            served = comm.broadcast_replica(self.dims, served)
        c, timings, cfg = served.collected, served.timings, self.config
        out = c.batch
        kw = {"temperature": cfg.temperature if cfg.temperature > 0 else 1.0, "chunk_size": cfg.logprob_chunk_size,
              "micro_batch": out.batch_size}
        with trace(out.meta["trace_id"]):
            actor = self.actor_engine
            t2 = time.perf_counter()
            out.ref_logprobs = self._reference_logprobs(out)
            t3 = time.perf_counter()
            critic = self._role_engine("critic")
            if critic is not None:
                moved = self._into("critic", critic, out)
                self._record("actor->critic", {"input_ids": moved.input_ids, "attention_mask": moved.attention_mask})
                values = phases.critic_values(critic, moved, micro_batch=out.batch_size)
                self._record("critic->rollout", {"values": values})
                out.values = values.to(device=out.device, dtype=torch.float32) * out.completion_mask
            t4 = time.perf_counter()
            out.old_logprobs = phases.policy_logprobs(actor, out, **kw)
            t5 = time.perf_counter()
            self._advantages(out)
            staleness = served.staleness
            out.meta.update(weights_step=served.weights_step, off_policy=served.off_policy or staleness > 0)
            out.validate()
            timings.update(reference=t3 - t2, critic=t4 - t3, old_logprobs=t5 - t4)
            timings.setdefault("weight_sync", 0.0)
            timings.setdefault("rollout_wait", 0.0)
            num_truncated = -(-c.num_truncated // cfg.num_generations)  # distinct prompts
            m = self._rollout_metrics(out, c.rewards_per_func, timings, num_truncated)
            m.update({"rollout/staleness": staleness, "rollout/prefetched": float(served.prefetched)})
            # what the reward functions logged with log_metric (TRL's keyword)
            m.update({name: sum(v) / len(v) for name, v in c.reward_context.metrics.items() if v})
            out.meta["metrics"] = m
            self._record("rollout->compute_loss", out.tensor_fields())
            logger.info("rollout: %d completions, reward mean %.4f, %d generated tokens, staleness %d, waited "
                        "%.2fs", out.batch_size, m["reward/mean"], out.num_completion_tokens, staleness,
                        timings.get("rollout_wait", 0.0))
        return out

    def _prompts(self, batch: Any) -> tuple[list, dict[str, list]]:
        """Prompts and columns, each prompt repeated `num_generations` times (groups contiguous)."""
        if batch is None:
            batch = self._draw(self.config.rollout_batch_size)
        if isinstance(batch, Mapping):
            check_prompt_column(list(batch))
            cols = {k: (v.tolist() if isinstance(v, torch.Tensor) else list(v)) for k, v in batch.items()}
            prompts = cols.pop("prompt")
        elif isinstance(batch, Sequence) and not isinstance(batch, str) and batch and all(
                isinstance(r, Mapping) and "prompt" in r for r in batch):
            prompts = [r["prompt"] for r in batch]
            cols = {k: [r.get(k) for r in batch] for k in batch[0] if k != "prompt"}
        elif isinstance(batch, Sequence) and not isinstance(batch, str) and batch:
            prompts, cols = list(batch), {}
        else:
            raise ValueError(f"rollout() needs a non-empty list of prompts, a dict with a 'prompt' key, or None "
                             f"with a dataset; got {type(batch).__name__}.")
        G = self.config.num_generations
        rep = lambda xs: [x for x in xs for _ in range(G)]  # noqa: E731
        return rep(prompts), {k: rep(v) for k, v in cols.items()}

    def _draw(self, n: int) -> list[dict]:
        """This data-parallel rank's `n` rows of the next `n x dp_size` of the seeded dataset order."""
        if self.dataset is None:
            raise ValueError("rollout() was called without a batch and the Trainer has no dataset.")
        dims = self.dims
        rows = []
        while len(rows) < n * dims.dp_size:
            if not self._order:
                g = torch.Generator().manual_seed(self.config.seed + self._epoch)
                self._order = torch.randperm(len(self.dataset), generator=g).tolist()
                self._epoch += 1
            rows.append(self._order.pop())
        mine = rows[dims.dp_rank * n : (dims.dp_rank + 1) * n]
        return [dict(self.dataset[i]) for i in mine]

    def _check_tools(self) -> None:
        if self._tool_rollout is not None and not self._tools_checked:
            self._tool_rollout.check_tokenizer(self.tokenizer)
            self._tools_checked = True

    def _rows(self, batch: Any) -> list[dict]:
        """A batch as rows (`prompt` and the other columns), each repeated `num_generations` times; with tools the
        prompts are checked against them here, on the main thread."""
        prompts, columns = self._prompts(batch)
        if self._tool_rollout is not None:
            self._check_tools()
            self._tool_rollout.check_prompts(prompts)
        return [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]

    def _round_collector(self) -> RoundCollector:
        """The trainers' round collector (tokenise, generate, score) over this trainer's settings."""
        if self._collector is None:
            from hf_verl.facade.rollout import Rollout as RolloutType

            cfg = self.config
            self._collector = RoundCollector(
                self.tokenizer, self.reward_funcs, cfg, max_new_tokens=lambda: cfg.max_completion_length,
                prompt_limit=lambda: cfg.max_prompt_length, tool_rollout=self._tool_rollout, batch_cls=RolloutType,
                stream_scoring=False)
        return self._collector

    @torch.no_grad()
    def _reference_logprobs(self, out: Rollout) -> torch.Tensor | None:
        cfg = self.config
        if cfg.beta == 0.0:
            return None
        kw = {"temperature": cfg.temperature if cfg.temperature > 0 else 1.0, "chunk_size": cfg.logprob_chunk_size,
              "micro_batch": out.batch_size}
        reference = self._remote_reference or self._role_engine("reference")
        if reference is None:
            return phases.reference_logprobs(None, self.actor_engine, out, **kw)
        moved = self._into("reference", reference, out)
        self._record("actor->reference", {"input_ids": moved.input_ids, "attention_mask": moved.attention_mask})
        lp = phases.reference_logprobs(reference, self.actor_engine, moved, cross=self._reference_cross(), **kw)
        self._record("reference->rollout", {"ref_logprobs": lp})
        return lp.to(device=out.device, dtype=torch.float32)

    def _estimator(self) -> str:
        name = self.config.advantage_estimator
        if name == "auto":
            return "gae" if self.critic is not None else "grpo"
        if name == "gae" and self.critic is None:
            raise ValueError(f"advantage_estimator 'gae' needs a critic: pass critic_model=, or pick a critic-free "
                             f"estimator {CRITIC_FREE_CHOICES}.")
        if name != "gae" and self.critic is not None:
            raise ValueError(f"advantage_estimator {name!r} does not use the critic; set advantage_estimator='gae' "
                             "(or 'auto'), or drop critic_model.")
        return name

    def _advantages(self, out: Rollout) -> None:
        """Fill `advantages` (and `token_rewards` / `returns`) with the configured estimator, over the
        data-parallel round."""
        cfg, name, dims = self.config, self._estimator(), self.dims
        mask = out.completion_mask
        if name == "gae":
            from hf_verl.algorithms.estimators import token_level_rewards

            out.token_rewards, _ = token_level_rewards(out.rewards, mask)
        adv, returns = phases.advantages(dims, name, scores=out.rewards, mask=mask, num_generations=cfg.num_generations,
                                         gamma=cfg.gamma, lam=cfg.lam, values=out.values, token_rewards=out.token_rewards,
                                         scale_rewards=cfg.scale_rewards)
        if name == "gae" and cfg.whiten_advantages:
            adv = phases.global_masked_whiten(dims, adv, mask) * mask.to(adv.dtype)
        out.advantages, out.returns = adv, returns
        self._record("advantages->rollout", {"advantages": adv, "returns": returns})

    def _rollout_metrics(self, out: Rollout, per_func: torch.Tensor, timings: dict, num_truncated: int) -> dict:
        plen = out.prompt_mask.sum(-1).float()
        clen = out.completion_mask.sum(-1).float()
        m: dict[str, Any] = {
            "trace_id": out.trace_id, "rollout/num_completions": out.batch_size,
            "rollout/prompt_length_mean": plen.mean().item(), "rollout/prompt_length_max": plen.max().item(),
            "rollout/prompts_truncated": num_truncated, "rollout/generated_tokens": int(clen.sum().item()),
            "rollout/completion_length_mean": clen.mean().item(),
            "rollout/truncated_frac": out.is_truncated.float().mean().item(),
            "reward/mean": out.rewards.mean().item(),
            "reward/std": out.rewards.std().item() if out.batch_size > 1 else 0.0,
            "advantages/mean": (out.advantages.float() * out.completion_mask).sum().item()
            / max(out.num_completion_tokens, 1),
            "memory/peak_mb": peak_memory_mb(out.device),
        }
        for j, func in enumerate(self.reward_funcs):
            m[f"reward/{reward_func_name(func)}/mean"] = per_func[:, j].nanmean().item()
        counts = tool_metrics(out)
        if counts is not None:  # TRL's tool metrics (this rank's rows)
            m.update(tool_frequencies(counts))
        for k, v in timings.items():
            m[f"time/{k}_s"] = v
        return m

    # ------------------------------------------------------------------ loss and step
    def compute_loss(self, rollout: Rollout) -> torch.Tensor:
        """The scalar loss of `rollout` (or of a mini-batch from `rollout.split(n)`), with its backward done.

        PPO-clip policy loss, plus `vf_coef` x clipped value loss with a critic, `beta` x KL to the
        reference, minus `entropy_coef` x entropy, aggregated per `loss_type` (the token-mean modes
        over the tokens of every data-parallel rank). Each role's engine runs the forward and the backward of its
        part (`engine.forward_backward`); gradients accumulate over `compute_loss` calls until `step`. Each term
        is in the metrics `step` returns.

        Returns:
            `torch.Tensor`: the loss value (detached: the engines have already backpropagated it).

        Raises:
            FloatingPointError: a loss that is not finite (the gradients of this call are discarded).
        """
        cfg = self.config
        with trace(rollout.trace_id or new_trace_id()):
            self._record("rollout->actor", rollout.tensor_fields())
            actor = self.actor_engine
            actor.train()
            normalizer = phases.global_token_count(self.dims, rollout.completion_mask) / self.dims.dp_size
            m: dict[str, Any] = {}
            if rollout.meta.get("off_policy"):
                m.update(self._importance_weights(rollout))
            if cfg.beta > 0 and rollout.ref_logprobs is None:
                rollout.ref_logprobs = self._reference_logprobs(rollout)
            rollout.loss_inputs = LossInputs(loss_normalizer=normalizer, token_normalizer=normalizer)
            request = LogProbs(temperature=cfg.temperature if cfg.temperature > 0 else 1.0,
                               chunk_size=cfg.logprob_chunk_size, with_entropy=True)
            phases.set_entropy_thresholds(actor, self.dims, [rollout], request, cfg.top_entropy_quantile)
            policy = actor.forward_backward([rollout], self._policy_loss, forward=request)
            m.update(policy.metrics[0])
            loss = policy.losses[0]
            critic = self._role_engine("critic")
            if critic is not None:
                critic.train()
                moved = self._into("critic", critic, rollout)
                value = critic.forward_backward([moved], self._value_loss, forward=Values())
                m.update(value.metrics[0])
                loss = loss + value.losses[0].to(loss.device)
            m["loss/total"] = loss.item()
            if not torch.isfinite(loss):
                for engine in (actor, critic):
                    if engine is not None:
                        engine.zero_grad()
                raise FloatingPointError(f"the loss is {loss.item()} (terms: {m}); its gradients were discarded.")
            self._loss_metrics, self._loss_rollout, self._pending_loss = m, rollout, loss
            logger.info("compute_loss: total %.4f, policy %.4f", m["loss/total"], m["loss/policy"])
        return loss

    def _policy_loss(self, out: PolicyOutput, rollout: Rollout):
        """The actor's loss of one rollout and its metrics (no collective: see `rollout.loss_inputs`)."""
        cfg, inputs = self.config, rollout.loss_inputs
        policy, st = losses.policy_loss(
            out.logp, rollout, loss=losses.loss_form(cfg), params=losses.loss_params(cfg), loss_type=cfg.loss_type,
            normalizer=inputs.loss_normalizer, max_completion_length=cfg.max_completion_length, kl_coef=cfg.beta,
            kl_estimator=cfg.kl_estimator, kl_bias_correction=cfg.use_bias_correction_kl, entropy=out.entropy,
            entropy_coef=cfg.entropy_coef, entropy_normalizer=inputs.token_normalizer,
            entropy_threshold=inputs.entropy_threshold, off_policy_threshold=cfg.off_policy_mask_threshold)
        m = {"loss/policy": st["policy"], "entropy": st["entropy"], "clip_ratio": st["clip_region"]}
        if cfg.beta > 0:
            m["kl"] = st["kl"]
        return policy, m

    def _value_loss(self, values: torch.Tensor, rollout: Rollout):
        """`vf_coef` x the critic's clipped value loss of one rollout, and its metrics."""
        cfg = self.config
        values = values.float().to(rollout.device)
        value, vst = losses.value_loss(values, rollout, clip=cfg.cliprange_value,
                                       normalizer=rollout.loss_inputs.loss_normalizer)
        return cfg.vf_coef * value, {"loss/value": vst["value"], "value/clip_frac": vst["clip_frac"]}

    def _importance_weights(self, rollout: Rollout) -> dict[str, Any]:
        """Truncated / masked IS weights of an off-policy rollout (behaviour = the engine's sampling
        log-probs, target = the actor's old log-probs) into its meta, and TRL's `sampling/*` metrics."""
        cfg = self.config
        stats = phases.attach_importance_weights(
            rollout, mode=cfg.vllm_importance_sampling_mode, clip_min=cfg.vllm_importance_sampling_clip_min,
            clip_max=cfg.vllm_importance_sampling_clip_max, correct=cfg.vllm_importance_sampling_correction)
        if not stats and not getattr(self, "_no_logprobs_logged", False):
            self._no_logprobs_logged = True
            logger.info("the rollout engine returned no sampling log-probs: the importance-sampling correction of "
                        "off-policy rollouts is skipped")
        return stats

    def _on_config_change(self, name: str, old: Any, new: Any) -> None:
        if name == "ddp_timeout" and self._layout is not None:
            watchdog.start(new)
        if name in ("model_size", "parallel") and self._layout is not None:
            logger.warning("config.%s changed after the roles were laid out (%s): the layout is planned once, before "
                           "anything is loaded; set it before the first rollout", name, self._layout[0].label)
        cfg = self.config
        actor, critic = self._engines.get("actor"), self._engines.get("critic")
        updates: list[tuple[TrainingEngine | None, str, Any]] = []
        if name == "learning_rate":
            updates.append((actor, "lr", new))
            if cfg.critic_learning_rate is None:
                updates.append((critic, "lr", new))
        elif name == "critic_learning_rate":
            updates.append((critic, "lr", new if new is not None else cfg.learning_rate))
        elif name == "weight_decay":
            updates += [(actor, "weight_decay", new), (critic, "weight_decay", new)]
        for engine, key, value in updates:
            for group in (engine.param_groups if engine is not None else []):
                group[key] = value
        logger.info("config.%s: %r -> %r (takes effect at the next rollout / step)", name, old, new)

    def step(self, loss: torch.Tensor) -> dict[str, Any]:
        """Apply the gradients `compute_loss` accumulated: each role's engine clips (the global norm) and steps
        its optimizer; then the rollout engine is synced to the new weights.

        Args:
            loss (`torch.Tensor`): the loss `compute_loss` returned (its backward already ran in the engines).

        Returns:
            `dict`: the metrics of the last `compute_loss`, of its rollout, gradient norms,
            learning rates, the engine's weight version and the trace id.
        """
        rollout = self._loss_rollout
        with trace((rollout.trace_id if rollout is not None else None) or new_trace_id()) as trace_id:
            if self._pending_loss is None:
                raise ValueError("step() applies the gradients of compute_loss(): call trainer.compute_loss(rollout) "
                                 "first, then trainer.step(loss).")
            if not isinstance(loss, torch.Tensor) or loss.requires_grad:
                raise ValueError("step() takes the loss compute_loss returned; its backward already ran in each "
                                 "role's engine, so a loss with a graph of your own (extra terms) would not be "
                                 "trained: add terms through a policy_loss / loss_type setting instead.")
            self._record("compute_loss->step", {"loss": loss})
            m: dict[str, Any] = dict(rollout.metrics) if rollout is not None else {}
            m.update(self._loss_metrics)
            actor = self.actor_engine
            m["grad_norm/actor"] = actor.optimizer_step()
            m["lr/actor"] = actor.last_lr()[0]
            critic = self._role_engine("critic")
            if critic is not None:
                m["grad_norm/critic"] = critic.optimizer_step()
                m["lr/critic"] = critic.last_lr()[0]
            self.global_step += 1
            watchdog.set_step(self.global_step + 1)
            self._rounds.after_step()  # never while it generates: then synced before its next generation
            m.update({"weight_version": self.engine.weight_version, "step": self.global_step, "trace_id": trace_id})
            self._loss_metrics, self._loss_rollout, self._pending_loss = {}, None, None
            logger.info("step %d: grad_norm/actor %.4f, weight_version %d", self.global_step,
                        m["grad_norm/actor"], m["weight_version"])
        return m

    def save_pretrained(self, output_dir: str) -> None:
        """Save the actor (whole HF weights and its tokenizer) to `output_dir` and the critic to
        `output_dir/critic`, gathering sharded layouts; call it on every rank (the main rank writes)."""
        import os

        self.actor_engine.save_pretrained(output_dir)
        if self.dims.is_main:
            self.tokenizer.save_pretrained(output_dir)
        critic = self._role_engine("critic")
        if critic is not None:
            critic.save_pretrained(os.path.join(output_dir, "critic"))

    def close(self) -> None:
        """Stop the background rollout worker (a generation in flight finishes first), drop prefetched
        rollouts and free the actor copy. The Trainer is also a context manager that closes on exit;
        using it again after `close()` starts a new worker."""
        self._rounds.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
