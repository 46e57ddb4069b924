"""`Trainer`: the role-level facade for writing the RL loop by hand.

```python
trainer = Trainer(actor_model="Qwen/Qwen2.5-0.5B", reward_model=my_reward_fn, config={"num_generations": 8})
for batch in loader:
    rollout = trainer.rollout(batch)       # generate, score, reference, critic, advantages
    loss = trainer.compute_loss(rollout)   # the algorithm's loss, backward done by each role's engine
    metrics = trainer.step(loss)           # optimizer steps, weight sync
```

The facade is a front-end of the same machinery as the TRL-style trainers, not a copy of it: its roles are built
by the same role builder (:mod:`hf_verl.facade.role_set` over :mod:`hf_verl.pipeline.role_builder`), its rounds
are scheduled by the same orchestrator (:mod:`hf_verl.pipeline.orchestrator`) and collected by the same collector,
and its algorithm is the same object (:func:`hf_verl.pipeline.families.make_algorithm`: the critic-free family,
GRPOTrainer's, without a critic; PPO, PPOTrainer's, with one), so every registered estimator, policy loss and KL
estimator runs here as in the trainers. It adds only the loop API: roles that load lazily, a validated live
:class:`~hf_verl.facade.config.TrainerConfig` with the trainers' vocabulary, trace ids and debug records
(:mod:`hf_verl.facade.debug`), and asynchronous rollout over the user's batches (`rollout()` / `rollouts(batches)`).

The facade's choices, as data: the KL to the reference is a loss term (`beta`, `kl_estimator`), also with a critic
(PPOTrainer's `use_kl_loss`); reference and old log-probs are computed when a rollout is handed out (so a rollout
carries them, and PPO ratios are exact whatever the engine and however stale the rollout); each `compute_loss`
call's token-mean loss is normalised by its own tokens.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from hf_verl.data.vision import IMAGE_COLUMNS, check_vision_inputs, row_images
from hf_verl.engine.base import TrainingEngine
from hf_verl.engine.hf_layouts import HFLayouts
from hf_verl.facade.config import TrainerConfig
from hf_verl.facade.debug import (
    DEFAULT_DEBUG_FILE,
    DebugRecorder,
    TraceLogger,
    current_trace_id,
    new_trace_id,
    peak_memory_mb,
    trace,
)
from hf_verl.facade.placement import placement_report
from hf_verl.facade.role_set import FacadeRoles
from hf_verl.facade.roles import model_device_dtype
from hf_verl.facade.rollout import COLUMN_PREFIX, Rollout
from hf_verl.facade.rows import DatasetRows, batch_rows
from hf_verl.parallel import comm, watchdog
from hf_verl.pipeline import generation
from hf_verl.pipeline.algorithm import Algorithm, Roles
from hf_verl.pipeline.families import make_algorithm
from hf_verl.pipeline.orchestrator import END, Round, RoundHost, RoundOrchestrator
from hf_verl.pipeline.rounds import Collected, RoundCollector
from hf_verl.pipeline.tool_rollout import ToolRollout, tool_frequencies, tool_metrics
from hf_verl.planner.capabilities import supported_parallelisms
from hf_verl.rewards.callables import combine_rewards, reward_func_name
from hf_verl.rewards.reward_model import resolve_reward_sources
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
            `num_labels=1`, id or object), scored per token. With it the algorithm is PPO (GAE by default).
        reward_model: a reward function `f(prompts, completions, completion_ids, **columns)`, a
            reward model (id, path or object, scored with its own tokenizer), or a list of these.
        reference_model (*optional*): the KL reference (id, path or object). Without it and with
            `beta > 0`, a PEFT actor with its adapters disabled serves as the reference.
        tokenizer (*optional*): the actor's tokenizer; defaults to the engine's or the actor id's.
        dataset (*optional*): rows with a `prompt` column, drawn by `rollout()` without a batch.
        config (`TrainerConfig` or `dict`, *optional*): settings (see [`TrainerConfig`]).
        reward_tokenizer (*optional*): tokenizer of a reward model given as an object.
        reward_weights (`list[float]`, *optional*): weights of the reward sources.
        rollout_engine ([`RolloutEngine`] or `str`, *optional*): the generation engine: an engine object, or a
            registered engine's name (`"transformers"`, `"vllm"`, `"remote"`, or your own:
            `hf_verl.rollout.register_rollout_engine`); default: a transformers engine sharing the actor's weights
            (a replica of them when the actor is sharded), or a `remote` one for a generator URL.
        reference_tokenizer (*optional*): the reference's tokenizer. A reference given by id or path loads its
            own; one given as an object without it is taken to share the actor's. When it differs from the
            actor's (vocabulary or special tokens), the reference scores the decoded text re-tokenised with it and
            its log-probs are aligned to the actor's tokens by character offsets (docs/placement.md).
        placement (`dict`, *optional*): where roles run, `{"reference" | "critic": "colocated" | "ddp" | "fsdp2" |
            "zero1" | "zero2" | "zero3", "generator": "colocated" | "<URL of a /v1/completions server>"}`; the
            reference may also be the URL of a server that serves it (no `reference_model=` then). A URL
            generator's weight updates carry the token in `HF_VERL_SERVE_TOKEN` (the variable `hf-verl serve`
            reads). Every role colocated by default (:mod:`hf_verl.pipeline.placement`); `placement()` reports it.
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
                 reward_weights: Sequence[float] | None = None, rollout_engine: RolloutEngine | str | None = None,
                 tools: Sequence[Callable] | None = None, reference_tokenizer: Any = None,
                 placement: Mapping[str, str] | None = None) -> None:
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig(**dict(config or {}))
        if reward_model is None:
            raise ValueError("reward_model is required: a reward function, a reward model id/path/object, or a list.")
        self.reward_funcs = resolve_reward_sources(reward_model, reward_tokenizer, defer_checks=True)
        self.reward_weights = reward_weights
        self.roles = FacadeRoles(self.config, actor_model=actor_model, critic_model=critic_model,
                                 reference_model=reference_model, tokenizer=tokenizer,
                                 reference_tokenizer=reference_tokenizer, rollout_engine=rollout_engine,
                                 placement=placement, reward_funcs=self.reward_funcs)
        self.actor, self.critic, self.reference = self.roles.actor, self.roles.critic, self.roles.reference
        self._tool_rollout = ToolRollout(tools) if tools else None
        self._tools_checked = False
        if self._tool_rollout is not None and self.roles.tokenizer_at_hand():
            self._check_tools()  # a tokenizer at hand is checked now; one loaded from the actor id at first use
        self._rows_source = DatasetRows(dataset)
        self.debug_mode = False
        self._algorithm: Algorithm | None = None
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
        self._no_logprobs_logged = False
        self.config.add_listener(self._on_config_change)

    # ------------------------------------------------------------------ roles
    @property
    def dataset(self) -> Any:
        """The rows `rollout()` draws from when called without a batch."""
        return self._rows_source.dataset

    @dataset.setter
    def dataset(self, dataset: Any) -> None:
        self._rows_source = DatasetRows(dataset)

    @property
    def model(self) -> torch.nn.Module:
        """The actor model (loaded on first access)."""
        return self.roles.model("actor")

    @property
    def tokenizer(self):
        """The actor's tokenizer (loaded on first access when the actor was given by id)."""
        return self.roles.tokenizer

    @property
    def dims(self):
        """The run's [`ParallelDims`] (data-parallel rank and size, groups)."""
        return self.roles.dims

    @property
    def layout_plan(self):
        """The planner's `Plan` when `config.parallel` / `config.model_size` asked for one (None otherwise)."""
        return self.roles.layout_plan

    @property
    def actor_engine(self):
        """The actor's training engine."""
        return self.roles.engine("actor")

    @property
    def engine(self) -> RolloutEngine:
        """The actor's rollout engine (a `TransformersEngine` on the actor's weights by default)."""
        return self.roles.generator

    @property
    def algorithm(self) -> Algorithm:
        """The algorithm object (the trainers' own): the critic-free family without a critic, PPO with one."""
        if self._algorithm is None:
            self._algorithm = make_algorithm(
                self.config, critic=self.critic is not None, model=self.model, reward_weights=self.reward_weights,
                reward_names=[reward_func_name(f) for f in self.reward_funcs],
                eos_token_id=self.tokenizer.eos_token_id)
        return self._algorithm

    def _algorithm_roles(self) -> Roles:
        roles = self.roles
        return Roles(actor=self.actor_engine, dims=self.dims, reference=roles.engine("reference"),
                     critic=roles.engine("critic"), cross=roles.cross(), move=self._into, record=self._record,
                     greedy_scores=lambda batch, rows: self._round_collector().greedy_scores(
                         batch, rows, self.engine, self.reward_weights))

    def supported_parallelisms(self, reasons: bool = False) -> list[str] | dict[str, str]:
        """The parallelisms this installation and machine can run now: "data" (DDP), "fsdp" (FSDP2),
        "zero" (DeepSpeed), "sequence", "tensor", "pipeline", "expert" (see :mod:`hf_verl.planner.capabilities`).

        Args:
            reasons (`bool`): return `{name: reason}` for every parallelism instead, the reason saying
                what it runs on or why it cannot run (missing backend, too few devices, not built yet).
        """
        return supported_parallelisms(reasons=reasons)

    def placement(self) -> list[str]:
        """One line per role, also logged: its backend, its ranks or URL, its layout and the planner's memory
        estimate. Lays out (and so loads) the model roles.

        Returns:
            `list[str]`: lines `"<role>: backend=... where=... layout=... memory=..."` for the actor, the
            reference (or the actor with adapters off), the critic, each reward source and the generator.
        """
        lines = placement_report(self.roles, self.reward_funcs, self.engine)
        if self.dims.is_main:
            for line in lines:
                logger.info("placement: %s", line)
        return lines

    # ------------------------------------------------------------------ role moves and debug
    def _into(self, role: str, engine: Any, batch: Rollout) -> Rollout:
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

    def _draw(self, n: int) -> list[dict]:
        dims = self.dims
        return self._rows_source.draw(n, self.config.seed, dims.dp_rank, dims.dp_size)

    def _check_tools(self) -> None:
        if self._tool_rollout is not None and not self._tools_checked:
            self._tool_rollout.check_tokenizer(self.tokenizer)
            self._tools_checked = True

    def _rows(self, batch: Any) -> list[dict]:
        """A batch as rows (`prompt` and the other columns), each repeated `num_generations` times; with tools the
        prompts are checked against them here, on the main thread."""
        rows = batch_rows(batch if batch is not None else self._draw(self.config.rollout_batch_size),
                          self.config.num_generations)
        if self._tool_rollout is not None:
            self._check_tools()
            self._tool_rollout.check_prompts([r["prompt"] for r in rows])
        if any(row_images(r) is not None for r in rows):
            self._check_images(sorted(set(IMAGE_COLUMNS) & set(rows[0])))
        return rows

    def _check_images(self, columns: list[str]) -> None:
        """Rows with images need a vision-language actor, its processor as `tokenizer=`, and engines that take pixel
        inputs (the transformers-based ones; generation on the transformers engine, checked where it runs)."""
        check_vision_inputs(self.roles.model("actor"), self.roles.processor or self.tokenizer, columns,
                            trainer="Trainer")
        for name in ("actor", "reference"):
            engine = self.roles.engine(name)
            if engine is not None and not isinstance(engine, HFLayouts):
                raise ValueError(f"the {name} runs on {type(engine).__name__}, which does not take pixel inputs: "
                                 "place it on an accelerate backend (ddp, fsdp2, zero) to train on images.")

    def _round_collector(self) -> RoundCollector:
        """The trainers' round collector (tokenise, generate, score) over this trainer's settings."""
        if self._collector is None:
            cfg = self.config
            self._collector = RoundCollector(
                self.tokenizer, self.reward_funcs, cfg, max_new_tokens=lambda: cfg.max_completion_length,
                prompt_limit=lambda: cfg.max_prompt_length, tool_rollout=self._tool_rollout, batch_cls=Rollout,
                stream_scoring=False, processor=self.roles.processor)
        return self._collector

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
        if self.roles.sharded_rewards:
            raise ValueError("reward models are sharded with the policy (FSDP2 / ZeRO-3) and score on the main "
                             "thread: set config.use_async_rollout = False.")

    def _finish(self, served: Round) -> Rollout:
        """The algorithm's round on the main thread with the current roles: reference, values, old log-probs,
        advantages; then the rollout's metrics."""
        if not self._layout_logged:  # once per run, when every role in use is laid out
            from hf_verl.engine.registry import describe_layout

            engines = {name: self.roles.engine(name) for name in ("actor", "critic", "reference")}
            if self.dims.is_main:
                logger.info("hf_verl layout: %s", describe_layout(
                    {k: v for k, v in engines.items() if isinstance(v, TrainingEngine)}, self.engine))
            self._layout_logged = True
        if self.dims.replica_size > 1:  # the ranks of one data-parallel replica train on its first rank's rollout
            served = comm.broadcast_replica(self.dims, served)
        c, timings, cfg = served.collected, served.timings, self.config
        out = c.batch
        with trace(out.meta["trace_id"]):
            algorithm = self.algorithm
            t0 = time.perf_counter()
            algorithm.finish_round(out, c.rewards_per_func, self._algorithm_roles(), rows=c.rows,
                                   reference_now=True, old_logprobs_now=True)
            timings.update({"reference": 0.0, "critic": 0.0, "advantages": time.perf_counter() - t0})
            timings.update(getattr(algorithm, "timings", {}))
            if out.advantages.dim() == 1:  # the rollout's view: per token, as every estimator gives it
                out.advantages = out.advantages.unsqueeze(1) * out.completion_mask.to(out.advantages.dtype)
            staleness = served.staleness
            out.meta.update(weights_step=served.weights_step, off_policy=served.off_policy or staleness > 0)
            out.validate()
            timings.setdefault("weight_sync", 0.0)
            timings.setdefault("rollout_wait", 0.0)
            num_truncated = -(-c.num_truncated // cfg.num_generations)  # distinct prompts
            m = self._rollout_metrics(out, c.rewards_per_func, timings, num_truncated)
            m.update(algorithm.take_metrics())
            m.update({"rollout/staleness": staleness, "rollout/prefetched": float(served.prefetched)})
            m.update(served.metrics)  # in-flight weight updates' per-token versions
            # what the reward functions logged with log_metric (TRL's keyword)
            m.update({name: sum(v) / len(v) for name, v in c.reward_context.metrics.items() if v})
            out.meta["metrics"] = m
            self._record("rollout->compute_loss", out.tensor_fields())
            logger.info("rollout: %d completions, reward mean %.4f, %d generated tokens, staleness %d, waited "
                        "%.2fs", out.batch_size, m["reward/mean"], out.num_completion_tokens, staleness,
                        timings.get("rollout_wait", 0.0))
        return out

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

        The algorithm's loss (the configured policy loss, plus `beta` x the KL to the reference, minus
        `entropy_coef` x the entropy, aggregated per `loss_type` over the tokens of every data-parallel rank; with a
        critic, `vf_coef` x its clipped value loss). Each role's engine runs the forward and the backward of its part
        (`engine.forward_backward`); gradients accumulate over `compute_loss` calls until `step`. Each term is in the
        metrics `step` returns (`loss/policy`, `loss/value`, `loss/total`, and the algorithm's own).

        Returns:
            `torch.Tensor`: the loss value (detached: the engines have already backpropagated it).

        Raises:
            FloatingPointError: a loss that is not finite (the gradients of this call are discarded).
        """
        with trace(rollout.trace_id or new_trace_id()):
            self._record("rollout->actor", rollout.tensor_fields())
            algorithm, roles = self.algorithm, self._algorithm_roles()
            for engine in (roles.actor, roles.critic):
                if engine is not None:
                    engine.train()
            off_policy = bool(rollout.meta.get("off_policy"))
            algorithm.prepare([rollout], roles, off_policy=off_policy, recompute_old=True)
            results = algorithm.step([rollout], roles, loss_scale=1.0, global_step=self.global_step)
            m: dict[str, Any] = algorithm.take_metrics()
            if off_policy and not any(k.startswith("sampling/") for k in m) and not self._no_logprobs_logged:
                self._no_logprobs_logged = True
                logger.info("the rollout engine returned no sampling log-probs: the importance-sampling correction "
                            "of off-policy rollouts is skipped")
            loss = results[0].losses[0]
            m["loss/policy"] = m[algorithm.policy_metric]  # the policy term (the facade's name for it)
            if len(results) > 1:
                m["loss/value"] = m[algorithm.value_metric]
                loss = loss + results[1].losses[0].to(loss.device)
            m["loss/total"] = loss.item()
            if not torch.isfinite(loss):
                for engine in (roles.actor, roles.critic):
                    if engine is not None:
                        engine.zero_grad()
                raise FloatingPointError(f"the loss is {loss.item()} (terms: {m}); its gradients were discarded.")
            self._loss_metrics, self._loss_rollout, self._pending_loss = m, rollout, loss
            logger.info("compute_loss: total %.4f, policy %.4f", m["loss/total"], m["loss/policy"])
        return loss

    def _on_config_change(self, name: str, old: Any, new: Any) -> None:
        if name == "ddp_timeout" and self.roles.launched:
            watchdog.start(new)
        if name in ("model_size", "parallel") and self.roles.launched:
            logger.warning("config.%s changed after the roles were laid out (%s): the layout is planned once, before "
                           "anything is loaded; set it before the first rollout", name, self.roles.launch()[0].label)
        cfg = self.config
        actor, critic = self.roles.engines.get("actor"), self.roles.engines.get("critic")
        updates: list[tuple[Any, str, Any]] = []
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
            self.algorithm.end_step(self.dims)
            m["grad_norm/actor"] = actor.optimizer_step()
            m["lr/actor"] = actor.last_lr()[0]
            critic = self.roles.engine("critic")
            if critic is not None:
                m["grad_norm/critic"] = critic.optimizer_step()
                m["lr/critic"] = critic.last_lr()[0]
            m.update(self.algorithm.take_metrics())
            self.global_step += 1
            watchdog.set_step(self.global_step + 1)
            self._rounds.after_step()  # while it generates: before its next generation, or in flight when asked
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
        critic = self.roles.engine("critic")
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
