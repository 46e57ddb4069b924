"""`GRPOTrainer`: Group Relative Policy Optimization as a `transformers.Trainer` subclass.

Reads top to bottom as the algorithm, one method per phase: `_generate` (engine), `_score`
(reward sources), `_reference` (KL target, only when beta > 0), `_advantages` (group-relative),
then `compute_loss` (PPO clip + KL, aggregated per `loss_type`).

Scope of this first version (see docs/grpo.md): one generation per optimizer step
(`steps_per_generation == 1`, `num_iterations == 1`), single process; each per-device batch holds
whole groups. These limits are checked in `__init__` with a message, never silently ignored.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import defaultdict
from typing import Any

import torch
from torch.utils.data import Sampler
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Trainer

from hf_verl.algorithms.advantages import grpo_advantages
from hf_verl.algorithms.kl import kl_penalty
from hf_verl.algorithms.logprobs import logprobs_from_hidden
from hf_verl.algorithms.policy_loss import aggregate_loss, masked_mean, ppo_clip_loss
from hf_verl.data.batch import RolloutBatch
from hf_verl.data.prompts import check_prompt_column, ensure_pad_token, tokenize_prompts
from hf_verl.rewards.callables import combine_rewards, reward_func_name, score_reward_funcs
from hf_verl.rewards.reward_model import RewardModelScorer
from hf_verl.rollout.base import FINISH_LENGTH, SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.trainers.grpo_config import GRPOConfig

logger = logging.getLogger(__name__)


class GroupSampler(Sampler[int]):
    """Yields each (shuffled) prompt index `num_generations` times in a row."""

    def __init__(self, num_prompts: int, num_generations: int, shuffle: bool, seed: int) -> None:
        self.num_prompts, self.num_generations, self.shuffle, self.seed = num_prompts, num_generations, shuffle, seed
        self.epoch = 0

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_prompts, generator=g).tolist() if self.shuffle else range(self.num_prompts)
        self.epoch += 1
        for idx in order:
            yield from [idx] * self.num_generations

    def __len__(self) -> int:
        return self.num_prompts * self.num_generations


class GRPOTrainer(Trainer):
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
        ensure_pad_token(processing_class)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if args.gradient_checkpointing:
            model.config.use_cache = False
        self._check_scope(args)
        if train_dataset is not None:
            check_prompt_column(train_dataset.column_names)
        self.reward_funcs = self._build_reward_funcs(reward_funcs, reward_processing_classes)
        self.reward_names = [reward_func_name(f) for f in self.reward_funcs]
        self.ref_model = self._build_reference(model, args, peft_config is not None)
        super().__init__(model=model, args=args, data_collator=lambda rows: rows, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         callbacks=callbacks, optimizers=optimizers)
        self.engine = TransformersEngine(self.accelerator.unwrap_model(self.model), processing_class)
        self.sampling = SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            stop=tuple(args.stop or ()),
        )
        self._metrics: dict[str, list[float]] = defaultdict(list)

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _check_scope(args: GRPOConfig) -> None:
        if args.steps_per_generation != 1 or args.num_iterations != 1:
            raise ValueError(
                "this release supports steps_per_generation=1 and num_iterations=1 only; got "
                f"steps_per_generation={args.steps_per_generation}, num_iterations={args.num_iterations}."
            )
        if args.world_size > 1:
            raise ValueError(
                f"this release of GRPOTrainer runs in one process; got world_size={args.world_size}. "
                "Launch with `python train.py` (multi-process data parallelism is the next step)."
            )
        if args.per_device_train_batch_size % args.num_generations:
            raise ValueError(
                f"per_device_train_batch_size ({args.per_device_train_batch_size}) must hold whole groups "
                f"of num_generations={args.num_generations}."
            )

    @staticmethod
    def _build_reward_funcs(reward_funcs, processing_classes) -> list:
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty: pass at least one reward function or reward model.")
        tokenizers = processing_classes if isinstance(processing_classes, list) else [processing_classes] * len(funcs)
        out = []
        for f, tok in zip(funcs, tokenizers):
            if isinstance(f, (str, PreTrainedModel)):
                f = RewardModelScorer(f, tok)
            elif not callable(f):
                raise TypeError(f"reward function {f!r} is neither callable nor a reward model id/path/model.")
            out.append(f)
        return out

    @staticmethod
    def _build_reference(model, args: GRPOConfig, is_peft: bool):
        if args.beta == 0.0 or is_peft:
            return None  # no KL term, or the base model with adapters disabled serves as reference
        ref = copy.deepcopy(model).eval()
        ref.requires_grad_(False)
        return ref

    def _get_train_sampler(self, *args, **kwargs) -> Sampler:
        return GroupSampler(len(self.train_dataset), self.args.num_generations,
                            self.args.shuffle_dataset, self.args.seed)

    # ------------------------------------------------------------------ phases
    def _prepare_inputs(self, rows: list[dict] | RolloutBatch) -> RolloutBatch:
        if isinstance(rows, RolloutBatch):  # already rolled out by training_step
            return rows
        t0 = time.perf_counter()
        prompts = [r["prompt"] for r in rows]
        tok = tokenize_prompts(prompts, self.processing_class, self.args.max_prompt_length)
        batch = self._generate(tok.ids, prompts, rows)
        t1 = time.perf_counter()
        rewards_per_func = self._score(batch, rows)
        t2 = time.perf_counter()
        batch.ref_logprobs = self._reference(batch)
        t3 = time.perf_counter()
        batch.rewards = combine_rewards(rewards_per_func, self.args.reward_weights)
        batch.advantages, group_std = grpo_advantages(batch.rewards, self.args.num_generations,
                                                      self.args.scale_rewards)
        self._log_rollout(batch, rewards_per_func, group_std, tok.num_truncated,
                          {"generate": t1 - t0, "reward": t2 - t1, "reference": t3 - t2})
        return batch.validate()

    def _generate(self, prompt_ids: list[list[int]], prompts: list, rows: list[dict]) -> RolloutBatch:
        out = self.engine.generate(prompt_ids, self.sampling)
        batch = RolloutBatch.from_lists(
            prompt_ids, out.completion_ids, self.processing_class.pad_token_id,
            sampling_logprobs=out.logprobs, device=self.accelerator.device,
        )
        batch.is_truncated = torch.tensor([r == FINISH_LENGTH for r in out.finish_reasons],
                                          device=batch.device)
        if self.args.mask_truncated_completions:
            batch.completion_mask = batch.completion_mask * (~batch.is_truncated).long().unsqueeze(1)
        batch.meta["prompts"] = prompts
        batch.meta["completions"] = self.processing_class.batch_decode(out.completion_ids, skip_special_tokens=True)
        batch.meta["completion_ids"] = out.completion_ids
        return batch

    def _score(self, batch: RolloutBatch, rows: list[dict]) -> torch.Tensor:
        prompts = batch.meta["prompts"]
        completions = batch.meta["completions"]
        if isinstance(prompts[0], list):  # conversational: completions are assistant messages
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
        scores = score_reward_funcs(self.reward_funcs, prompts=prompts, completions=completions,
                                    completion_ids=batch.meta["completion_ids"], columns=columns)
        return scores.to(batch.device)

    @torch.no_grad()
    def _reference(self, batch: RolloutBatch) -> torch.Tensor | None:
        if self.args.beta == 0.0:
            return None
        if self.ref_model is not None:
            return self._token_logprobs(self.ref_model, batch)[0]
        with self.accelerator.unwrap_model(self.model).disable_adapter():
            return self._token_logprobs(self.model, batch)[0]

    def _token_logprobs(self, model, batch: RolloutBatch, with_entropy: bool = False):
        """Log-probs of the completion tokens, from hidden states in chunks (no full logits)."""
        mask = batch.attention_mask
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids,
                    output_hidden_states=True, logits_to_keep=1, use_cache=False)
        C = batch.completion_ids.shape[1]
        hidden = out.hidden_states[-1][:, -C - 1 : -1]
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        temperature = self.args.temperature if self.args.temperature > 0 else 1.0
        return logprobs_from_hidden(hidden, head.weight, batch.completion_ids, bias=head.bias,
                                    temperature=temperature, chunk_size=self.args.logprob_chunk_size,
                                    with_entropy=with_entropy)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs: RolloutBatch, return_outputs=False, num_items_in_batch=None):
        batch, args = inputs, self.args
        logp, entropy = self._token_logprobs(model, batch, with_entropy=True)
        old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
        per_token, clip = ppo_clip_loss(logp, old, batch.advantages, batch.completion_mask,
                                        args.epsilon, args.epsilon_high, args.dual_clip)
        mask = batch.completion_mask
        if args.beta > 0:
            kl = kl_penalty(logp, batch.ref_logprobs, "k3")
            per_token = per_token + args.beta * kl
            self._metrics["kl"].append(masked_mean(kl, mask).item())
        loss = aggregate_loss(per_token, mask, args.loss_type, max_completion_length=args.max_completion_length,
                              normalizer=mask.sum().item())
        self._metrics["entropy"].append(masked_mean(entropy.detach(), mask).item())
        for key, name in (("low_clip", "low"), ("high_clip", "high"), ("region_clip", "region")):
            self._metrics[f"clip_ratio/{name}_mean"].append(masked_mean(clip[key], mask).item())
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = self._prepare_inputs(inputs)  # rollout phases, timed separately
        t0 = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._metrics["timing_s/update"].append(time.perf_counter() - t0)
        return loss

    # ------------------------------------------------------------------ metrics
    def _log_rollout(self, batch, rewards_per_func, group_std, num_truncated, timings) -> None:
        m = self._metrics
        lengths = batch.completion_mask.sum(1).float()
        m["reward"].append(batch.rewards.mean().item())
        m["reward_std"].append(batch.rewards.std().item() if batch.batch_size > 1 else 0.0)
        m["frac_reward_zero_std"].append(torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item())
        for i, name in enumerate(self.reward_names):
            col = rewards_per_func[:, i]
            m[f"rewards/{name}/mean"].append(torch.nanmean(col).item())
            m[f"rewards/{name}/std"].append(col[~col.isnan()].std().item() if (~col.isnan()).sum() > 1 else 0.0)
        m["completions/mean_length"].append(lengths.mean().item())
        m["completions/clipped_ratio"].append(batch.is_truncated.float().mean().item())
        m["prompts/truncated_ratio"].append(num_truncated / batch.batch_size)
        for k, v in timings.items():
            m[f"timing_s/{k}"].append(v)
        tokens = batch.num_completion_tokens
        m["perf/tokens_per_second"].append(tokens / max(timings["generate"], 1e-9))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        for k, v in self._metrics.items():
            if v:
                logs[k] = sum(v) / len(v)
        self._metrics.clear()
        super().log(logs, start_time)
