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
from hf_verl.data.batch import RolloutBatch
from hf_verl.parallel import comm
from hf_verl.pipeline import losses, phases
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
        args, dims = self.args, self.dims
        if args.mask_truncated_completions:
            batch.completion_mask = batch.completion_mask * (~batch.is_truncated).long().unsqueeze(1)
        local = combine_rewards(rewards_per_func, args.reward_weights)
        all_rewards = comm.gather_rows(dims, local)  # group normalisation over the global round
        advantages, group_std = grpo_advantages(all_rewards, args.num_generations, args.scale_rewards)
        batch.rewards = local
        if args.advantage_estimator == "grpo":
            batch.advantages = comm.local_rows(dims, advantages, local.shape[0])
        else:  # another critic-free estimator, token-level (B, C)
            greedy = self._greedy_baseline_scores(batch, rows) if args.advantage_estimator == "remax" else None
            batch.advantages, _ = phases.advantages(
                dims, args.advantage_estimator, scores=local, mask=batch.completion_mask,
                num_generations=args.num_generations, greedy_scores=greedy, scale_rewards=args.scale_rewards)
        batch.validate()
        # dapo: token mean over the round; each micro-batch loss is later divided by grad accumulation
        normalizer = phases.global_token_count(dims, batch.completion_mask) / (args.steps_per_generation * dims.dp_size)
        micro = self._split_round(batch)
        t_ref = time.perf_counter()
        off_policy = args.use_vllm or args.use_async_rollout  # sampled by another engine or older weights
        for mb in micro:
            mb.meta["loss_normalizer"] = normalizer
            if args.beta > 0:
                mb.ref_logprobs = self._reference_logprobs(mb)
            if self._policy_moves_within_round() or off_policy:
                mb.old_logprobs = self._old_logprobs(mb)
            if off_policy:  # behaviour/trainer mismatch, logged always, corrected when asked
                stats = phases.attach_importance_weights(
                    mb, mode=args.vllm_importance_sampling_mode, clip_min=args.vllm_importance_sampling_clip_min,
                    clip_max=args.vllm_importance_sampling_clip_max, correct=args.vllm_importance_sampling_correction)
                for k, v in stats.items():
                    self._metrics[k].append(v)
        timings["reference"] = time.perf_counter() - t_ref
        self._log_rewards(comm.gather_rows(dims, rewards_per_func), all_rewards, group_std)
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
    def _micro_batch_losses(self, batch: RolloutBatch) -> list[tuple]:
        args, m = self.args, self._metrics
        logp, entropy = self._token_logprobs(batch, with_entropy=True)
        loss, stats = losses.policy_loss(
            logp, batch, clip_low=args.epsilon, clip_high=args.epsilon_high, dual_clip=args.dual_clip,
            loss_type=args.loss_type, normalizer=batch.meta.get("loss_normalizer"),
            max_completion_length=args.max_completion_length, kl_coef=args.beta, kl_estimator="k3", entropy=entropy)
        if args.beta > 0:
            m["kl"].append(stats["kl"].item())
        m["entropy"].append(stats["entropy"].item())
        for name in ("low", "high", "region"):
            m[f"clip_ratio/{name}_mean"].append(stats[f"clip_{name}"].item())
        return [(self.actor, loss)]
