"""`RewardTrainer`: an outcome reward model trained on preference pairs, as a `transformers.Trainer` subclass.

TRL 1.16's constructor, config, dataset formats and metric names. The model is a sequence classifier with one label
(a causal LM checkpoint gets a new `score` head, :mod:`hf_verl.trainers.reward_setup`); the data are preference
pairs, each side tokenised whole (:mod:`hf_verl.trainers.reward_data`) and batched by the preference collator DPO
uses, `2B` rows with the chosen ones first. A step hands the Trainer's accumulation window to the model's engine
(:class:`~hf_verl.trainers.engine_glue.EngineTrainerMixin`), laid out by the launch (one process, DDP, FSDP2,
ZeRO-1/2/3), with the :class:`~hf_verl.engine.step.SequenceScores` request (each row's score where the saved model's
own forward reads it) and the Bradley-Terry loss of :mod:`hf_verl.algorithms.reward_losses`.

Metrics (TRL's names): `accuracy`, `margin`, `min_reward`, `mean_reward`, `max_reward` per micro-batch over the
data-parallel group (min and max of the group, means of the ranks' means, as TRL's gathers give), and `num_tokens`,
the tokens trained on so far. Evaluation predicts `(chosen_score, rejected_score)` per pair (hf_verl's DPO
convention; TRL hands `compute_metrics` the raw `(2B, 1)` logits), so `preference_accuracy` works as
`compute_metrics`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from typing import Any, ClassVar

import torch
from transformers import AutoTokenizer, Trainer, set_seed

from hf_verl.algorithms.reward_losses import bradley_terry_loss, pairwise_reward_metrics
from hf_verl.data.preference import MARGIN_COLUMN, PreferenceCollator
from hf_verl.engine.model_options import disable_dropout
from hf_verl.engine.step import SequenceScores
from hf_verl.parallel import comm
from hf_verl.trainers.engine_glue import EngineTrainerMixin, launch_layout
from hf_verl.trainers.preference_data import is_streaming, preference_accuracy  # noqa: F401 (compute_metrics)
from hf_verl.trainers.quantization import check_quantized_run, merge_quantization_config
from hf_verl.trainers.reward_config import RewardConfig
from hf_verl.trainers.reward_data import RewardData
from hf_verl.trainers.reward_setup import (
    check_reward_model,
    load_reward_model,
    set_eos_token,
    set_pad_token,
    take_chat_template,
    warn_if_head_frozen,
)

logger = logging.getLogger(__name__)

# how each metric of a micro-batch combines over the data-parallel ranks (TRL gathers the scores: min of mins...)
_REDUCE = {"min_reward": "min", "max_reward": "max"}


class RewardTrainer(RewardData, EngineTrainerMixin, Trainer):
    """Train a reward model on preference pairs (TRL's `RewardTrainer` arguments and meanings).

    Args:
        model (`str` or `PreTrainedModel`): a Hub id or path (loaded as `AutoModelForSequenceClassification` with
            `num_labels=1`, `args.model_init_kwargs` passed on), or a sequence-classification model (or `PeftModel`)
            with `num_labels=1`.
        args ([`RewardConfig`], *optional*): the configuration; default `RewardConfig("<model name>-Reward")`.
        data_collator (*optional*): default: padded pair batches (`input_ids`, `attention_mask` of `2B` rows,
            chosen first; `margin` when the dataset has it).
        train_dataset (`datasets.Dataset` or `IterableDataset`): preference rows (`prompt` / `chosen` / `rejected`,
            or `chosen` / `rejected` with the prompt inside), text or conversational, optionally `margin`; or
            tokenised `chosen_ids` / `rejected_ids`.
        eval_dataset (*optional*): the same, or a dict / `DatasetDict` of them.
        processing_class (*optional*): the tokenizer (loaded from `model` when omitted).
        compute_metrics (*optional*): for evaluation; receives `(chosen_score, rejected_score)` per pair as
            predictions (see `preference_accuracy`).
        callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics: as in
            `transformers.Trainer`.
        quantization_config (`transformers.BitsAndBytesConfig`, *optional*): load `model` (an id or path) k-bit
            quantized; with `peft_config`, QLoRA. Ignored (with a warning) for a model object, as in TRL.
        peft_config (`peft.PeftConfig`, *optional*): train adapters on the model; for a causal LM checkpoint add
            `modules_to_save=["score"]` so that the new head trains too.
    """

    _tag_names: ClassVar[list[str]] = ["trl", "reward-trainer", "hf_verl"]  # TRL's tags (Hub model cards), and ours

    def __init__(self, model, args: RewardConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = RewardConfig(f"{str(name).split('/')[-1]}-Reward")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: RewardTrainer trains on preference pairs (chosen / "
                             "rejected rows).")
        self._check_vision(train_dataset, eval_dataset)
        if is_streaming(train_dataset):  # its padded batches differ in length: accelerate must not concatenate them
            if args.accelerator_config.dispatch_batches:
                logger.warning("dispatch_batches=True is turned off for an IterableDataset (batches of different "
                               "lengths cannot be dispatched from the main process).")
            args.accelerator_config.dispatch_batches = False
        set_seed(args.seed)  # a new score head is initialised when the model loads: the same one every run
        load_kwargs = merge_quantization_config(model, args.model_init_kwargs, quantization_config,
                                                refuse_model_object=False)
        check_quantized_run(model, load_kwargs, peft_config, args)
        if isinstance(model, str):
            model = load_reward_model(model, load_kwargs, trust_remote_code=args.trust_remote_code)
        else:
            if args.model_init_kwargs is not None:
                logger.warning("model_init_kwargs are ignored: the model is already instantiated.")
            check_reward_model(model)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path,
                                                             trust_remote_code=args.trust_remote_code)
        if args.eos_token is not None:
            set_eos_token(model, processing_class, args.eos_token)
        added = []
        if args.chat_template_path is not None:
            added = take_chat_template(model, processing_class, args.chat_template_path,
                                       trust_remote_code=args.trust_remote_code)
        if peft_config is not None:
            model = self._with_adapters(model, peft_config, added)
        if args.disable_dropout:
            disable_dropout(model)
        set_pad_token(model, processing_class, args.pad_token)
        self.tokenizer_ = processing_class
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._total_train_tokens = 0
        layout = launch_layout(args.world_size, args)
        builder = self._role_builder(args, layout, has_reference=False)
        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")
        eval_dataset = self._prepare_eval_dataset(eval_dataset, processing_class, args)
        super().__init__(model=model, args=args, data_collator=data_collator or PreferenceCollator(
                             processing_class.pad_token_id, pad_to_multiple_of=args.pad_to_multiple_of),
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._init_engines(builder)
        self.model_accepts_loss_kwargs = False
        self.label_names = []  # pairs carry no labels: evaluation predicts their scores (prediction_step)

    @staticmethod
    def _with_adapters(model, peft_config, added_tokens: list[int]):
        """`model` under PEFT adapters (TRL's checks); the tokens a chat template added train as well."""
        from peft import PeftConfig, get_peft_model

        if not isinstance(peft_config, PeftConfig):
            raise TypeError(f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig), got "
                            f"{type(peft_config).__name__}.")
        if hasattr(model, "peft_config"):
            raise ValueError("the model already has PEFT adapters and a peft_config was given: merge and unload its "
                             "adapter (model.merge_and_unload()), or pass the PeftModel without peft_config.")
        if added_tokens:
            indices = dict(peft_config.trainable_token_indices or {})
            indices["embed_tokens"] = list(indices.get("embed_tokens", [])) + list(added_tokens)
            peft_config.trainable_token_indices = indices
        warn_if_head_frozen(peft_config)
        return get_peft_model(model, peft_config)

    # ------------------------------------------------------------------ data
    def _set_signature_columns_if_needed(self) -> None:
        # the Trainer drops every column but these when remove_unused_columns=True (TRL's choice)
        if self._signature_columns is None:
            self._signature_columns = ["chosen_ids", "rejected_ids", MARGIN_COLUMN]

    def get_train_dataloader(self):
        return self._over_data_parallel_ranks(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._over_data_parallel_ranks(super().get_eval_dataloader(eval_dataset))

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`Trainer.evaluate`, also for a raw dataset (tokenised here) and for a dict / `DatasetDict` of them
        (metrics `eval_<name>_*`)."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._prepare_eval_dataset(eval_dataset, self.tokenizer_, self.args)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------ loss
    def _request(self) -> SequenceScores:
        return SequenceScores(self.tokenizer_.pad_token_id)

    def _reward_loss(self, scores: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, dict[str, Any]]:
        """`(loss, metrics)` of one micro-batch from its `(2B,)` scores (chosen rows first); runs no collective."""
        chosen, rejected = scores.chunk(2)
        loss = bradley_terry_loss(chosen, rejected, margin=inputs.get(MARGIN_COLUMN),
                                  center_rewards_coefficient=self.args.center_rewards_coefficient)
        return loss, pairwise_reward_metrics(chosen, rejected)

    def _take_metrics(self, mode: str, metrics: list[dict[str, Any]], batches: list[dict]) -> None:
        """Each micro-batch's metrics, combined over the data-parallel ranks (a collective: every rank calls it with
        the same micro-batch count), and the trained tokens counted."""
        if not metrics:
            return
        keys = sorted(metrics[0])
        values = torch.tensor([[float(m[k]) for k in keys] for m in metrics], dtype=torch.float64)
        combined = {}
        for op in ("mean", "min", "max"):
            columns = [i for i, k in enumerate(keys) if _REDUCE.get(k, "mean") == op]
            if columns:
                reduced = comm.reduce(self.dims, values[:, columns].contiguous(), op)
                combined.update({keys[i]: reduced[:, j] for j, i in enumerate(columns)})
        for k in keys:
            self._metrics[mode][k].extend(combined[k].tolist())
        if mode == "train":
            tokens = torch.tensor([float(b["attention_mask"].sum()) if "attention_mask" in b else
                                   float(b["input_ids"].numel()) for b in batches], dtype=torch.float64)
            self._total_train_tokens += int(comm.reduce(self.dims, tokens, "sum").sum().item())
        self._metrics[mode]["num_tokens"] = [float(self._total_train_tokens)]

    def compute_loss(self, model, inputs: dict, return_outputs=False, num_items_in_batch=None):
        """The pairwise loss of one micro-batch, without a backward (the metrics are recorded by the caller)."""
        scores = self._request().run(self.actor, inputs)
        loss, metrics = self._reward_loss(scores, inputs)
        if return_outputs:
            return loss, {"scores": scores.detach(), "metrics": metrics}
        return loss

    def _train_window(self, window: list) -> list[torch.Tensor]:
        """One optimizer step: every micro-batch of the window through the engine (DDP, FSDP2 or ZeRO)."""
        self.actor.train()
        batches = [self._prepare_inputs(inputs) for inputs in window]
        offload = torch.autograd.graph.save_on_cpu(pin_memory=True) if self.args.activation_offloading else \
            contextlib.nullcontext()
        with self.compute_loss_context_manager(), offload:
            result = self.actor.forward_backward(batches, self._reward_loss, forward=self._request(),
                                                 loss_scale=1.0 / self.current_gradient_accumulation_steps)
        self._take_metrics("train", result.metrics, batches)
        return self._window_losses_of(result)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss of an evaluation batch and, unless only the loss is asked, `(chosen_score, rejected_score)` per
        pair as predictions (labels: zeros)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, out = self.compute_loss(model, inputs, return_outputs=True)
        self._take_metrics("eval", [out["metrics"]], [inputs])
        if prediction_loss_only:
            return loss.detach(), None, None
        preds = torch.stack(out["scores"].chunk(2), dim=1)
        return loss.detach(), preds, torch.zeros(preds.shape[0], dtype=torch.long, device=preds.device)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with the metrics recorded since the last one averaged in (`eval_`-prefixed for an
        evaluation)."""
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        logs.update({prefix + k: sum(v) / len(v) for k, v in sorted(self._metrics[mode].items()) if v})
        self._metrics[mode].clear()
        super().log(logs, start_time)
