"""`PPOTrainer`: PPO with a learned critic and GAE, as a `transformers.Trainer` subclass.

Constructor and config follow TRL's experimental PPOTrainer (<= 1.10), so a TRL PPO script runs
after changing its import line. Per update, one round of `local_batch_size` completions per process is
generated and scored (the shared on-policy machinery), turned into advantages by
:class:`~hf_verl.pipeline.ppo.PPOAlgorithm` (old, reference and critic forwards in chunks of
`local_rollout_forward_batch_size`, the KL penalty, GAE, whitening: the object the facade runs with a critic), and
passed over `num_ppo_epochs` times in `num_mini_batches` shuffled mini-batches: clipped policy loss plus
`vf_coef x` clipped value loss; the critic has its own optimizer, learning rate and warm-up
(`critic_warmup_steps`: policy frozen). This module holds TRL's constructor and checks, the critic's optimizer and
checkpoints, and TRL's episode count and samples.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_verl.algorithms.registry import (
    advantage_estimator_names,
    get_advantage_estimator,
)
from hf_verl.data.batch import RolloutBatch
from hf_verl.pipeline.ppo import explained_variance  # noqa: F401 (TRL's PPO helper, importable from here)
from hf_verl.trainers.critic import (
    CriticStepCallback,
    critic_optimizer_spec,
    load_critic,
    load_value_model,
    save_critic,
)
from hf_verl.trainers.engine_glue import load_for_launch
from hf_verl.trainers.on_policy import OnPolicyTrainer
from hf_verl.trainers.ppo_config import PPOConfig

logger = logging.getLogger(__name__)


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
                         is_peft=peft_config is not None, critic=value_model is not None)
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
        needs = get_advantage_estimator(args.advantage_estimator).needs_critic
        if needs and value_model is None:
            raise ValueError(
                f"advantage_estimator={args.advantage_estimator!r} needs a value_model (the critic); pass one, or pick "
                f"a critic-free estimator: {advantage_estimator_names(critic=False)} (with num_generations >= 2 for "
                "the group ones)."
            )
        if value_model is not None and not needs:
            raise ValueError(f"advantage_estimator={args.advantage_estimator!r} does not use the critic: drop "
                             "value_model, or set advantage_estimator='gae'.")

    @property
    def kl_ctl(self):
        """The adaptive KL controller (None: `kl_coef` is fixed)."""
        return self.algorithm.kl_ctl

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

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.critic is not None:
            load_critic(self.critic, checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self.critic is not None:
            save_critic(self.critic, output_dir or self.args.output_dir, with_optimizer=_internal_call)

    # ------------------------------------------------------------------ round
    def _forward_rows(self) -> int:
        return self.args.local_rollout_forward_batch_size

    def _round_done(self, batch: RolloutBatch, rewards_per_func: torch.Tensor) -> None:
        """TRL's episode count, and a sample logged `num_sample_generations` times per run."""
        args = self.args
        self._episodes += args.batch_size
        self._metrics["episode"].append(float(self._episodes))
        every = max(1, int(self.state.max_steps // max(args.num_sample_generations, 1))) if args.num_sample_generations else 0
        if every and self.state.global_step % every == 0 and self.is_world_process_zero():
            logger.info("sample at step %d: %r -> %r (score %.3f)", self.state.global_step,
                        batch.meta["prompts"][0], batch.meta["completions"][0], batch.rewards[0].item())
