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
    AdaptiveKLController,
    FixedKLController,
    compute_advantages,
    masked_whiten,
    token_level_rewards,
)
from hf_verl.algorithms.importance import importance_weights
from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.policy_loss import masked_mean, ppo_clip_loss
from hf_verl.data.batch import RolloutBatch
from hf_verl.rewards.callables import combine_rewards
from hf_verl.trainers.critic import Critic, CriticStepCallback, load_value_model
from hf_verl.trainers.on_policy import OnPolicyTrainer
from hf_verl.trainers.ppo_config import PPOConfig

logger = logging.getLogger(__name__)

CRITIC_FREE = ("grpo", "rloo", "dr_grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")


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

    _tag_names = ["hf_verl", "ppo"]

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
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model, use_safetensors=True)
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
        self.critic = None
        if value_model is not None:
            value_model = load_value_model(value_model)
            if value_model.config.vocab_size != model.config.vocab_size:
                raise ValueError(
                    f"value_model vocabulary ({value_model.config.vocab_size}) differs from the policy's "
                    f"({model.config.vocab_size}): the critic reads the policy's token ids; use a critic "
                    "built on the policy's tokenizer."
                )
            self.critic = Critic(value_model, learning_rate=args.critic_learning_rate or args.learning_rate,
                                 weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                                 adam_betas=(args.adam_beta1, args.adam_beta2), adam_epsilon=args.adam_epsilon)
        super().__init__(model=model, args=args, reward_funcs=reward_model,
                         reward_processing_classes=reward_processing_classes, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, ref_model=ref_model, need_reference=need_ref,
                         is_peft=peft_config is not None)
        if self.critic is not None:
            self.critic.to(self.accelerator.device)
            self.add_callback(CriticStepCallback(self.critic, args.world_size))
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

    # ------------------------------------------------------------------ optimizers
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        super().create_optimizer_and_scheduler(num_training_steps)
        if self.critic is not None and self.critic.scheduler is None:
            self.critic.make_scheduler(self.args.lr_scheduler_type, num_training_steps,
                                       self.args.get_warmup_steps(num_training_steps))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.critic is not None:
            self.critic.load(checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self.critic is not None and self.args.should_save:
            self.critic.save(output_dir or self.args.output_dir, with_optimizer=_internal_call)

    # ------------------------------------------------------------------ round
    def _finish_round(self, batch: RolloutBatch, rows, rewards_per_func, timings) -> list[RolloutBatch]:
        args = self.args
        mask = batch.completion_mask
        scores = combine_rewards(rewards_per_func, args.reward_weights).float()
        eos = self.processing_class.eos_token_id
        has_eos = (batch.completion_ids.eq(eos) & mask.bool()).any(1)
        if args.missing_eos_penalty is not None:
            scores = torch.where(has_eos, scores, scores - args.missing_eos_penalty)
        batch.rewards = scores

        t0 = time.perf_counter()
        size = args.local_rollout_forward_batch_size
        with torch.no_grad():
            batch.old_logprobs = torch.cat([self._token_logprobs(self.model, batch.select(slice(i, i + size)))[0]
                                            for i in range(0, batch.batch_size, size)])
            if args.kl_coef > 0 or args.kl_controller == "adaptive":
                batch.ref_logprobs = self._reference_logprobs(batch)
            t1 = time.perf_counter()
            if self.critic is not None:
                batch.values = torch.cat([self.critic.values(batch.select(slice(i, i + size)))
                                          for i in range(0, batch.batch_size, size)]) * mask
        t2 = time.perf_counter()

        kl = None
        if batch.ref_logprobs is not None:
            kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, args.kl_estimator) * mask
        kl_coef = 0.0 if args.use_kl_loss else self.kl_ctl.value
        token_rewards, non_score = token_level_rewards(scores, mask, kl, kl_coef)
        if args.whiten_rewards:
            token_rewards = masked_whiten(token_rewards, mask, shift_mean=False) * mask
        batch.token_rewards = token_rewards
        if args.advantage_estimator in ("gae", "reinforce_plus_plus"):  # token rewards (KL included), local
            advantages, returns = compute_advantages(
                args.advantage_estimator, token_rewards=token_rewards, values=batch.values, mask=mask,
                gamma=args.gamma, lam=args.lam,
            )
        else:  # outcome estimators over the global round (groups may span processes)
            greedy = self._greedy_baseline_scores(batch, rows) if args.advantage_estimator == "remax" else None
            advantages, returns = self._global_advantages(scores, mask, greedy), None
        if args.advantage_estimator == "gae" and args.whiten_advantages:
            advantages = masked_whiten(advantages, mask) * mask
        batch.advantages, batch.returns = advantages, returns
        batch.validate()

        self._log_round(batch, rewards_per_func, scores, kl, non_score, has_eos,
                        timings | {"reference": t1 - t0, "critic": t2 - t1})
        if kl is not None and args.kl_controller == "adaptive":
            mean_kl = self.accelerator.gather(kl.sum(1)).mean().item()
            self.kl_ctl.update(mean_kl, args.batch_size)
        micro = self._split_round(batch)
        if args.use_async_rollout or args.use_vllm:  # behaviour policy != trainer: log the gap, correct it
            for mb in micro:
                weights, stats = importance_weights(
                    mb.old_logprobs, mb.sampling_logprobs, mb.completion_mask, args.vllm_importance_sampling_mode,
                    args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
                if args.vllm_importance_sampling_correction:
                    mb.meta["is_weights"] = weights
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
    def compute_loss(self, model, inputs: RolloutBatch, return_outputs=False, num_items_in_batch=None):
        batch, args, m = inputs, self.args, self._metrics
        mask = batch.completion_mask
        maskf = mask.float()
        loss = torch.zeros((), device=batch.device)
        warming_up = self.critic is not None and self.state.global_step < args.critic_warmup_steps
        if not warming_up:
            logp, entropy = self._token_logprobs(model, batch, with_entropy=True)
            per_token, clip = ppo_clip_loss(logp, batch.old_logprobs, batch.advantages, mask, args.cliprange)
            if "is_weights" in batch.meta:
                per_token = per_token * batch.meta["is_weights"]
            pg_loss = masked_mean(per_token, mask)
            loss = loss + pg_loss
            if args.use_kl_loss and batch.ref_logprobs is not None:
                kl = kl_penalty(logp, batch.ref_logprobs, "k3")
                loss = loss + self.kl_ctl.value * masked_mean(kl, mask)
                m["loss/kl_avg"].append(masked_mean(kl.detach(), mask).item())
            with torch.no_grad():
                diff = (logp - batch.old_logprobs) * maskf
                m["loss/policy_avg"].append(pg_loss.item())
                m["policy/approxkl_avg"].append((0.5 * masked_mean(diff.square(), mask)).item())
                m["policy/clipfrac_avg"].append(masked_mean(clip["region_clip"], mask).item())
                m["policy/entropy_avg"].append(masked_mean(entropy, mask).item())
                m["val/ratio"].append(masked_mean(diff.exp(), mask).item())
        if self.critic is not None:
            vpred = self.critic.values(batch)
            vclipped = torch.clamp(vpred, batch.values - args.cliprange_value, batch.values + args.cliprange_value)
            losses1 = (vpred - batch.returns).square()
            losses2 = (vclipped - batch.returns).square()
            vf_loss = 0.5 * masked_mean(torch.max(losses1, losses2), mask)
            loss = loss + args.vf_coef * vf_loss
            m["loss/value_avg"].append(vf_loss.item())
            m["val/clipfrac_avg"].append(masked_mean((losses2 > losses1).float(), mask).item())
        return loss
