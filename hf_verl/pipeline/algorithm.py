"""`Algorithm`: one family of RL algorithms as every front-end runs it.

An algorithm object turns a generated and scored round into what its loss reads (advantages, and the reference,
old log-probs, values and token rewards its family needs), prepares the micro-batches of a step (loss
normalisers, importance weights, the log-probs the round left to them), runs each trained role's
`engine.forward_backward` with its loss function, and reports its metrics under stable names. The front-ends only
decide *when*: `GRPOTrainer` / `PPOTrainer` from `transformers.Trainer`'s accumulation windows, the facade from
the user's `rollout` / `compute_loss` / `step`; both hold the same object, made by :func:`~hf_verl.pipeline.families.make_algorithm`.

Two families ship, each in its own module:

- :class:`~hf_verl.pipeline.critic_free.CriticFreeAlgorithm`: GRPO and every critic-free estimator (TRL's GRPO
  semantics and metric names);
- :class:`~hf_verl.pipeline.ppo.PPOAlgorithm`: a critic with GAE (or any estimator), the KL to the reference as a
  reward penalty or a loss term (TRL's PPO semantics and metric names).

Settings are read live from the front-end's config, in either vocabulary (a `GRPOConfig` / the facade's
`TrainerConfig`, or TRL's PPO names: `cliprange`, `loss_agg_mode`, `response_length`): :func:`policy_objective`
is the one place that reads them. The estimator and the policy loss are looked up in the registries
(:mod:`hf_verl.algorithms.registry`), so a user's own runs under any front-end.

What an algorithm reads of the roles comes in :class:`Roles` (the role builder's product): the actor, the
reference (an engine, a served reference, or none: the actor with adapters off), the critic, the data-parallel
layout, and hooks of the front-end (moving a batch to a role's device, debug records, ReMax's greedy baseline).
"""

from __future__ import annotations

import abc
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_verl.algorithms.policy_losses import PolicyLossParams
from hf_verl.algorithms.registry import (
    POLICY_LOSSES,
    advantage_estimator_names,
    get_advantage_estimator,
)
from hf_verl.data.batch import LossInputs, RolloutBatch
from hf_verl.engine.model_options import router_aux_loss
from hf_verl.engine.step import LogProbs, PolicyOutput, StepResult
from hf_verl.parallel.dims import ParallelDims
from hf_verl.pipeline import losses, phases
from hf_verl.pipeline.entropy_control import EntropyController


def _same(_role: str, _engine: Any, batch: RolloutBatch) -> RolloutBatch:
    return batch


def _ignore(_boundary: str, _tensors: dict) -> None:
    return None


@dataclass
class Roles:
    """The roles an algorithm reads in a round and trains in a step.

    Attributes:
        actor ([`TrainingEngine`]): the policy.
        dims ([`ParallelDims`]): the data-parallel layout (group statistics and normalisers span it).
        reference (*optional*): the reference's engine, or a served reference answering `infer`
            (:class:`~hf_verl.engine.remote_reference.RemoteReference`); None: the actor with adapters off.
        critic ([`TrainingEngine`], *optional*): the value model.
        cross ([`CrossTokenizer`], *optional*): the reference's re-tokenisation when its tokenizer differs.
        move (`Callable`): `move(role, engine, batch)`, the batch on a role's device (the facade's roles may sit on
            other devices); default: unchanged.
        record (`Callable`): `record(boundary, tensors)`, a debug hook at role boundaries; default: nothing.
        greedy_scores (`Callable`, *optional*): `greedy_scores(batch, rows)`, the combined reward of one greedy
            completion per prompt (ReMax's baseline), from the front-end's rollout engine and reward sources.
    """

    actor: Any
    dims: ParallelDims
    reference: Any = None
    critic: Any = None
    cross: Any = None
    move: Callable[[str, Any, RolloutBatch], RolloutBatch] = _same
    record: Callable[[str, dict], None] = _ignore
    greedy_scores: Callable[[RolloutBatch, list], torch.Tensor] | None = None


@dataclass(frozen=True)
class Objective:
    """The policy objective a config asks for now (:func:`policy_objective`)."""

    form: str
    params: PolicyLossParams
    aggregation: str
    max_completion_length: int | None
    temperature: float
    chunk_size: int


def _get(config: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` that `config` carries (the trainers' and TRL PPO's vocabularies)."""
    for name in names:
        if hasattr(config, name):
            return getattr(config, name)
    return default


def policy_objective(config: Any, temperature: float | None = None) -> Objective:
    """The objective of `config`, in either vocabulary: the loss form and its parameters (:mod:`~hf_verl.pipeline.
    losses`), the aggregation (`loss_type`, or PPO's `loss_agg_mode`), the completion limit (`max_completion_length`
    or PPO's `response_length`), the scoring temperature (the sampling one, 1 for greedy) and log-prob chunk."""
    if temperature is None:
        temperature = config.temperature
    return Objective(
        form=losses.loss_form(config), params=losses.loss_params(config),
        aggregation=_get(config, "loss_agg_mode", "loss_type", default="dapo"),
        max_completion_length=_get(config, "max_completion_length", "response_length"),
        temperature=temperature if temperature > 0 else 1.0, chunk_size=_get(config, "logprob_chunk_size",
                                                                             default=1024))


class Algorithm(abc.ABC):
    """One family of RL algorithms (see the module docstring).

    Args:
        config: the front-end's live config (`GRPOConfig`, `PPOConfig` or the facade's `TrainerConfig`).
        model (`torch.nn.Module`, *optional*): the actor model, to resolve a Mixture of Experts' router loss.
        metrics (`dict[str, list]`, *optional*): where metrics are appended (a trainer's buffer); default: the
            object's own, which :meth:`take_metrics` drains.
        sampling_temperature (`Callable`, *optional*): the temperature completions are sampled at now (the config's,
            or TRL's `generation_kwargs` override); default: `config.temperature`.
        forward_batch_size (`Callable`, *optional*): rows per no-grad forward of a batch (reference, old log-probs,
            values); default: the whole batch at once.
    """

    name = "algorithm"
    policy_metric = "policy_loss"  # the metric holding the policy term alone (no KL, no entropy bonus)
    value_metric = "loss/value_avg"  # the metric holding the critic's value loss (before vf_coef)
    trains_critic = False
    normalizes_over_round = False  # the token-mean loss's normaliser: the round's tokens per step, or the step's

    def __init__(self, config: Any, *, model: torch.nn.Module | None = None,
                 metrics: dict[str, list] | None = None, sampling_temperature: Callable[[], float] | None = None,
                 forward_batch_size: Callable[[int], int | None] | None = None) -> None:
        self.config = config
        self.metrics: dict[str, list] = metrics if metrics is not None else defaultdict(list)
        self._temperature = sampling_temperature or (lambda: config.temperature)
        self._forward_batch = forward_batch_size or (lambda rows: rows)
        self.entropy_control = EntropyController.from_args(config)
        self.timings: dict[str, float] = {}  # seconds of the last round's forwards (reference, critic, ...)
        coef = _get(config, "router_aux_loss_coef")
        self.aux_loss_coef, self.aux_loss_enabled = router_aux_loss(model, coef) if model is not None else (0.0, False)

    # ------------------------------------------------------------------ settings, read live
    @property
    def estimator(self) -> str:
        """The advantage estimator's registered name (the facade's "auto": GAE with a critic, else GRPO)."""
        name = self.config.advantage_estimator
        if name == "auto":
            return "gae" if self.trains_critic else "grpo"
        return name

    def check_roles(self, roles: Roles) -> None:
        """The estimator against the roles (read live: the facade's config may change between rounds).

        Raises:
            ValueError: an estimator that needs a critic without one, or a critic it does not use.
        """
        spec = get_advantage_estimator(self.estimator)
        if spec.needs_critic and roles.critic is None:
            raise ValueError(f"advantage_estimator {self.estimator!r} needs a critic: pass a value model (PPOTrainer's "
                             "value_model=, the facade's critic_model=), or choose a critic-free estimator "
                             f"{advantage_estimator_names(critic=False)}.")
        if roles.critic is not None and not spec.needs_critic:
            raise ValueError(f"advantage_estimator {self.estimator!r} does not use the critic; set "
                             "advantage_estimator='gae' (or the facade's 'auto'), or drop the value model.")

    def objective(self) -> Objective:
        return policy_objective(self.config, self._temperature())

    def scoring(self, rows: int) -> dict[str, Any]:
        """Keyword arguments of the no-grad log-prob phases for a batch of `rows`."""
        objective = self.objective()
        return {"temperature": objective.temperature, "chunk_size": objective.chunk_size,
                "micro_batch": self._forward_batch(rows)}

    def forward_request(self) -> LogProbs:
        """What the actor's training forward computes: log-probs, entropy, and a router loss where it counts."""
        objective = self.objective()
        return LogProbs(temperature=objective.temperature, chunk_size=objective.chunk_size, with_entropy=True,
                        with_aux_loss=self.aux_loss_enabled)

    def entropy_coef(self) -> float:
        """The entropy-bonus coefficient in force (adaptive control moves it each optimizer step)."""
        control = self.entropy_control
        if control is not None and control.adaptive:
            return control.applied_coef()
        return float(self.config.entropy_coef)

    # ------------------------------------------------------------------ the round
    @abc.abstractmethod
    def finish_round(self, batch: RolloutBatch, rewards_per_func: torch.Tensor, roles: Roles, *,
                     rows: Sequence[dict], reference_now: bool = False, old_logprobs_now: bool = False) -> None:
        """Fill `batch` with what the loss reads, on this rank's whole round (statistics span the data-parallel
        group): rewards, advantages and the family's other inputs; `reference_now` / `old_logprobs_now` compute the
        reference's and the generating policy's log-probs here rather than per micro-batch in :meth:`prepare`."""

    def reference_logprobs(self, batch: RolloutBatch, roles: Roles) -> torch.Tensor:
        """`(B, C)` reference log-probs of `batch` (float32 on the batch's device)."""
        kw = self.scoring(batch.batch_size)
        reference = roles.reference
        if reference is None:
            return phases.reference_logprobs(None, roles.actor, batch, **kw)
        moved = roles.move("reference", reference, batch)
        roles.record("actor->reference", {"input_ids": moved.input_ids, "attention_mask": moved.attention_mask})
        lp = phases.reference_logprobs(reference, roles.actor, moved, cross=roles.cross, **kw)
        roles.record("reference->rollout", {"ref_logprobs": lp})
        return lp.to(device=batch.device, dtype=torch.float32)

    def old_logprobs(self, batch: RolloutBatch, roles: Roles) -> torch.Tensor:
        """`(B, C)` log-probs of the actor as it is now (the generating policy of an on-policy round)."""
        return phases.policy_logprobs(roles.actor, batch, **self.scoring(batch.batch_size))

    def advantage_inputs(self, batch: RolloutBatch, roles: Roles, rows: Sequence[dict]) -> dict[str, Any]:
        """The costly inputs the estimator asks for (:data:`~hf_verl.algorithms.registry.COSTLY_INPUTS`): ReMax's
        greedy baseline, the sampling policy's token statistics. Values come from the family's round."""
        estimator = get_advantage_estimator(self.estimator)
        inputs: dict[str, Any] = {}
        if "greedy_scores" in estimator.requires:
            if roles.greedy_scores is None:
                raise ValueError(f"advantage_estimator={self.estimator!r} needs a greedy baseline, which this "
                                 "rollout path cannot generate; choose another estimator.")
            inputs["greedy_scores"] = roles.greedy_scores(batch, list(rows))
        if {"old_logprobs", "sum_pi_squared"} & set(estimator.requires):
            batch.old_logprobs, inputs["sum_pi_squared"] = phases.sampling_statistics(
                roles.actor, batch, **self.scoring(batch.batch_size))
            inputs["old_logprobs"] = batch.old_logprobs
        return inputs

    # ------------------------------------------------------------------ the micro-batches of a step
    def prepare(self, micro_batches: Sequence[RolloutBatch], roles: Roles, *, off_policy: bool,
                recompute_old: bool, steps_per_round: int | None = None) -> None:
        """Per micro-batch: its :class:`LossInputs` (normalisers over every data-parallel rank), the reference's
        and (with `recompute_old`, or `off_policy`) the actor's log-probs where the round left them to this step,
        and with `off_policy`, the engine/trainer importance weights (TRL's `sampling/*` metrics).

        Args:
            steps_per_round (`int`, *optional*): optimizer steps the round's micro-batches make; the families that
                take a token mean over the round (the critic-free one, TRL's GRPO) divide by the round's tokens per
                step. None: each micro-batch's own tokens.
        """
        dp = roles.dims.dp_size
        counts = phases.micro_batch_token_counts(roles.dims, list(micro_batches))
        round_normalizer = None
        if steps_per_round is not None and self.normalizes_over_round:
            round_normalizer = sum(counts) / (steps_per_round * dp)
        for mb, count in zip(micro_batches, counts):
            mb.loss_inputs = LossInputs(loss_normalizer=count / dp if round_normalizer is None else round_normalizer,
                                        token_normalizer=count / dp)
            if self.kl_coef() > 0 and mb.ref_logprobs is None:
                mb.ref_logprobs = self.reference_logprobs(mb, roles)
            if (recompute_old or off_policy) and mb.old_logprobs is None:
                mb.old_logprobs = self.old_logprobs(mb, roles)
            if off_policy:  # behaviour/trainer mismatch, logged always, corrected when asked
                self._record(self.importance_weights(mb))

    def importance_weights(self, batch: RolloutBatch) -> dict[str, float]:
        """Truncated / masked engine/trainer importance weights into `batch.is_weights` (when the config corrects),
        and TRL's `sampling/*` metrics (empty when the engine returned no log-probs)."""
        c = self.config
        return phases.attach_importance_weights(
            batch, mode=c.vllm_importance_sampling_mode, clip_min=c.vllm_importance_sampling_clip_min,
            clip_max=c.vllm_importance_sampling_clip_max, correct=c.vllm_importance_sampling_correction)

    # ------------------------------------------------------------------ the step
    @abc.abstractmethod
    def kl_coef(self) -> float:
        """The weight of the KL-to-reference loss term now (0: no term, no reference forward in the step)."""

    def policy_loss(self, out: PolicyOutput, batch: RolloutBatch, *, observe: bool = False
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor's loss of one micro-batch from its forward `out`, and the loss's statistics (no collective: the
        normalisers and the entropy threshold come with `batch.loss_inputs`). `observe`: feed adaptive entropy
        control this step's entropies (a training step)."""
        c, objective, inputs = self.config, self.objective(), batch.loss_inputs
        loss, stats = losses.policy_loss(
            out.logp, batch, loss=objective.form, params=objective.params, loss_type=objective.aggregation,
            normalizer=inputs.loss_normalizer, max_completion_length=objective.max_completion_length,
            kl_coef=self.kl_coef(), kl_estimator=self.kl_estimator(), kl_bias_correction=c.use_bias_correction_kl,
            entropy=out.entropy, entropy_coef=self.entropy_coef(), entropy_normalizer=inputs.token_normalizer,
            entropy_threshold=inputs.entropy_threshold, off_policy_threshold=c.off_policy_mask_threshold)
        if observe and self.entropy_control is not None:
            self.entropy_control.observe(out.entropy.detach(), batch.completion_mask)
        if self.aux_loss_enabled:
            loss = loss + self.aux_loss_coef * out.aux_loss
            stats["aux_loss"] = out.aux_loss.detach()
        return loss, stats

    def kl_estimator(self) -> str:
        """The estimator of the KL loss term (the schema's `kl_estimator`, k3 unless set)."""
        return _get(self.config, "kl_estimator", default="k3")

    @abc.abstractmethod
    def policy_metrics(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The family's metric names for a micro-batch's policy-loss statistics."""

    def step(self, micro_batches: Sequence[RolloutBatch], roles: Roles, *, loss_scale: float | None,
             global_step: int = 0) -> list[StepResult]:
        """Each trained role's `forward_backward` over the step's micro-batches (`loss_scale` None: forward only,
        no graph); returns the roles' :class:`StepResult` (the actor's first)."""
        training = loss_scale is not None
        results = []
        if self.trains_actor(roles, global_step):
            request = self.forward_request()
            if training:
                phases.set_entropy_thresholds(roles.actor, roles.dims, list(micro_batches), request,
                                              self.config.top_entropy_quantile)

            def actor_loss(out, mb):
                loss, stats = self.policy_loss(out, mb, observe=training)
                return loss, {**self.policy_metrics(stats), **out.routing}  # routing: an MoE's (hf_verl.moe)

            results.append(roles.actor.forward_backward(list(micro_batches), actor_loss, forward=request,
                                                        forward_only=not training, loss_scale=loss_scale or 1.0))
        results += self.critic_step(micro_batches, roles, loss_scale=loss_scale)
        for result in results:
            for metrics in result.metrics:
                self._record(metrics)
        return results

    def trains_actor(self, roles: Roles, global_step: int) -> bool:
        return True

    def critic_step(self, micro_batches: Sequence[RolloutBatch], roles: Roles, *, loss_scale: float | None
                    ) -> list[StepResult]:
        return []

    def end_step(self, dims: ParallelDims) -> None:
        """After each optimizer step: adaptive entropy control moves its coefficient (`entropy_coef` metric)."""
        if self.entropy_control is not None:
            self.metrics["entropy_coef"].append(self.entropy_control.end_step(dims))

    # ------------------------------------------------------------------ metrics
    def _record(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            self.metrics[name].append(float(value))

    def take_metrics(self) -> dict[str, float]:
        """The mean of every metric recorded since the last call (this rank's), and the buffer emptied."""
        out = {k: sum(v) / len(v) for k, v in self.metrics.items() if v}
        self.metrics.clear()
        return out


def policy_loss_metric_names(form: str) -> dict[str, str] | None:
    """stat -> logged name of a registered loss form's own statistics (None: every stat under its own name)."""
    spec = POLICY_LOSSES.get(form)
    return None if spec is None else spec.metrics


def is_ppo_config(config: Any) -> bool:
    """Whether a config speaks TRL PPO's vocabulary (a `PPOConfig`)."""
    return hasattr(config, "num_ppo_epochs")
