"""`GRPOTrainer`: Group Relative Policy Optimization as a `transformers.Trainer` subclass.

The rollout machinery (rounds, buffer, data parallel layout, metrics plumbing) is
:class:`~hf_verl.trainers.on_policy.OnPolicyTrainer`'s. GRPO adds, per round: rewards gathered
from every process and normalised per group (`grpo_advantages`; a group may span processes), the
reference log-probs when beta > 0, the generating policy's log-probs when the policy moves before
the round is used up; and the loss: PPO clip + k3 KL, aggregated per `loss_type`.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_verl.algorithms.advantages import grpo_advantages
from hf_verl.algorithms.importance import importance_weights
from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.policy_loss import aggregate_loss, masked_mean, ppo_clip_loss
from hf_verl.data.batch import RolloutBatch
from hf_verl.rewards.callables import combine_rewards
from hf_verl.trainers.grpo_config import GRPOConfig
from hf_verl.trainers.on_policy import OnPolicyTrainer

logger = logging.getLogger(__name__)


class GRPOTrainer(OnPolicyTrainer):
    """Train a causal LM with GRPO (TRL's constructor and meanings).

    Args:
        model (`str` or `PreTrainedModel`): Hub id, local path, or a model.
        reward_funcs: a reward function, a reward-model id/path/model, or a list of them.
        args ([`GRPOConfig`]): the configuration.
        train_dataset / eval_dataset: datasets with a `prompt` column (text or messages).
        processing_class: the policy tokenizer (loaded from `model` when omitted).
        reward_processing_classes: tokenizers of reward models, aligned with `reward_funcs`.
        callbacks, optimizers: as in `transformers.Trainer`.
        peft_config: a `peft` config; the reference is then the model with adapters disabled.
    """

    _tag_names = ["hf_verl", "grpo"]

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None,
                 callbacks=None, optimizers=(None, None), peft_config=None) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model, **(args.model_init_kwargs or {}))
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if args.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {args.vllm_mode!r}.")
        super().__init__(model=model, args=args, reward_funcs=reward_funcs,
                         reward_processing_classes=reward_processing_classes, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, need_reference=args.beta > 0, is_peft=peft_config is not None)

    def _max_new_tokens(self) -> int:
        return self.args.max_completion_length

    # ------------------------------------------------------------------ round
    def _finish_round(self, batch: RolloutBatch, rows, rewards_per_func, timings) -> list[RolloutBatch]:
        args, acc = self.args, self.accelerator
        if args.mask_truncated_completions:
            batch.completion_mask = batch.completion_mask * (~batch.is_truncated).long().unsqueeze(1)
        local = combine_rewards(rewards_per_func, args.reward_weights)
        all_rewards = acc.gather(local)  # group normalisation over the global round
        advantages, group_std = grpo_advantages(all_rewards, args.num_generations, args.scale_rewards)
        n, rank = local.shape[0], acc.process_index
        batch.rewards = local
        if args.advantage_estimator == "grpo":
            batch.advantages = advantages[rank * n : (rank + 1) * n]
        else:  # another critic-free estimator, token-level (B, C)
            greedy = self._greedy_baseline_scores(batch, rows) if args.advantage_estimator == "remax" else None
            batch.advantages = self._global_advantages(local, batch.completion_mask, greedy)
        batch.validate()
        # dapo: token mean over the round; each micro-batch loss is later divided by grad accumulation
        normalizer = self._global_tokens(batch) / (args.steps_per_generation * args.world_size)
        micro = self._split_round(batch)
        t_ref = time.perf_counter()
        off_policy = args.use_vllm or args.use_async_rollout  # sampled by another engine or older weights
        correct = off_policy and args.vllm_importance_sampling_correction
        for mb in micro:
            mb.meta["loss_normalizer"] = normalizer
            if args.beta > 0:
                mb.ref_logprobs = self._reference_logprobs(mb)
            if self._policy_moves_within_round() or off_policy:
                mb.old_logprobs = self._old_logprobs(mb)
            if off_policy:  # behaviour/trainer mismatch, logged always, corrected when asked
                weights, stats = importance_weights(
                    mb.old_logprobs, mb.sampling_logprobs, mb.completion_mask, args.vllm_importance_sampling_mode,
                    args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
                for k, v in stats.items():
                    self._metrics[k].append(v)
                if correct:
                    mb.meta["is_weights"] = weights
        timings["reference"] = time.perf_counter() - t_ref
        self._log_rewards(acc.gather(rewards_per_func), all_rewards, group_std)
        self._log_common(batch, timings)
        return micro

    def _log_rewards(self, rewards_per_func, rewards, group_std) -> None:
        """Reward metrics over the global round (gathered)."""
        m = self._metrics
        m["reward"].append(rewards.mean().item())
        m["reward_std"].append(rewards.std().item() if rewards.numel() > 1 else 0.0)
        m["frac_reward_zero_std"].append(torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item())
        for i, name in enumerate(self.reward_names):
            col = rewards_per_func[:, i]
            m[f"rewards/{name}/mean"].append(torch.nanmean(col).item())
            m[f"rewards/{name}/std"].append(col[~col.isnan()].std().item() if (~col.isnan()).sum() > 1 else 0.0)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs: RolloutBatch, return_outputs=False, num_items_in_batch=None):
        batch, args = inputs, self.args
        logp, entropy = self._token_logprobs(model, batch, with_entropy=True)
        old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
        per_token, clip = ppo_clip_loss(logp, old, batch.advantages, batch.completion_mask,
                                        args.epsilon, args.epsilon_high, args.dual_clip)
        mask = batch.completion_mask
        if "is_weights" in batch.meta:  # truncated / masked importance sampling against the engine
            per_token = per_token * batch.meta["is_weights"]
        if args.beta > 0:
            kl = kl_penalty(logp, batch.ref_logprobs, "k3")
            per_token = per_token + args.beta * kl
            self._metrics["kl"].append(masked_mean(kl, mask).item())
        loss = aggregate_loss(per_token, mask, args.loss_type, max_completion_length=args.max_completion_length,
                              normalizer=batch.meta.get("loss_normalizer", mask.sum().item()))
        self._metrics["entropy"].append(masked_mean(entropy.detach(), mask).item())
        for key, name in (("low_clip", "low"), ("high_clip", "high"), ("region_clip", "region")):
            self._metrics[f"clip_ratio/{name}_mean"].append(masked_mean(clip[key], mask).item())
        return loss
