"""`GKDTrainer`: on-policy distillation (GKD) with TRL 1.16's `trl.experimental.gkd.GKDTrainer` constructor, config
and logged names, as a `transformers.Trainer` subclass on hf_verl's engines.

A step, per micro-batch of the Trainer's accumulation window (TRL's order):

1. with probability `lmbda` the student samples completions of the batch's prompts through the shared rollout
   engine (:class:`~hf_verl.rollout.hf_engine.TransformersEngine`, on the actor's weights or a replica kept in step
   by weight sync); else, with `seq_kd`, the teacher samples them; else the dataset's completions are used;
2. the teacher scores the completions (:meth:`~hf_verl.pipeline.distillation.GKDAlgorithm.prepare`): full logits
   (generalized JSD, `beta`) or, for a teacher with another tokenizer or served by URL, the log-probs of the
   student's tokens aligned by text (the sampled-token loss, docs/distillation.md);
3. the student engine's `forward_backward` runs every micro-batch with the algorithm's loss, each a sum over
   completion tokens divided by the window's token count over the data-parallel ranks (TRL's `num_items_in_batch`).

The teacher is a role built by the shared role builder, like a reference: colocated, on its own placement
(`placement={"teacher": "fsdp2"}`) or served (`placement={"teacher": "http://..."}`: `hf-verl serve` prompt
log-probs). Logged: TRL's (`loss`, `eval_loss`, the Trainer's `grad_norm`, `learning_rate`), nothing else.
"""

from __future__ import annotations

import logging
import random
import textwrap
from typing import Any, ClassVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Trainer

from hf_verl.algorithms.distillation import generalized_jsd_loss
from hf_verl.data.batch import RolloutBatch, pad_sequences
from hf_verl.data.chat_ml import ChatMLCollator
from hf_verl.engine.model_options import disable_dropout
from hf_verl.parallel import comm
from hf_verl.pipeline.distillation import (
    GKDAlgorithm,
    batch_from_labels,
    completion_masks,
)
from hf_verl.pipeline.sync import sync_weights
from hf_verl.rollout.base import SamplingParams
from hf_verl.rollout.registry import RolloutEngineContext, make_rollout_engine
from hf_verl.trainers.engine_glue import (
    EngineTrainerMixin,
    launch_layout,
    load_for_launch,
    load_pretrained,
)
from hf_verl.trainers.gkd_config import GKDConfig

logger = logging.getLogger(__name__)


class GKDTrainer(EngineTrainerMixin, Trainer):
    """Generalized knowledge distillation of a causal LM (TRL's `GKDTrainer` arguments and meanings).

    Args:
        model (`str` or `PreTrainedModel`): the student: a Hub id or path (`args.model_init_kwargs`), or a model.
        teacher_model (`str` or `PreTrainedModel`, *optional*): the teacher (an id or path loaded with
            `args.teacher_model_init_kwargs`, or a model); default `args.teacher_model_name_or_path`. None for a
            teacher served by URL (`args.placement={"teacher": url}`).
        args ([`GKDConfig`], *optional*): the configuration.
        data_collator (*optional*): default :class:`~hf_verl.data.chat_ml.ChatMLCollator` (TRL's ChatML batches).
        train_dataset / eval_dataset: rows with `messages` (conversational), `prompt` / `completion` texts, or
            `input_ids`.
        processing_class (*optional*): the student's tokenizer (loaded from `model` when omitted).
        compute_metrics, callbacks, optimizers, preprocess_logits_for_metrics: as in `transformers.Trainer`
            (evaluation predicts the loss only).
        peft_config (`peft.PeftConfig`, *optional*): train adapters on the student.
        formatting_func: accepted for TRL's signature; GKD skips dataset preparation, as in TRL.
        teacher_processing_class (*optional*, hf_verl): the teacher's tokenizer when it is not the student's
            (cross-tokenizer mode); default `args.teacher_tokenizer_name_or_path`.

    Raises:
        ValueError: a teacher with another vocabulary and no tokenizer of its own given, a teacher tokenizer that
            cannot round-trip the run's text, `seq_kd` with a cross-tokenizer or served teacher, a Megatron launch.
    """

    _tag_names: ClassVar[list[str]] = ["trl", "gkd", "hf_verl"]
    _name = "GKD"
    _paper: ClassVar[dict] = {
        "title": "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
        "id": "2306.13649",
        "citation": textwrap.dedent("""\
            @inproceedings{agarwal2024on-policy,
                title        = {{On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes}},
                author       = {Rishabh Agarwal and Nino Vieillard and Yongchao Zhou and Piotr Stanczyk and Sabela Ramos Garea and Matthieu Geist and Olivier Bachem},
                year         = 2024,
                booktitle    = {The Twelfth International Conference on Learning Representations, {ICLR} 2024},
            }"""),
    }

    generalized_jsd_loss = staticmethod(generalized_jsd_loss)

    def __init__(self, model=None, teacher_model=None, args: GKDConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), preprocess_logits_for_metrics=None, peft_config=None, formatting_func=None,
                 teacher_processing_class=None) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GKDConfig(f"{str(name).split('/')[-1]}-GKD")
        elif not isinstance(args, GKDConfig):
            raise TypeError(f"GKDTrainer takes a GKDConfig, got {type(args).__name__}.")
        if getattr(args, "backend", None) == "megatron":
            raise ValueError("GKDTrainer runs on the accelerate engines (one process, DDP, FSDP2, ZeRO); the "
                             "Megatron engine has no full-logits forward yet: drop backend='megatron'.")
        args.remove_unused_columns = False  # the collator reads the raw columns (TRL's)
        args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
        if isinstance(model, str):
            model_id = model
            model = load_for_launch(model, args.model_init_kwargs, args, trust_remote_code=args.trust_remote_code)
        else:
            model_id = model.config._name_or_path
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model_id, trust_remote_code=args.trust_remote_code)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if args.disable_dropout:
            disable_dropout(model)
        layout = launch_layout(args.world_size, args)
        builder = self._role_builder(args, layout, has_reference=None)
        served = builder.remote_url("teacher") is not None
        teacher_model = self._load_teacher(teacher_model, args, served)
        teacher_tokenizer = self._teacher_tokenizer(teacher_processing_class, args)
        if teacher_tokenizer is None and teacher_model is not None:
            self._check_vocabularies(model, teacher_model)
        replica = builder.actor_replica(model)
        super().__init__(model=model, args=args,
                         data_collator=data_collator or ChatMLCollator(processing_class, max_length=args.max_length),
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._init_engines(builder)
        self.model_accepts_loss_kwargs = False
        self.teacher_model = teacher_model
        if teacher_model is not None and not served:
            teacher_model = teacher_model.to(self.accelerator.device).eval()
        self.teacher = builder.reference(None if served else teacher_model, role="teacher")
        self.algorithm = GKDAlgorithm(args, self.teacher, student_tokenizer=processing_class,
                                      teacher_tokenizer=teacher_tokenizer, served=served,
                                      probe_texts=self._probe_texts(train_dataset) if teacher_tokenizer else ())
        if args.seq_kd and self.algorithm.sampled:
            raise ValueError(f"seq_kd=True needs a local teacher with the student's tokenizer (its completions are "
                             f"trained on as the student's tokens); this teacher is {self.algorithm.mode}: set "
                             "seq_kd=False.")
        logger.info("GKD: %s teacher (%s)", self.algorithm.mode, "served" if served else "local")
        self.lmbda, self.beta, self.temperature, self.seq_kd = args.lmbda, args.beta, args.temperature, args.seq_kd
        self.generation_kwargs = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                  "do_sample": True, "top_k": 0, "top_p": 1.0,
                                  "use_cache": not args.gradient_checkpointing,
                                  "pad_token_id": processing_class.pad_token_id}
        self.generation_config = GenerationConfig(**self.generation_kwargs)
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is not None:
            self.generation_config.eos_token_id = eos
        self.generator = builder.generator(args, actor=self.actor, replica=replica, tokenizer=processing_class,
                                           engine="transformers", max_new_tokens=args.max_new_tokens,
                                           seed=args.seed)
        self._teacher_generator = None
        if args.seq_kd:
            self._teacher_generator = make_rollout_engine("transformers", RolloutEngineContext(
                model=teacher_model, tokenizer=processing_class, settings=args, seed=args.seed,
                max_new_tokens=args.max_new_tokens))
        self._synced_step = -1

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _load_teacher(teacher_model: Any, args: GKDConfig, served: bool) -> Any:
        """The teacher model (TRL's rules for `teacher_model_init_kwargs`); None for a served teacher."""
        teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if served:
            if teacher_model is not None and not isinstance(teacher_model, str):
                raise ValueError("placement['teacher'] is a server URL, so the teacher is the model it serves: drop "
                                 "teacher_model (or pass its id only).")
            return None
        if teacher_model is None:
            raise ValueError("GKDTrainer needs a teacher: pass teacher_model (an id, path or model), set "
                             "GKDConfig.teacher_model_name_or_path, or serve one (placement={'teacher': url}).")
        if args.teacher_model_init_kwargs is not None and not isinstance(teacher_model, str):
            raise ValueError("You passed teacher_model_init_kwargs to the GKDConfig, but your teacher_model is already "
                             "instantiated.")
        if isinstance(teacher_model, str):
            return load_pretrained(teacher_model, args.teacher_model_init_kwargs,
                                   trust_remote_code=args.trust_remote_code, auto_class=AutoModelForCausalLM)
        return teacher_model

    @staticmethod
    def _teacher_tokenizer(teacher_processing_class: Any, args: GKDConfig) -> Any:
        if teacher_processing_class is not None:
            return teacher_processing_class
        if args.teacher_tokenizer_name_or_path is not None:
            return AutoTokenizer.from_pretrained(args.teacher_tokenizer_name_or_path,
                                                 trust_remote_code=args.trust_remote_code)
        return None

    @staticmethod
    def _check_vocabularies(student: Any, teacher: Any) -> None:
        s = student.config.get_text_config().vocab_size
        t = teacher.config.get_text_config().vocab_size
        if s != t:
            raise ValueError(f"The student model has vocab_size {s} but the teacher model has vocab_size {t}. GKD "
                             "compares the teacher's full next-token distribution, which requires a shared vocabulary. "
                             "Use a teacher with the same vocab_size, or pass the teacher's tokenizer "
                             "(teacher_processing_class= or GKDConfig.teacher_tokenizer_name_or_path) for the "
                             "cross-tokenizer mode.")

    def _probe_texts(self, dataset: Any, rows: int = 8) -> list[str]:
        """Texts of the first rows of `dataset` (prompt + completion, as the student's tokenizer decodes them), for
        the teacher tokenizer's round-trip check."""
        try:
            examples = [dataset[i] for i in range(min(rows, len(dataset)))]
        except TypeError:  # an iterable dataset
            examples = [row for _, row in zip(range(rows), dataset)]
        batch = self.data_collator(examples) if examples else None
        if batch is None:
            return []
        special = set(self.processing_class.all_special_ids)
        return [self.processing_class.decode([t for t in ids[mask.bool()].tolist() if t not in special])
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        return self._over_data_parallel_ranks(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._over_data_parallel_ranks(super().get_eval_dataloader(eval_dataset))

    # ------------------------------------------------------------------ generation (TRL's static helper, and ours)
    @staticmethod
    def generate_on_policy_outputs(model, inputs: dict, generation_config) -> tuple[torch.Tensor, ...]:
        """TRL's helper: `model.generate` on `inputs["prompts"]`, and `(sequences, attention_mask, labels)` with the
        completion kept up to its first stop token and the prompt's labels -100
        (:func:`~hf_verl.pipeline.distillation.completion_masks`)."""
        out = model.generate(input_ids=inputs["prompts"], attention_mask=inputs["prompt_attention_mask"],
                             generation_config=generation_config, return_dict_in_generate=True)
        sequences = out.sequences
        attention_mask, labels = completion_masks(sequences, inputs["prompt_attention_mask"],
                                                  generation_config.eos_token_id)
        return sequences, attention_mask, labels

    def _sample(self, inputs: dict, engine: Any) -> RolloutBatch:
        """Completions of the batch's prompts from a rollout engine, as a `RolloutBatch` (EOS kept)."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(inputs["prompts"], inputs["prompt_attention_mask"])]
        if engine is self.generator and self._synced_step != self.state.global_step:
            sync_weights(self.actor, engine)  # nothing to move when it generates on the actor's own tensors
            self._synced_step = self.state.global_step
        sampling = SamplingParams(max_new_tokens=self.args.max_new_tokens, temperature=self.args.temperature)
        was_training = self.actor.training
        self.actor.train(False)
        try:
            out = engine.generate(prompts, sampling)
        finally:
            self.actor.train(was_training)
        pad = self.processing_class.pad_token_id
        device = inputs["prompts"].device
        p_ids, p_mask = pad_sequences(prompts, pad, side="left", device=device)
        width = max(1, max(len(c) for c in out.completion_ids))
        c_ids, c_mask = pad_sequences(out.completion_ids, pad, side="right", device=device, width=width)
        return RolloutBatch(p_ids, p_mask, c_ids, c_mask)

    def _rollout(self, inputs: dict) -> tuple[RolloutBatch, bool]:
        """One micro-batch's completions and whether the student sampled them (TRL's draw per micro-batch)."""
        if random.random() <= self.lmbda:
            return self._sample(inputs, self.generator), True
        if self.seq_kd:
            return self._sample(inputs, self._teacher_generator), False
        return self._dataset_batch(inputs), False

    def _dataset_batch(self, inputs: dict) -> RolloutBatch:
        return batch_from_labels(inputs["input_ids"], inputs["attention_mask"], inputs["labels"],
                                 self.processing_class.pad_token_id)

    # ------------------------------------------------------------------ the step
    def _train_window(self, window: list) -> list[torch.Tensor]:
        """One optimizer step: every micro-batch's completions and teacher side, then the student's
        `forward_backward`; returns each micro-batch's share of the window's mean loss."""
        micro = []
        for inputs in window:
            batch, on_policy = self._rollout(self._prepare_inputs(inputs))
            micro.append(self.algorithm.prepare(batch, self.actor, on_policy=on_policy))
        tokens = torch.tensor([float(sum(mb.batch.completion_mask.sum().item() for mb in micro))],
                              dtype=torch.float64)
        total = comm.reduce(self.dims, tokens, "sum").item()
        for mb in micro:
            mb.num_items = max(total, 1.0) / self.dims.dp_size
        self.actor.train()
        with self.compute_loss_context_manager():
            result = self.actor.forward_backward(micro, self.algorithm.loss_fn,
                                                 forward=self.algorithm.forward_request(), loss_scale=1.0)
        return [loss.to(self.args.device) for loss in result.losses]

    def compute_loss(self, model, inputs: dict, return_outputs=False, num_items_in_batch=None):
        """The distillation loss of a batch of TRL's layout (`input_ids`, `attention_mask`, `labels`) on its own
        completions: the token sum over the counted labels, divided by `num_items_in_batch` when given, else by
        their number (TRL's `batchmean`). No backward."""
        mb = self.algorithm.prepare(self._dataset_batch(inputs), self.actor, on_policy=False)
        out = self.algorithm.forward_request().run(self.actor, mb)
        total = self.algorithm.token_sum(out, mb)
        if num_items_in_batch is None:
            count = mb.batch.completion_mask.sum().clamp_min(1).to(total.dtype)
        else:
            count = num_items_in_batch.to(total.device) if isinstance(num_items_in_batch, torch.Tensor) else \
                num_items_in_batch
        loss = total / count
        return (loss, out) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss of an evaluation batch (on the dataset's completions); no predictions."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
