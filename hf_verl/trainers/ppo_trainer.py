"""`PPOTrainer`: PPO with a learned critic and GAE, as a `transformers.Trainer` subclass.

Constructor and config follow TRL's experimental PPOTrainer (<= 1.10), so a TRL PPO script runs
after changing its import line. Per update (one round of `local_batch_size` completions per
process), in this order:

1. generate (the shared on-policy machinery), score with the reward model(s) or functions;
   `missing_eos_penalty` for completions without EOS;
2. no-grad forwards in chunks of `local_rollout_forward_batch_size`: the rollout policy's
   log-probs, the reference's (when a KL term is on) and the critic's per-token values;
3. token rewards: the score on the last completion token minus `kl_coef x KL` per token (or KL
   as a loss term with `use_kl_loss`); `kl_coef` fixed or from the adaptive controller;
   optional reward whitening; advantages by `advantage_estimator` (GAE by default) and
   advantage whitening;
4. `num_ppo_epochs` passes over `num_mini_batches` shuffled mini-batches: clipped policy loss
   plus `vf_coef x` clipped value loss; the critic has its own optimizer, learning rate and
   warm-up (`critic_warmup_steps`: policy frozen).
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_verl.algorithms.estimators import (
    CRITIC_FREE_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    token_level_rewards,
)
from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.policy_loss import masked_mean
from hf_verl.data.batch import LossInputs, RolloutBatch
from hf_verl.engine.step import LogProbs, PolicyOutput, Values
from hf_verl.trainers.engine_glue import load_for_launch
from hf_verl.parallel import comm
from hf_verl.pipeline import losses, phases
from hf_verl.rewards.callables import combine_rewards
from hf_verl.trainers.critic import (
    CriticStepCallback,
    critic_optimizer_spec,
    load_critic,
    load_value_model,
    save_critic,
)
from hf_verl.trainers.on_policy import OnPolicyTrainer
from hf_verl.trainers.ppo_config import PPOConfig

logger = logging.getLogger(__name__)

CRITIC_FREE = CRITIC_FREE_ESTIMATORS


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over the mask (1: perfect critic, <= 0: useless)."""
    m = mask.bool()
    ret, val = returns[m].float(), values[m].float()
    var = ret.var() if ret.numel() > 1 else ret.new_tensor(0.0)
    if var.item() == 0:
        return float("nan")
    return (1 - (ret - val).var() / var).item()


class PPOTrainer(OnPolicyTrainer):
    """Train a causal LM with PPO and a critic (TRL's experimental PPOTrainer arguments).

    Args:
        args ([`PPOConfig`]): the configuration.
        processing_class: the policy tokenizer.
        model (`str` or `PreTrainedModel`): the policy (Hub id, path or model).
        ref_model (`PreTrainedModel`, *optional*): the reference; default a frozen copy of `model`
            when a KL term is on (with `peft_config`: the model with adapters disabled).
        reward_model: an `AutoModelForSequenceClassification` (object, Hub id or path), a reward
            function (TRL's GRPO convention), or a list of them (weighted by `reward_weights`).
        train_dataset: prompts as a `prompt` column (text or messages) or pre-tokenised `input_ids`.
        value_model: the critic (object, Hub id or path; `num_labels=1`). Needed by
            `advantage_estimator="gae"`; critic-free estimators run without it.
        data_collator: accepted for TRL compatibility; rows are batched by the trainer.
        eval_dataset, optimizers, callbacks, peft_config: as in TRL.
    """

    _tag_names = ["trl", "ppo", "hf_verl"]

    def __init__(self, args: PPOConfig | None = None, processing_class=None, model=None, ref_model=None,
                 reward_model=None, train_dataset=None, value_model=None, data_collator=None, eval_dataset=None,
                 optimizers=(None, None), callbacks=None, peft_config=None, reward_processing_classes=None) -> None:
        if model is None:
            raise ValueError("PPOTrainer needs `model` (the policy).")
        if reward_model is None:
            raise ValueError("PPOTrainer needs `reward_model`: a reward model, id/path, or reward function(s).")
        if ref_model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` must be different objects; pass ref_model=None to get a "
                             "frozen copy (or, with peft, the model with adapters disabled).")
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = PPOConfig(f"{str(name).split('/')[-1]}-PPO")
        if isinstance(model, str):  # sharded under FSDP2 / ZeRO-3 (docs/loading.md), except with PEFT
            whole = lambda path: AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)  # noqa: E731
            model = whole(model) if peft_config is not None else load_for_launch(model, {"dtype": "auto"}, args,
                                                                                   load_whole=whole)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if data_collator is not None:
            logger.warning("PPOTrainer batches prompt rows itself; the data_collator argument is not used.")
        self._check_critic(args, value_model)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        self.kl_ctl = (AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
                       if args.kl_controller == "adaptive" else FixedKLController(args.kl_coef))
        need_ref = args.kl_coef > 0 or args.kl_controller == "adaptive"
        if value_model is not None:
            value_model = load_value_model(value_model)
            if value_model.config.vocab_size != model.config.vocab_size:
                raise ValueError(
                    f"value_model vocabulary ({value_model.config.vocab_size}) differs from the policy's "
                    f"({model.config.vocab_size}): the critic reads the policy's token ids; use a critic "
                    "built on the policy's tokenizer."
                )
        super().__init__(model=model, args=args, reward_funcs=reward_model,
                         reward_processing_classes=reward_processing_classes, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, ref_model=ref_model, need_reference=need_ref,
                         is_peft=peft_config is not None)
        self.critic = None
        if value_model is not None:
            if self.backend.kind == "deepspeed" and args.critic_warmup_steps:
                raise ValueError("critic_warmup_steps > 0 is not supported with DeepSpeed (the frozen policy would "
                                 "miss its accumulation steps): set critic_warmup_steps=0 or use DDP / FSDP2.")
            self.critic = self._make_engine(value_model.to(self.args.device), "critic", trainable=True,
                                            pad_token_id=processing_class.pad_token_id)
            self.add_callback(CriticStepCallback(self.critic))
        self._configure_stop(args, processing_class)
        self._episodes = 0
        self._sample_every = None

    @staticmethod
    def _check_critic(args: PPOConfig, value_model) -> None:
        if args.advantage_estimator == "gae" and value_model is None:
            raise ValueError(
                "advantage_estimator='gae' needs a value_model (the critic); pass one, or pick a critic-free "
                f"estimator: {CRITIC_FREE} (with num_generations >= 2 for the group ones)."
            )

    def _configure_stop(self, args: PPOConfig, tokenizer) -> None:
        """TRL's rule: stop at EOS only with stop_token='eos' or a stop_token_id, else run to response_length
        (transformers engine; vLLM and servers stop at the model's EOS)."""
        if not hasattr(self.engine, "eos_token_ids"):
            return
        if args.stop_token == "eos":
            self.engine.eos_token_ids = {int(tokenizer.eos_token_id)}
        elif args.stop_token_id is not None:
            self.engine.eos_token_ids = {int(args.stop_token_id)}
        else:
            self.engine.eos_token_ids = set()

    def _max_new_tokens(self) -> int:
        return self.args.response_length

    # ------------------------------------------------------------------ optimizers and checkpoints
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.critic is not None and not self.critic.has_optimizer:
            self.critic.configure_optimizer(critic_optimizer_spec(self.args, num_training_steps))
        return scheduler

    def _trained_engines(self) -> list:
        return [self.actor] + ([self.critic] if self.critic is not None else [])

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.critic is not None:
            load_critic(self.critic, checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self.critic is not None:
            save_critic(self.critic, output_dir or self.args.output_dir, with_optimizer=_internal_call)

    # ------------------------------------------------------------------ round
    def _finish_round(self, batch: RolloutBatch, rows, rewards_per_func, timings) -> list[RolloutBatch]:
        args, dims = self.args, self.dims
        mask = batch.completion_mask
        scores = combine_rewards(rewards_per_func, args.reward_weights).float()
        eos = self.processing_class.eos_token_id
        has_eos = (batch.completion_ids.eq(eos) & mask.bool()).any(1)
        if args.missing_eos_penalty is not None:
            scores = torch.where(has_eos, scores, scores - args.missing_eos_penalty)
        batch.rewards = scores

        t0 = time.perf_counter()
        kw = dict(self._logprob_kwargs(), micro_batch=args.local_rollout_forward_batch_size)
        batch.old_logprobs = phases.policy_logprobs(self.actor, batch, **kw)
        if args.kl_coef > 0 or args.kl_controller == "adaptive":
            batch.ref_logprobs = phases.reference_logprobs(self.reference, self.actor, batch, **kw)
        t1 = time.perf_counter()
        if self.critic is not None:
            batch.values = phases.critic_values(self.critic, batch, micro_batch=kw["micro_batch"]) * mask
        t2 = time.perf_counter()

        kl = None
        if batch.ref_logprobs is not None:
            kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, args.kl_estimator) * mask
        kl_coef = 0.0 if args.use_kl_loss else self.kl_ctl.value
        token_rewards, non_score = token_level_rewards(scores, mask, kl, kl_coef)
        if args.whiten_rewards:
            token_rewards = phases.global_masked_whiten(dims, token_rewards, mask, shift_mean=False) * mask
        batch.token_rewards = token_rewards
        greedy = self._greedy_baseline_scores(batch, rows) if args.advantage_estimator == "remax" else None
        advantages, returns = phases.advantages(
            dims, args.advantage_estimator, scores=scores, mask=mask, num_generations=args.num_generations,
            gamma=args.gamma, lam=args.lam, values=batch.values,
            token_rewards=token_rewards if args.advantage_estimator in ("gae", "reinforce_plus_plus") else None,
            greedy_scores=greedy)
        if args.advantage_estimator == "gae" and args.whiten_advantages:
            advantages = phases.global_masked_whiten(dims, advantages, mask) * mask
        batch.advantages, batch.returns = advantages, returns
        batch.validate()

        self._log_round(batch, rewards_per_func, scores, kl, non_score, has_eos,
                        timings | {"reference": t1 - t0, "critic": t2 - t1})
        if kl is not None and args.kl_controller == "adaptive":
            mean_kl = comm.gather_rows(dims, kl.sum(1)).mean().item()
            self.kl_ctl.update(mean_kl, args.batch_size)
        micro = self._split_round(batch)
        for mb, normalizer in zip(micro, self._micro_batch_normalizers(micro)):
            mb.loss_inputs = LossInputs(loss_normalizer=normalizer)
            if args.use_async_rollout or args.use_vllm:  # behaviour policy != trainer: log the gap, correct it
                stats = phases.attach_importance_weights(
                    mb, mode=args.vllm_importance_sampling_mode, clip_min=args.vllm_importance_sampling_clip_min,
                    clip_max=args.vllm_importance_sampling_clip_max, correct=args.vllm_importance_sampling_correction)
                for k, v in stats.items():
                    self._metrics[k].append(v)
        return micro

    def _log_round(self, batch, rewards_per_func, scores, kl, non_score, has_eos, timings) -> None:
        m, args = self._metrics, self.args
        mask = batch.completion_mask
        self._episodes += args.batch_size
        if kl is not None:
            m["objective/kl"].append(kl.sum(1).mean().item())
        m["objective/entropy"].append((-batch.old_logprobs * mask).sum(1).mean().item())
        m["objective/non_score_reward"].append(non_score.sum(1).mean().item())
        m["objective/rlhf_reward"].append(non_score.sum(1).mean().item() + scores.mean().item())
        m["objective/scores"].append(scores.mean().item())
        m["objective/kl_coef"].append(self.kl_ctl.value)
        m["val/num_eos_tokens"].append(float(has_eos.sum().item()))
        for i, name in enumerate(self.reward_names):
            m[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
        if batch.values is not None and batch.returns is not None:
            m["critic/vf_explained_var"].append(explained_variance(batch.values, batch.returns, mask))
            m["critic/values_mean"].append(masked_mean(batch.values, mask).item())
        m["episode"].append(float(self._episodes))
        self._log_common(batch, timings)
        every = max(1, int(self.state.max_steps // max(args.num_sample_generations, 1))) if args.num_sample_generations else 0
        if every and self.state.global_step % every == 0 and self.is_world_process_zero():
            logger.info("sample at step %d: %r -> %r (score %.3f)", self.state.global_step,
                        batch.meta["prompts"][0], batch.meta["completions"][0], scores[0].item())

    # ------------------------------------------------------------------ loss
    def _policy_loss(self, out: PolicyOutput, batch: RolloutBatch):
        """`(loss, metrics)` of one micro-batch from the actor's forward (no collective: normaliser and entropy
        threshold come with `batch.loss_inputs`)."""
        args, inputs = self.args, batch.loss_inputs
        use_kl = args.use_kl_loss and batch.ref_logprobs is not None
        loss, st = losses.policy_loss(
            out.logp, batch, loss=args.resolved_policy_loss(), params=args.policy_loss_params(),
            loss_type=args.loss_agg_mode, normalizer=inputs.loss_normalizer, max_completion_length=args.response_length,
            kl_coef=self.kl_ctl.value if use_kl else 0.0, kl_estimator="k3",
            kl_bias_correction=args.use_bias_correction_kl, entropy=out.entropy, entropy_coef=args.entropy_coef,
            entropy_normalizer=inputs.loss_normalizer, off_policy_threshold=args.off_policy_mask_threshold,
            entropy_threshold=inputs.entropy_threshold)
        metrics = {"loss/policy_avg": st["policy"], "policy/approxkl_avg": st["approx_kl"],
                   "policy/clipfrac_avg": st["clip_region"], "policy/entropy_avg": st["entropy"], "val/ratio": st["ratio"]}
        if use_kl:
            metrics["loss/kl_avg"] = st["kl"]
        return loss, metrics

    def _value_loss(self, values: torch.Tensor, batch: RolloutBatch):
        """`(vf_coef x clipped value loss, metrics)` of one micro-batch from the critic's forward."""
        args = self.args
        vloss, st = losses.value_loss(values, batch, clip=args.cliprange_value,
                                      normalizer=batch.loss_inputs.loss_normalizer)
        return args.vf_coef * vloss, {"loss/value_avg": st["value"], "val/clipfrac_avg": st["clip_frac"]}

    def _engine_windows(self, micro_batches: list[RolloutBatch], loss_scale: float | None) -> list:
        """The actor's window (unless the critic is still warming up) and the critic's, each through its engine."""
        training = loss_scale is not None
        step = dict(forward_only=not training, loss_scale=loss_scale or 1.0)
        results = []
        warming_up = self.critic is not None and self.state.global_step < self.args.critic_warmup_steps
        if not warming_up:
            kw = self._logprob_kwargs()
            request = LogProbs(temperature=kw["temperature"], chunk_size=kw["chunk_size"], with_entropy=True)
            if training:
                self._set_entropy_thresholds(micro_batches, request)
            results.append(self.actor.forward_backward(micro_batches, self._policy_loss, forward=request, **step))
        if self.critic is not None:
            results.append(self.critic.forward_backward(micro_batches, self._value_loss, forward=Values(), **step))
        for result in results:
            self._take_step_metrics(result)
        return results
