"""`GRPOTrainer`: Group Relative Policy Optimization as a `transformers.Trainer` subclass.

Reads top to bottom as the algorithm, one method per phase: `_generate` (engine), `_score`
(reward sources), `_reference` (KL target, only when beta > 0), `_advantages` (group-relative),
then `compute_loss` (PPO clip + KL, aggregated per `loss_type`).

One *generation round* (`generation_batch_size` completions over all processes) is rolled out,
scored and turned into advantages at once (rewards are gathered across processes before group
normalisation), then served from a buffer as `steps_per_generation` micro-batches,
`num_iterations` times. When the policy moves while a round is still being consumed, the round's
log-probs under the generating policy are recorded first (`old_logprobs`) so that the PPO ratio
is exact.
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
from hf_verl.data.samplers import RepeatGroupSampler
from hf_verl.rewards.callables import combine_rewards, reward_func_name, score_reward_funcs
from hf_verl.rewards.reward_model import RewardModelScorer
from hf_verl.rollout.base import FINISH_LENGTH, SamplingParams
from hf_verl.rollout.hf_engine import TransformersEngine
from hf_verl.trainers.grpo_config import GRPOConfig

logger = logging.getLogger(__name__)


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
        # model_accepts_loss_kwargs=False: the Trainer divides each micro-batch loss by the
        # accumulation steps (our rows carry no `labels` for it to count tokens from)
        self.model_accepts_loss_kwargs = False
        self._buffer: list[RolloutBatch] | None = None
        self._micro_step: int | None = None  # set from global_step on the first training_step
        if train_dataset is not None and hasattr(train_dataset, "__len__"):
            self._get_train_sampler()  # a dataset too small for one round fails here, not at train()

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _check_scope(args: GRPOConfig) -> None:
        if args.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {args.vllm_mode!r}.")

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

    def _get_train_sampler(self, train_dataset=None) -> Sampler:
        a = self.args
        return RepeatGroupSampler(
            len(train_dataset if train_dataset is not None else self.train_dataset), a.num_generations,
            chunk_size=a.per_device_train_batch_size * a.steps_per_generation, world_size=a.world_size,
            repeat=a.steps_per_generation * a.num_iterations, shuffle=a.shuffle_dataset, seed=a.seed,
        )

    def get_train_dataloader(self):
        """One batch per micro-step, each holding this process's whole generation round."""
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer needs a train_dataset with a 'prompt' column.")
        return self._get_dataloader(
            dataset=self.train_dataset, description="Training",
            batch_size=self.args.per_device_train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler, is_training=True,
        )

    # ------------------------------------------------------------------ phases
    def _prepare_inputs(self, inputs):
        return inputs  # rollouts are built by `_rollout_round`; the Trainer's tensor moving is not needed

    def _rollout_round(self, rows: list[dict]) -> list[RolloutBatch]:
        """Generate, score and compute advantages for this process's share of one round; return
        its `steps_per_generation` micro-batches."""
        args, acc = self.args, self.accelerator
        t0 = time.perf_counter()
        prompts = [r["prompt"] for r in rows]
        tok = tokenize_prompts(prompts, self.processing_class, args.max_prompt_length)
        batch = self._generate(tok.ids, prompts, rows)
        t1 = time.perf_counter()
        rewards_per_func = self._score(batch, rows)
        t2 = time.perf_counter()
        # group normalisation over the global round: a group may span processes
        local = combine_rewards(rewards_per_func, args.reward_weights)
        all_rewards = acc.gather(local)
        advantages, group_std = grpo_advantages(all_rewards, args.num_generations, args.scale_rewards)
        n, rank = local.shape[0], acc.process_index
        batch.rewards = local
        batch.advantages = advantages[rank * n : (rank + 1) * n]
        batch.validate()

        g = torch.Generator().manual_seed(args.seed + self._micro_step)  # deterministic, resumable
        order = torch.randperm(n, generator=g).tolist()
        size = args.per_device_train_batch_size
        micro = [batch.select(order[i : i + size]) for i in range(0, n, size)]
        global_tokens = acc.gather(torch.tensor([batch.num_completion_tokens], device=batch.device)).sum().item()
        # dapo: token mean over the round; each micro-batch loss is later divided by grad accumulation
        for mb in micro:
            mb.meta["loss_normalizer"] = global_tokens / (args.steps_per_generation * args.world_size)
        t3 = time.perf_counter()
        for mb in micro:
            mb.ref_logprobs = self._reference(mb)
        if self._policy_moves_within_round():
            with torch.no_grad():
                for mb in micro:
                    mb.old_logprobs = self._token_logprobs(self.model, mb)[0]
        t4 = time.perf_counter()
        self._log_rollout(batch, acc.gather(rewards_per_func), all_rewards, group_std, tok.num_truncated,
                          {"generate": t1 - t0, "reward": t2 - t1, "reference": t4 - t3})
        return micro

    def _rollout_round_or_checkpoint(self, rows: list[dict]) -> list[RolloutBatch]:
        """`_rollout_round`; if a reward source rejects its input mid-run, first save a resumable
        checkpoint of the last completed step so that fixing the reward loses no training."""
        try:
            return self._rollout_round(rows)
        except (ValueError, TypeError) as err:
            step = self.state.global_step
            if step == 0 or self._micro_step % self.args.gradient_accumulation_steps:
                raise  # nothing trained yet, or mid-accumulation: no consistent state to save
            self._save_checkpoint(self.model, trial=None)
            path = f"{self.args.output_dir}/checkpoint-{step}"
            logger.error("rollout failed at step %d; saved %s", step, path)
            raise type(err)(
                f"{err}\nA checkpoint of step {step} was saved to {path}: fix the cause and continue with "
                f"trainer.train(resume_from_checkpoint={path!r})."
            ) from err

    def _policy_moves_within_round(self) -> bool:
        """True when an optimizer step happens before the round's last micro-batch is used."""
        args = self.args
        return args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps

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
                              normalizer=batch.meta.get("loss_normalizer", mask.sum().item()))
        self._metrics["entropy"].append(masked_mean(entropy.detach(), mask).item())
        for key, name in (("low_clip", "low"), ("high_clip", "high"), ("region_clip", "region")):
            self._metrics[f"clip_ratio/{name}_mean"].append(masked_mean(clip[key], mask).item())
        return loss

    def train(self, *args, **kwargs):
        self._buffer, self._micro_step = None, None
        return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        args = self.args
        if self._micro_step is None:  # fresh start or resume: position within the rounds
            self._micro_step = self.state.global_step * args.gradient_accumulation_steps
            if args.world_size > 1 and self.state.global_step == 0:
                # same seed on every rank would draw identical samples for a group split across ranks
                torch.manual_seed(args.seed + 7919 * args.process_index)
        per_round = args.steps_per_generation * args.num_iterations
        if self._buffer is None or self._micro_step % per_round == 0:
            self._buffer = self._rollout_round_or_checkpoint(inputs)  # rollout phases, timed separately
        batch = self._buffer[self._micro_step % args.steps_per_generation]
        self._micro_step += 1
        t0 = time.perf_counter()
        loss = super().training_step(model, batch, num_items_in_batch)
        self._metrics["timing_s/update"].append(time.perf_counter() - t0)
        return loss

    # ------------------------------------------------------------------ metrics
    def _log_rollout(self, batch, rewards_per_func, rewards, group_std, num_truncated, timings) -> None:
        """Reward metrics over the global round (gathered); the rest over this process's share."""
        m = self._metrics
        lengths = batch.completion_mask.sum(1).float()
        m["reward"].append(rewards.mean().item())
        m["reward_std"].append(rewards.std().item() if rewards.numel() > 1 else 0.0)
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
        """Add the means of the metrics collected since the last log (averaged over processes)."""
        keys = sorted(k for k, v in self._metrics.items() if v)
        values = torch.tensor([sum(self._metrics[k]) / len(self._metrics[k]) for k in keys], dtype=torch.float64)
        if self.accelerator.num_processes > 1 and keys:
            # every process collects the same keys in the same order, so one reduce suffices
            values = self.accelerator.reduce(values.to(self.accelerator.device), reduction="mean").cpu()
        logs.update(zip(keys, values.tolist()))
        self._metrics.clear()
        super().log(logs, start_time)
