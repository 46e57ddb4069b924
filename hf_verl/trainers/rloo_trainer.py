"""`RLOOTrainer`: REINFORCE leave-one-out (Ahmadian et al., 2024) with TRL 1.16's constructor, config and metrics.

It is GRPOTrainer's machinery (rollout rounds, engines, parallelism, placement, evaluation) running another
algorithm object: :class:`~hf_verl.pipeline.rloo.RLOOAlgorithm` (the KL as a sequence-level reward penalty, the
leave-one-out baseline with TRL's handling of unscorable completions, `reward_clip_range`, `normalize_advantages`,
PPO-clip on the sequence's ratio), which its :class:`~hf_verl.trainers.rloo_config.RLOOConfig` names.
"""

from __future__ import annotations

from hf_verl.trainers.grpo_trainer import GRPOTrainer
from hf_verl.trainers.rloo_config import RLOOConfig


class RLOOTrainer(GRPOTrainer):
    """Train a causal LM with RLOO (TRL's `RLOOTrainer` constructor and meanings).

    Args:
        model (`str` or `PreTrainedModel`): Hub id, local path, or a model.
        reward_funcs: a reward function, a reward-model id/path/model, or a list of them.
        args ([`RLOOConfig`]): the configuration.
        train_dataset / eval_dataset: datasets with a `prompt` column (text or messages).
        processing_class: the policy tokenizer (loaded from `model` when omitted).
        reward_processing_classes: tokenizers of reward models, aligned with `reward_funcs`.
        callbacks, optimizers: as in `transformers.Trainer`.
        peft_config: a `peft` config; the reference is then the model with adapters disabled.
    """

    _tag_names = ["trl", "rloo", "hf_verl"]

    def __init__(self, model, reward_funcs, args: RLOOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 peft_config=None) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = RLOOConfig(f"{str(name).split('/')[-1]}-RLOO")
        elif not isinstance(args, RLOOConfig):
            raise TypeError(f"RLOOTrainer takes an RLOOConfig, got {type(args).__name__}: build an RLOOConfig with the "
                            "same fields (GRPOConfig's are accepted there).")
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config)
