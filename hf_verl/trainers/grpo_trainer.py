"""`GRPOTrainer`: Group Relative Policy Optimization as a `transformers.Trainer` subclass.

The rollout machinery (rounds, buffer, data parallel layout, metrics plumbing) is
:class:`~hf_verl.trainers.on_policy.OnPolicyTrainer`'s, and the algorithm (advantages, the loss, its metrics) is
:class:`~hf_verl.pipeline.critic_free.CriticFreeAlgorithm`, the object the facade runs too. This module holds
TRL's constructor and checks (tools, environments, `rollout_func`, Liger, quantization), TRL's public helpers and
attributes, and the completions table.
"""

from __future__ import annotations

import copy
import logging

import torch
from transformers import AutoProcessor, AutoTokenizer

from hf_verl.algorithms.policy_losses import (
    entropy_quantile,
    high_entropy_mask,
    off_policy_sequence_mask,
)
from hf_verl.algorithms.registry import get_advantage_estimator
from hf_verl.data.batch import RolloutBatch
from hf_verl.data.vision import is_vision_model
from hf_verl.engine.model_options import cast_lm_head_to_fp32
from hf_verl.parallel import comm
from hf_verl.pipeline.tool_rollout import ENVIRONMENT_COLUMN, ToolRollout
from hf_verl.rewards.reward_model import align_processing_classes
from hf_verl.rollout.tools import environment_tools
from hf_verl.trainers.engine_glue import load_for_launch, load_pretrained
from hf_verl.trainers.grpo_config import GRPOConfig
from hf_verl.trainers.on_policy import OnPolicyTrainer
from hf_verl.trainers.policy_control import ReferenceMixCallback
from hf_verl.trainers.quantization import check_quantized_run, merge_quantization_config
from hf_verl.trainers.vision_checks import refuse_vision_settings

logger = logging.getLogger(__name__)


def _check_liger(model, args: GRPOConfig) -> None:
    """`use_liger_kernel=True`, checked at construction as TRL does (transformers applies the kernels, and would
    only fail for a missing package, when `train()` starts). TRL's guard first: Liger's kernels replace the
    model's forward and its fused loss paths read `lm_head.weight` itself, so a LoRA adapter wrapping `lm_head`
    could go untrained."""
    if not args.use_liger_kernel:
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, BaseTunerLayer):
        raise ValueError("use_liger_kernel=True with a PEFT adapter on lm_head: Liger's fused paths read "
                         "lm_head.weight directly, so the adapter could go untrained (TRL refuses this too). Drop "
                         "'lm_head' from target_modules, train it whole with modules_to_save=['lm_head'], or set "
                         "use_liger_kernel=False.")
    from transformers.utils import is_liger_kernel_available

    if not is_liger_kernel_available():
        raise ImportError("use_liger_kernel=True needs liger-kernel (pip install liger-kernel, a GPU package); or set "
                          "use_liger_kernel=False: hf_verl's chunked LM head already avoids a whole logits tensor.")


def _needs_placeholder_prompt(train_dataset, environment_factory) -> bool:
    """Rows that only route to environments (an `environment` column, no `prompt`): environments own the data."""
    columns = getattr(train_dataset, "column_names", None)
    return environment_factory is not None and bool(columns) and "prompt" not in columns


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
        quantization_config (`transformers.BitsAndBytesConfig`, *optional*): load `model` (an id or path) k-bit
            quantized; with `peft_config`, QLoRA (only the adapters train). As in TRL it may be given in
            `args.model_init_kwargs` instead, and is ignored (with a warning) for a model object. Checked at
            construction: see :mod:`hf_verl.trainers.quantization`.
        peft_config: a `peft` config; the reference is then the model with adapters disabled.
        tools (`list[Callable]`, *optional*): functions (sync or async, type hints and a Google-style
            docstring) the model may call while generating: completions become multi-turn, tool results
            are in the context but masked out of the loss, reward functions receive the completions as
            message lists. Needs conversational prompts and a chat template that renders tool calls.
        rollout_func (`Callable`, *optional*): custom generation, TRL's contract: called as
            `rollout_func(prompts, trainer)` with this process's prompts of the round (each already
            repeated `num_generations` times) and returning a dict with `prompt_ids`, `completion_ids`
            and `logprobs` (per token, or None), one entry per prompt; an `env_mask` entry (1 on model
            tokens, 0 on tokens to leave out of the loss) masks the loss, every other entry reaches the
            reward functions as a column. `trainer.engine` is the rollout engine, synced to the policy.
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*): makes one environment per
            row (a dict: chosen by the row's `environment` column), reset with `reset(**row)` (a returned
            string is appended to the prompt's last message); its public methods are that row's tools, a
            `get_reward()` method is an extra reward source (named after the class, weight 1), and reward
            functions receive the instances as `environments=`.
    """

    _tag_names = ["trl", "grpo", "hf_verl"]

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None,
                 callbacks=None, optimizers=(None, None), quantization_config=None, peft_config=None, tools=None,
                 rollout_func=None, environment_factory=None) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
        load_kwargs = merge_quantization_config(model, args.model_init_kwargs, quantization_config,
                                                refuse_model_object=False)
        check_quantized_run(model, load_kwargs, peft_config, args)
        if isinstance(model, str):  # sharded under FSDP2 / ZeRO-3 (docs/loading.md), except with PEFT
            model = (load_pretrained(model, load_kwargs, trust_remote_code=args.trust_remote_code) if peft_config
                     else load_for_launch(model, load_kwargs, args, trust_remote_code=args.trust_remote_code))
        funcs = [] if reward_funcs is None else (
            list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
        reward_processing_classes = align_processing_classes(len(funcs), reward_processing_classes)
        if processing_class is None:  # a vision-language model's processor, as TRL loads it
            auto = AutoProcessor if is_vision_model(model) else AutoTokenizer
            processing_class = auto.from_pretrained(model.config._name_or_path, trust_remote_code=args.trust_remote_code)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        _check_liger(model, args)
        if args.cast_lm_head_to_fp32:
            cast_lm_head_to_fp32(model)
        if args.sync_ref_model and peft_config is not None:
            raise ValueError("sync_ref_model=True with a PEFT model: the reference is the base model with adapters "
                             "disabled and cannot be mixed; set sync_ref_model=False or train without peft_config.")
        if args.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {args.vllm_mode!r}.")
        placeholder_prompts = _needs_placeholder_prompt(train_dataset, environment_factory)
        train_dataset = self._environment_owned_data(args, train_dataset, environment_factory)
        tool_rollout, reward_funcs, reward_processing_classes, args = self._tool_setup(
            args, tools, environment_factory, rollout_func, funcs or None, reward_processing_classes, processing_class,
            train_dataset)
        if placeholder_prompts:
            tool_rollout.reset_excludes = ("prompt",)
        super().__init__(model=model, args=args, reward_funcs=reward_funcs,
                         reward_processing_classes=reward_processing_classes, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, need_reference=args.beta > 0, is_peft=peft_config is not None)
        if not args.ds3_gather_for_generation and self.backend.kind == "deepspeed" and self.backend.zero_stage == 3:
            raise ValueError("ds3_gather_for_generation=False (generating on ZeRO-3 partitioned weights) is not "
                             "supported: hf_verl generates on a full replica kept in step by bucketed weight sync, "
                             "which needs no gathering per token; remove ds3_gather_for_generation.")
        if args.sync_ref_model:
            self.add_callback(ReferenceMixCallback(self))
        self._tool_rollout, self.rollout_func = tool_rollout, rollout_func
        if self.trains_on_images:
            refuse_vision_settings(type(self).__name__, args, None, None, tools=tool_rollout is not None,
                                   rollout_func=rollout_func is not None)

    @staticmethod
    def _tool_setup(args, tools, environment_factory, rollout_func, reward_funcs, reward_processing_classes,
                    processing_class, train_dataset):
        """Check `tools` / `environment_factory` / `rollout_func` against the rest of the setup (refusing what
        cannot work, naming what to change) and add the environments' `get_reward` reward sources.

        Returns:
            `(ToolRollout or None, reward_funcs, reward_processing_classes, args)`; `args` is a copy when the
            environments' reward weights (1 each) were appended to `reward_weights`.
        """
        if rollout_func is not None:
            if not callable(rollout_func):
                raise TypeError(f"rollout_func must be a callable (prompts, trainer) -> dict, got {rollout_func!r}.")
            if tools or environment_factory is not None:
                raise ValueError("rollout_func cannot be combined with tools / environment_factory: a rollout_func "
                                 "generates on its own (any tool calling included); pass either rollout_func, or "
                                 "tools / environment_factory.")
            if args.use_async_rollout:
                raise ValueError("rollout_func with use_async_rollout=True is not supported: a rollout_func generates "
                                 "with the trainer's own engine, which async rollout must not read while the policy "
                                 "trains; set use_async_rollout=False.")
        if not tools and environment_factory is None:
            if reward_funcs is None:
                raise ValueError("No reward source provided: pass reward_funcs, or an environment_factory whose "
                                 "environment defines a get_reward method.")
            return None, reward_funcs, reward_processing_classes, args
        if "greedy_scores" in get_advantage_estimator(args.advantage_estimator).requires:
            raise ValueError(f"advantage_estimator={args.advantage_estimator!r} with tools / environment_factory is not "
                             "supported: its greedy baseline is generated single-turn, without tools; choose another "
                             "estimator.")
        tool_rollout = ToolRollout(tools, environment_factory, args.max_tool_calling_iterations)
        tool_rollout.check_tokenizer(processing_class, args.chat_template_kwargs)
        columns = list(getattr(train_dataset, "column_names", None) or [])
        if columns and "prompt" not in columns:
            raise ValueError(f"tools / environment_factory need a 'prompt' column of chat messages; the dataset has "
                             f"{sorted(columns)} (pre-tokenised input_ids cannot carry the tools' schemas).")
        if columns and hasattr(train_dataset, "__getitem__") and len(train_dataset):
            tool_rollout.check_prompts([train_dataset[0]["prompt"]])
        env_rewards = tool_rollout.reward_funcs()
        if env_rewards:
            funcs = [] if reward_funcs is None else (
                list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])
            reward_funcs = funcs + env_rewards
            reward_processing_classes = list(reward_processing_classes) + [None] * len(env_rewards)
            if args.reward_weights is not None:
                args = copy.copy(args)
                args.reward_weights = list(args.reward_weights) + [1.0] * len(env_rewards)
        elif reward_funcs is None:
            raise ValueError("No reward source provided: pass reward_funcs, or give the environment a get_reward "
                             "method.")
        return tool_rollout, reward_funcs, reward_processing_classes, args

    @staticmethod
    def _environment_owned_data(args: GRPOConfig, train_dataset, environment_factory):
        """TRL: without a `train_dataset`, a single environment owns the data (its `reset()` returns the prompt)
        and `max_steps` sets the length; the rounds then draw from a placeholder of empty user prompts. A dataset
        without a `prompt` column (rows that only route to environments) gets the same placeholder prompt, which
        the environments' `reset` does not receive (as in TRL)."""
        if _needs_placeholder_prompt(train_dataset, environment_factory):
            return train_dataset.map(lambda _row: {"prompt": [{"role": "user", "content": ""}]})
        if train_dataset is not None:
            return train_dataset
        if environment_factory is None:
            raise ValueError("`train_dataset` is required unless an `environment_factory` is provided.")
        if isinstance(environment_factory, dict):
            raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with "
                             "an `environment` column to route each example to its environment. Provide a dataset, "
                             "or pass a single environment factory.")
        if args.max_steps <= 0:
            raise ValueError("When training without a `train_dataset` (the environment owns the data and returns the "
                             "prompt from `reset()`), `max_steps` must be set to a positive value to define the "
                             "training length. Set it via `GRPOConfig(max_steps=...)`.")
        from datasets import Dataset

        rows = args.generation_batch_size // args.num_generations
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})

    def _max_new_tokens(self) -> int:
        return self.args.max_completion_length


    # ------------------------------------------------------------------ TRL's public helpers
    @property
    def reward_weights(self) -> torch.Tensor:
        """One weight per reward function (TRL's attribute): `reward_weights`, else all 1."""
        if self.args.reward_weights is not None:
            return torch.tensor(self.args.reward_weights, dtype=torch.float32)
        return torch.ones(len(self.reward_funcs), dtype=torch.float32)

    @property
    def tools(self) -> list:
        """TRL's attribute: the tools a rollout may call, the shared `tools` and each environment's methods."""
        rollout = self._tool_rollout
        if rollout is None:
            return []
        tools = list(rollout.tools)
        for name in rollout.factories or {}:
            rows = [{ENVIRONMENT_COLUMN: name}] if rollout.multi_environment else [{}]
            environments = rollout.take_environments(rows)  # a pooled instance, given back at once
            try:
                tools += [t for t in environment_tools(environments[0]) if t.__name__ not in {u.__name__ for u in tools}]
            finally:
                rollout.release(environments, rows)
        return tools

    @property
    def entropy_control(self):
        """The algorithm's entropy-bonus controller (None when the bonus is off)."""
        return self.algorithm.entropy_control

    @property
    def entropy_coef(self) -> float:
        """The entropy-bonus coefficient in force (TRL's attribute; adaptive entropy control moves it each
        optimizer step)."""
        return self.entropy_control.coef if self.entropy_control is not None else self.args.entropy_coef

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's attribute: whether a Mixture of Experts' router load-balancing loss is added."""
        return self.algorithm.aux_loss_enabled

    @property
    def router_aux_loss_coef(self) -> float:
        """TRL's attribute: the router loss's weight."""
        return self.algorithm.aux_loss_coef

    @property
    def _logs(self) -> dict:
        """TRL's `_logs` (read by callbacks that show completions): the latest round's completions table as
        columns (`prompt`, `completion`, `rewards` per function, `advantages`, the reward functions' `extra`
        columns), gathered from every rank; kept with `log_completions=True`."""
        rows = self.completion_log.rows
        return {"prompt": [r["prompt"] for r in rows], "completion": [r["completion"] for r in rows],
                "rewards": {name: [r[name] for r in rows] for name in self.reward_names},
                "advantages": [r["advantage"] for r in rows], "extra": self.completion_log.extra_columns,
                "images": []}

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's: the tokens of `mask` whose entropy is at least the `threshold`-quantile of the masked entropies
        of every process (`threshold` = 1 - `top_entropy_quantile`); all False when no token is masked in.

        Args:
            entropies (`torch.Tensor`): `(B, T)` per-token entropies.
            mask (`torch.Tensor`): `(B, T)`, 1 on the tokens that count.
            threshold (`float`): the quantile, in [0, 1].
        """
        local = entropies[mask.bool()].float()
        pad = -1e9  # entropies are >= 0, so the padding cannot be mistaken for one
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=pad))
        return high_entropy_mask(entropies, mask, entropy_quantile(gathered[gathered != pad], threshold))

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL's off-policy sequence mask (DeepSeek-V3.2): `(B, 1)`, 1 to keep a sequence (advantage >= 0, or a
        mean KL from the sampling policy over its tokens of at most `off_policy_threshold`), 0 to drop it."""
        keep = off_policy_sequence_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                        off_policy_threshold)
        return keep.to(mask.dtype)

    # ------------------------------------------------------------------ round
    def _round_done(self, batch: RolloutBatch, rewards_per_func: torch.Tensor) -> None:
        """The completions table (`log_completions`), over every rank's rows."""
        if self.completion_log.enabled:
            dims = self.dims
            adv = batch.advantages if batch.advantages.dim() == 1 else batch.advantages[:, 0]
            self.completion_log.record(comm.gather_objects(dims, batch.meta["prompts"]),
                                       comm.gather_objects(dims, batch.meta["completions"]),
                                       comm.gather_rows(dims, rewards_per_func), comm.gather_rows(dims, adv),
                                       self._gathered_log_extra(batch))

    def _gathered_log_extra(self, batch: RolloutBatch) -> dict[str, list]:
        """The reward functions' `log_extra` columns over every rank's rows (None where a rank logged none)."""
        local = batch.meta.get("log_extra") or {}
        names = sorted({name for names in comm.gather_objects(self.dims, [sorted(local)]) for name in names})
        return {name: comm.gather_objects(self.dims, local.get(name, [None] * batch.batch_size)) for name in names}

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.entropy_control is not None and self.args.should_save:
            self.entropy_control.save(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.entropy_control is not None and checkpoint is not None:
            self.entropy_control.load(checkpoint)

    def _eval_generations(self) -> int:
        return self.args.num_generations_eval or self.args.num_generations
