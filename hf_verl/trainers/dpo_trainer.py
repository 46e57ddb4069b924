"""`DPOTrainer`: offline preference optimisation as a `transformers.Trainer` subclass.

The data path is :mod:`hf_verl.data.preference` (prompt extraction, tokenisation, truncation,
padded or padding-free batches of chosen-then-rejected sequences); the losses are the pure
functions of :mod:`hf_verl.algorithms.dpo_losses`; sequence log-probs come from the chunked LM
head of :mod:`hf_verl.algorithms.logprobs` (no full `(tokens, vocab)` logits tensor), one forward
for chosen and rejected together. The reference is a separate model, the PEFT base model with
adapters disabled, or log-probs precomputed once over the dataset and cached on disk by dataset
fingerprint and reference weights, after which no reference forward runs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import AutoProcessor, AutoTokenizer, Trainer

from hf_verl.algorithms.dpo_losses import (
    combined_dpo_loss,
    implicit_rewards,
    ld_token_weights,
    reward_metrics,
    wpo_weights,
)
from hf_verl.data.preference import (
    REF_COLUMNS,
    PreferenceCollator,
)
from hf_verl.data.prompts import ensure_pad_token
from hf_verl.data.vision import (
    VISION_INPUTS,
    VisionPreferenceCollator,
    check_vision_setup,
    is_vision_model,
    text_tokenizer,
)
from hf_verl.engine.base import TrainingEngine
from hf_verl.engine.model_options import disable_dropout, router_aux_loss
from hf_verl.engine.step import ForwardRequest, TokenQuery
from hf_verl.parallel import comm
from hf_verl.parallel.sharded_load import loaded_sharded, state_sums
from hf_verl.trainers.dpo_config import DPOConfig
from hf_verl.trainers.dpo_data import DPOData, preference_accuracy  # noqa: F401 (TRL's compute_metrics)
from hf_verl.trainers.dpo_vision import refuse_vision_pairs, vision_sequence_logps
from hf_verl.trainers.engine_glue import (
    EngineTrainerMixin,
    launch_layout,
    load_for_launch,
    load_pretrained,
)
from hf_verl.trainers.policy_control import ReferenceMixCallback
from hf_verl.trainers.quantization import check_quantized_run, merge_quantization_config

logger = logging.getLogger(__name__)



REF_ADAPTER = "ref"


def _add_reference_adapter(model) -> str:
    """Add to a PEFT model a frozen copy of its active adapter, named `REF_ADAPTER`; returns that name."""
    active = model.active_adapter
    model.add_adapter(REF_ADAPTER, model.peft_config[active])
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if f".{active}." in name:
                params[name.replace(f".{active}.", f".{REF_ADAPTER}.")].copy_(param)
    for name, param in params.items():
        if f".{REF_ADAPTER}." in name:
            param.requires_grad_(False)
    return REF_ADAPTER


@contextlib.contextmanager
def _active_adapter(model, name: str):
    """Score with adapter `name` of a PEFT model (frozen meanwhile), then make the previous one active and
    trainable again (PEFT's set_adapter freezes the adapters it deactivates)."""
    previous = model.active_adapter
    model.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(previous)


def _split_rows(batch: dict) -> tuple[list[list[int]], list[list[int]]]:
    """A padded pair batch's rows as (prompt tokens, completion tokens) lists."""
    ids, real, comp = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    return [row[r & ~c].tolist() for row, r, c in zip(ids, real, comp)], [row[c].tolist() for row, c in zip(ids, comp)]


@dataclass(frozen=True)
class PairLogProbs(ForwardRequest):
    """The forward request of DPO's pairs: `sequence_logps(engine, batch, with_aux_loss, with_wpo)` gives the
    summed completion log-probs, mean logits and token counts per sequence (chosen rows, then rejected), built
    on the engine's token log-prob primitives. Its padded form is one `token_logprobs` call and a per-sequence
    reduction (`query`, `reduce`), offered as a :class:`~hf_verl.engine.step.TokenQuery` so that a pipelined
    engine can schedule it."""

    sequence_logps: Callable
    with_aux_loss: bool = False
    with_wpo: bool = False
    query: Callable | None = None
    reduce: Callable | None = None

    def run(self, engine: TrainingEngine, micro_batch: dict) -> tuple:
        return self.sequence_logps(engine, micro_batch, with_aux_loss=self.with_aux_loss, with_wpo=self.with_wpo)

    def token_query(self, engine: TrainingEngine, micro_batch: dict) -> TokenQuery | None:
        if self.query is None:
            return None
        return self.query(engine, micro_batch, with_aux_loss=self.with_aux_loss, with_wpo=self.with_wpo)

    def from_stats(self, stats: Any, micro_batch: dict) -> tuple:
        return self.reduce(stats, micro_batch, with_aux_loss=self.with_aux_loss, with_wpo=self.with_wpo)

    def without_extras(self) -> PairLogProbs:
        """The request for the reference: log-probs, logits and counts only."""
        return replace(self, with_aux_loss=False, with_wpo=False)


def _weights_digest(model) -> str:
    """A digest of `model`'s weights (names, shapes, sums); for a model loaded sharded, read from its checkpoint
    (the same digest as the whole load's)."""
    if loaded_sharded(model):
        items = state_sums(model)
    else:
        items = [(name, tuple(p.shape), p.detach().double().sum().item()) for name, p in model.state_dict().items()]
    h = hashlib.sha256()
    for name, shape, total in sorted(items):
        h.update(name.encode())
        h.update(str(shape).encode())
        h.update(f"{total:.10e}".encode())
    return h.hexdigest()[:16]


class DPOTrainer(DPOData, EngineTrainerMixin, Trainer):
    """Train a causal LM on preference pairs with DPO and its variants (TRL's arguments).

    Args:
        model (`str` or `PreTrainedModel`): the policy (Hub id, path or model).
        ref_model (`str` or `PreTrainedModel`, *optional*): the reference; default a frozen copy of
            `model` (with `peft_config`: the model with adapters disabled).
        args ([`DPOConfig`]): the configuration.
        data_collator: default: padded or padding-free pair batches (see `DPOConfig.padding_free`).
        train_dataset / eval_dataset: `prompt`/`chosen`/`rejected` or `chosen`/`rejected` rows, text
            or conversational.
        processing_class: the tokenizer (loaded from `model` when omitted).
        compute_metrics: for evaluation; receives `(chosen_reward, rejected_reward)` per pair as
            predictions (see `preference_accuracy`).
        callbacks, optimizers, peft_config: as in TRL.
        quantization_config (`transformers.BitsAndBytesConfig`, *optional*): load `model` (an id or path, and
            `ref_model` when given as one) k-bit quantized; with `peft_config`, QLoRA (only the adapters train). As
            in TRL it may be given in `args.model_init_kwargs` instead, and is refused for a model object. Checked
            at construction: see :mod:`hf_verl.trainers.quantization`.
    """

    _tag_names = ["trl", "dpo", "hf_verl"]  # TRL's tags (Hub model cards), and ours

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), quantization_config=None, peft_config=None) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = DPOConfig(f"{str(name).split('/')[-1]}-DPO")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: DPOTrainer trains on preference pairs (prompt / chosen / "
                             "rejected rows).")
        if ref_model is not None and ref_model is model and not isinstance(model, str):  # one id may name both
            raise ValueError("`model` and `ref_model` must be different objects; pass ref_model=None for a frozen "
                             "copy (or, with peft, the model with adapters disabled).")
        # by id: TRL's defaults (float32 unless model_init_kwargs names a dtype), quantized with quantization_config
        load_kwargs = merge_quantization_config(model, args.model_init_kwargs, quantization_config,
                                                refuse_model_object=True)
        check_quantized_run(model, load_kwargs, peft_config, args)
        # by id under FSDP2 / ZeRO-3: loaded sharded, each rank reading its own shards (docs/loading.md); with PEFT,
        # whole
        load = load_pretrained if peft_config is not None else functools.partial(load_for_launch, args=args)
        if isinstance(model, str):
            model = load(model, load_kwargs, trust_remote_code=args.trust_remote_code)
        if isinstance(ref_model, str):
            ref_model = load(ref_model, load_kwargs, trust_remote_code=args.trust_remote_code)
        if processing_class is None:  # a vision-language model's processor, as TRL loads it
            auto = AutoProcessor if is_vision_model(model) else AutoTokenizer
            processing_class = auto.from_pretrained(model.config._name_or_path, trust_remote_code=args.trust_remote_code)
        evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
        # pairs with images: tokenised by the processor, their pixel inputs in every batch (data/vision.py)
        self._processor = processing_class if check_vision_setup(model, processing_class, [train_dataset, *evals],
                                                                 trainer="DPOTrainer") else None
        tokenizer = text_tokenizer(processing_class)
        if args.pad_token is not None:
            if args.pad_token not in tokenizer.get_vocab():
                raise ValueError(f"pad_token {args.pad_token!r} is not in the tokenizer's vocabulary; pick a token it "
                                 "has (e.g. its eos_token) or leave pad_token unset.")
            tokenizer.pad_token = args.pad_token
            model.config.pad_token_id = tokenizer.pad_token_id
        ensure_pad_token(tokenizer)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if args.disable_dropout:
            disable_dropout(model, ref_model)
        if args.gradient_checkpointing:
            model.config.use_cache = False
        self.is_peft = peft_config is not None or hasattr(model, "disable_adapter")
        # a model that comes with its adapter (e.g. an SFT LoRA) is its own reference, adapter included, as in TRL:
        # a frozen copy of that adapter, named "ref", scores the reference (one adapter of memory, not a model)
        self._ref_adapter = None
        if self.is_peft and peft_config is None and ref_model is None:
            self._ref_adapter = _add_reference_adapter(model)
        # the reference: the given model; else the base model (adapters disabled) with PEFT; else, when its
        # log-probs are precomputed, the policy itself before its first step (as TRL: no copy is kept); else a
        # frozen copy of the policy
        layout = launch_layout(args.world_size, args)
        builder = self._role_builder(args, layout, has_reference=True if ref_model is not None else None)
        if builder.remote_url("reference") is not None:
            raise ValueError("DPOConfig.placement['reference'] is a URL, but a served reference scores rollout "
                             "completions only, not DPO's chosen / rejected pairs: place the reference on a backend "
                             "('colocated', 'ddp', 'fsdp2', 'zero1', 'zero2', 'zero3') or precompute its log-probs "
                             "(precompute_ref_log_probs=True).")
        if ref_model is None and not self.is_peft and not args.precompute_ref_log_probs:
            ref_model = builder.reference_model(model, bf16=bool(args.bf16), fp16=bool(args.fp16))
        elif ref_model is not None:
            ref_model = ref_model.eval().requires_grad_(False)
        self.ref_model = ref_model
        backend, dims = layout.backend, layout.dims
        if dims.sp > 1:
            unsupported = [name for name, on in (("use_weighting", args.use_weighting),
                                                 ("router_aux_loss_coef", router_aux_loss(model, args.router_aux_loss_coef)[1]),
                                                 ("padding_free", args.padding_free)) if on]
            if unsupported:
                raise ValueError(f"sequence_parallel_size={dims.sp} is not supported with {unsupported}: the "
                                 "sequence-parallel path packs the pairs itself and computes token log-probs and mean "
                                 "logits only; turn those off or use sequence_parallel_size=1.")
        if args.sync_ref_model and backend.kind == "deepspeed" and backend.zero_stage == 3:
            raise ValueError("sync_ref_model (TR-DPO) mixes policy weights into the reference, which ZeRO-3 keeps "
                             "partitioned in separate engines: use ZeRO-1/2, DDP or FSDP2, or sync_ref_model=False.")
        if self._processor is not None:
            refuse_vision_pairs(args, backend, dims)
        self._ref_digest = _weights_digest(ref_model if ref_model is not None else model)
        self.tokenizer_ = tokenizer
        self.router_aux_loss_coef, self.aux_loss_enabled = router_aux_loss(model, args.router_aux_loss_coef)
        self._data_stats: dict[str, float] = {}
        train_dataset = self._prepare_dataset(train_dataset, tokenizer, args, "train")
        eval_dataset = self._prepare_eval_dataset(eval_dataset, tokenizer, args)
        collator = (VisionPreferenceCollator(self._processor, tokenizer.pad_token_id, args.pad_to_multiple_of)
                    if self._processor is not None else
                    PreferenceCollator(tokenizer.pad_token_id, args.padding_free, args.pad_to_multiple_of))
        super().__init__(model=model, args=args, data_collator=data_collator or collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        if self.ref_model is not None and not loaded_sharded(self.ref_model):
            self.ref_model.to(self.accelerator.device)
        self._init_engines(builder)
        self.reference = builder.reference(self.ref_model)
        self.model_accepts_loss_kwargs = False
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        if args.precompute_ref_log_probs:
            self.train_dataset = self._with_reference_logps(self.train_dataset, "train")
            if self.eval_dataset is not None:
                self.eval_dataset = self._with_reference_logps(self.eval_dataset, "eval")
        if args.sync_ref_model:
            if self.ref_model is None:
                raise ValueError("sync_ref_model needs a reference model object; it cannot mix into disabled adapters.")
            self.add_callback(ReferenceMixCallback(self))

    # ------------------------------------------------------------------ data
    def _collate(self, rows: list[dict]) -> dict:
        """The default collator (also when a custom `data_collator` is given: the reference pass uses this one)."""
        if self._processor is not None:
            return VisionPreferenceCollator(self._processor, self.tokenizer_.pad_token_id,
                                            self.args.pad_to_multiple_of)(rows)
        return PreferenceCollator(self.tokenizer_.pad_token_id, self.args.padding_free,
                                  self.args.pad_to_multiple_of)(rows)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`Trainer.evaluate`, also for a raw dataset (tokenised here, reference log-probs precomputed when
        `precompute_ref_log_probs`) and for a dict / `DatasetDict` of them (metrics `eval_<name>_*`)."""
        if eval_dataset is None or isinstance(eval_dataset, str):  # the init-time eval set, already prepared
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        if self.args.precompute_ref_log_probs and self.reference is None and not self.is_peft \
                and self.state.global_step > 0:
            raise ValueError(
                "Cannot compute reference log-probs for a dataset passed to `evaluate()` after training has started: "
                "with precompute_ref_log_probs=True and no ref_model (full fine-tuning) the reference is the policy "
                "before its first step, which no longer exists. Give this dataset as `eval_dataset` at "
                "initialisation, pass an explicit `ref_model`, or set precompute_ref_log_probs=False.")
        eval_dataset = self._prepare_eval_dataset(eval_dataset, self.tokenizer_, self.args)
        if self.args.precompute_ref_log_probs:
            eval_dataset = self._with_reference_logps(eval_dataset, "eval")
        if isinstance(eval_dataset, dict):
            metrics = {}
            for name, dataset in eval_dataset.items():
                metrics.update(super().evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------ log-probs
    def get_train_dataloader(self):
        return self._over_data_parallel_ranks(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._over_data_parallel_ranks(super().get_eval_dataloader(eval_dataset))

    def _sequence_logps(self, engine: TrainingEngine, batch: dict, with_aux_loss: bool = False,
                        with_wpo: bool = False):
        """Summed completion log-probs (LD-DPO-weighted with `ld_alpha`), mean completion logits and token counts
        per sequence `(2B,)`; with `with_aux_loss` also the router load-balancing loss of the forward, with
        `with_wpo` also the WPO pair weights `(B,)` (appended in that order)."""
        if VISION_INPUTS in batch:  # pairs with images: padded, with their pixel inputs
            return vision_sequence_logps(self, engine, batch, with_aux_loss=with_aux_loss, with_wpo=with_wpo)
        if engine.dims.sp > 1:
            return self._sequence_parallel_logps(engine, batch)
        query = self._pair_query(engine, batch, with_aux_loss=with_aux_loss, with_wpo=with_wpo)
        if query is None:  # chosen and rejected share their prompt's forward
            layout = self._pair_layout(engine, batch, with_aux_loss)
            stats = engine.shared_token_logprobs(layout, temperature=1.0, chunk_size=self.args.logprob_chunk_size,
                                                 with_mean_logit=True, with_log_sum_sq=with_wpo)
            return self._pair_reduce(stats, batch, with_aux_loss=with_aux_loss, with_wpo=with_wpo,
                                     owner=layout.row_of)
        stats = engine.token_logprobs(query.input_ids, query.targets, query.select, **query.kwargs())
        return self._pair_reduce(stats, batch, with_aux_loss=with_aux_loss, with_wpo=with_wpo)

    @staticmethod
    def _pair_select(batch: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`(select, seq_of, n)`: the positions scored (each predicting a completion token of its own sequence),
        the sequence of each position, and the number of sequences."""
        ids = batch["input_ids"]
        select = torch.zeros_like(ids, dtype=torch.bool)
        select[:, :-1] = batch["completion_mask"][:, 1:].bool()
        if "seq_index" in batch:  # packed: a position predicting the next sequence's first token is not ours
            index = batch["seq_index"]
            select[:, :-1] &= index[:, 1:] == index[:, :-1]
            return select, index, batch["num_sequences"]
        n = ids.shape[0]
        return select, torch.arange(n, device=ids.device).unsqueeze(1).expand_as(ids), n

    def _pair_query(self, engine: TrainingEngine, batch: dict, *, with_aux_loss: bool = False,
                    with_wpo: bool = False) -> TokenQuery | None:
        """The padded (or packed) batch's one `token_logprobs` call; None when the engine's shared-prompt layout
        scores it instead."""
        packed = "position_ids" in batch  # padding-free: positions restart per sequence, no attention mask
        if not packed and self._pair_layout(engine, batch, with_aux_loss) is not None:
            return None
        ids = batch["input_ids"]
        select, _, _ = self._pair_select(batch)
        targets = torch.zeros_like(ids)
        targets[:, :-1] = ids[:, 1:]
        # only completion positions go through the LM head (prompt and padding are never scored)
        return TokenQuery(ids, targets, select, attention_mask=None if packed else batch["attention_mask"],
                          position_ids=batch["position_ids"] if packed else None, temperature=1.0,
                          chunk_size=self.args.logprob_chunk_size, with_mean_logit=True, with_aux_loss=with_aux_loss,
                          with_log_sum_sq=with_wpo)

    def _pair_reduce(self, stats: Any, batch: dict, *, with_aux_loss: bool = False, with_wpo: bool = False,
                     owner: torch.Tensor | None = None) -> tuple:
        """Per-sequence sums of the scored positions' statistics (see :meth:`_sequence_logps`); `owner`: the
        sequence of each scored position (by default that of the padded / packed query)."""
        select, seq_of, n = self._pair_select(batch)
        if owner is None:
            owner = seq_of[select]

        def segsum(x):
            return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, owner, x)

        token_logps = stats.logp
        if self.args.ld_alpha is not None:
            token_logps = token_logps * ld_token_weights(owner, n, self.args.ld_alpha).to(token_logps.dtype)
        logps = segsum(token_logps)
        counts = segsum(torch.ones_like(stats.logp))
        logits = segsum(stats.mean_logit.float()) / counts.float().clamp(min=1)
        out = [logps, logits, counts]
        if with_aux_loss:
            out.append(stats.aux_loss)
        if with_wpo:
            out.append(wpo_weights(stats.logp, stats.log_sum_sq, owner, n))
        return tuple(out)

    @staticmethod
    def _pair_layout(engine: TrainingEngine, batch: dict, with_aux_loss: bool):
        """The engine's shared-prompt layout of a padded pair batch (`None`: score it padded). A row is scored from
        its second completion token on in the padded path when its prompt is empty, which the layout does not
        reproduce: `share_prefixes` declines empty prompts."""
        if engine.shared_prefix is False or engine.dims.sp > 1 or with_aux_loss:
            return None
        prompts, completions = _split_rows(batch)
        ids = batch["input_ids"]
        return engine.shared_layout(prompts, completions, rows=ids.shape[0], width=ids.shape[1])

    def _sequence_parallel_logps(self, engine: TrainingEngine, batch: dict):
        """:meth:`_sequence_logps` with the sequences split over the sequence-parallel group: each padded row
        becomes (prompt, completion) token lists, packed padding-free by the engine."""
        prompts, completions = _split_rows(batch)
        logp, mean_logit = engine.rows_logprobs(prompts, completions, chunk_size=self.args.logprob_chunk_size,
                                                with_mean_logit=True)
        lengths = torch.tensor([len(c) for c in completions], device=logp.device)
        mask = torch.arange(logp.shape[1], device=logp.device) < lengths[:, None]
        n = len(completions)
        if self.args.ld_alpha is not None:
            owner = torch.arange(n, device=logp.device).unsqueeze(1).expand_as(mask)[mask]
            weights = torch.zeros_like(logp)
            weights[mask] = ld_token_weights(owner, n, self.args.ld_alpha).to(logp.dtype)
            logp = logp * weights
        counts = mask.sum(1).to(logp.dtype)
        return logp.sum(1), mean_logit.float().sum(1) / counts.clamp(min=1), counts

    @torch.no_grad()
    def _reference_logps(self, batch: dict) -> torch.Tensor:
        if self.reference is not None:  # through the engine's infer: a pipelined engine schedules the request
            return self.reference.infer(batch, self._forward_request().without_extras(), micro_batch=None)[0]
        if self._ref_adapter is not None:  # the adapter the model came with, frozen
            with _active_adapter(self.model, self._ref_adapter):
                return self._sequence_logps(self.actor, batch)[0]
        if self.is_peft:  # the base model: adapters disabled
            with self.actor.adapters_disabled():
                return self._sequence_logps(self.actor, batch)[0]
        # precompute_ref_log_probs without a reference model: the policy is the reference until its first step
        if self.state.global_step > 0:
            raise ValueError("no reference model left to score this batch: with precompute_ref_log_probs=True and no "
                             "ref_model, reference log-probs exist only for the datasets precomputed before training.")
        return self.actor.infer(batch, self._forward_request().without_extras(), micro_batch=None)[0]

    def _with_reference_logps(self, dataset, name: str):
        """Add `ref_chosen_logps` / `ref_rejected_logps` columns (to each split of a dict), from the on-disk cache
        when present."""
        if isinstance(dataset, dict):
            return {split: self._with_reference_logps(ds, split) for split, ds in dataset.items()}
        from safetensors.torch import load_file, save_file
        from tqdm.auto import tqdm

        key = hashlib.sha256("|".join(map(str, [
            getattr(dataset, "_fingerprint", None), self._ref_digest, self.ref_model is None,
            self.args.max_length, self.args.truncation_mode, self.args.ld_alpha])).encode()).hexdigest()[:24]
        cache_dir = os.path.join(os.environ.get("HF_VERL_CACHE", os.path.expanduser("~/.cache/hf_verl")), "ref_logps")
        path = os.path.join(cache_dir, f"{key}.safetensors")
        if os.path.exists(path):
            logger.info("reference log-probs of the %s dataset loaded from %s", name, path)
            cached = load_file(path)
            chosen, rejected = cached["chosen"], cached["rejected"]
        else:
            size = self.args.precompute_ref_batch_size or self.args.per_device_eval_batch_size
            chosen, rejected = [], []
            for start in tqdm(range(0, len(dataset), size), desc=f"Reference log-probs ({name})",
                              disable=not self.is_local_process_zero()):
                batch = self._collate(list(dataset.select(range(start, min(start + size, len(dataset))))))
                batch = {k: v.to(self.accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                logps = self._reference_logps(batch).float().cpu()
                c, r = logps.chunk(2)
                chosen.append(c)
                rejected.append(r)
            chosen, rejected = torch.cat(chosen), torch.cat(rejected)
            if self.is_world_process_zero():
                os.makedirs(cache_dir, exist_ok=True)
                save_file({"chosen": chosen.contiguous(), "rejected": rejected.contiguous()}, path)
        dataset = dataset.remove_columns([c for c in REF_COLUMNS if c in dataset.column_names])
        dataset = dataset.add_column(REF_COLUMNS[0], chosen.tolist())
        return dataset.add_column(REF_COLUMNS[1], rejected.tolist())

    # ------------------------------------------------------------------ loss
    def _with_reference(self, inputs: dict) -> dict:
        """`inputs` with the reference's summed log-probs of chosen and rejected (`ref_chosen_logps`,
        `ref_rejected_logps`), computed now unless precomputed columns came with the batch: a step's loss
        function reads them, it runs no other model."""
        if REF_COLUMNS[0] not in inputs:
            inputs[REF_COLUMNS[0]], inputs[REF_COLUMNS[1]] = self._reference_logps(inputs).chunk(2)
        return inputs

    def _forward_request(self) -> PairLogProbs:
        return PairLogProbs(self._sequence_logps, with_aux_loss=self.aux_loss_enabled,
                            with_wpo=self.args.use_weighting, query=self._pair_query, reduce=self._pair_reduce)

    def _dpo_loss(self, out: tuple, inputs: dict) -> tuple[torch.Tensor, dict[str, Any]]:
        """`(loss, metrics)` of one pair micro-batch from the actor's forward `out` (see :meth:`_sequence_logps`);
        the implicit rewards ride in the metrics as `_chosen_rewards` / `_rejected_rewards` tensors for
        prediction."""
        args = self.args
        logps, logits, counts, *extra = out
        aux = extra[:1] if self.aux_loss_enabled else []
        pair_weights = extra[-1] if args.use_weighting else None
        ref_c, ref_r = inputs[REF_COLUMNS[0]].to(logps.dtype), inputs[REF_COLUMNS[1]].to(logps.dtype)
        c, r = logps.chunk(2)
        n_c, n_r = counts.chunk(2)
        chosen_nll = -c.sum() / n_c.sum().clamp(min=1)
        loss, parts = combined_dpo_loss(
            args.loss_type, args.loss_weights, c, r, ref_c, ref_r, beta=args.beta,
            label_smoothing=args.label_smoothing, f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef, discopop_tau=args.discopop_tau,
            chosen_nll=chosen_nll, chosen_lengths=n_c, rejected_lengths=n_r, pair_weights=pair_weights,
        )
        rc, rr = implicit_rewards(c, r, ref_c, ref_r, beta=args.beta)
        m: dict[str, Any] = {}
        if aux:  # a Mixture of Experts: TRL adds the weighted router loss to the preference loss
            loss = loss + self.router_aux_loss_coef * aux[0]
            m["aux_loss"] = aux[0].detach()
        m.update(reward_metrics(rc, rr))
        lc, lr = logits.chunk(2)
        m["logps/chosen"] = c.detach().mean()
        m["logps/rejected"] = r.detach().mean()
        m["logits/chosen"] = lc.detach().mean()
        m["logits/rejected"] = lr.detach().mean()
        if len(parts) > 1:
            for name, value in parts.items():
                m[f"loss/{name}"] = float(value)
        return loss, m, (rc.detach(), rr.detach())

    def _take_metrics(self, mode: str, metrics: dict[str, Any]) -> None:
        for name, value in metrics.items():
            self._metrics[mode][name].append(float(value))

    def compute_loss(self, model, inputs: dict, return_outputs=False, num_items_in_batch=None):
        """The DPO loss of one micro-batch (its metrics logged under the actor's mode), without a backward."""
        mode = "train" if self.actor.training else "eval"
        inputs = self._with_reference(inputs)
        out = self._forward_request().run(self.actor, inputs)
        loss, metrics, (rc, rr) = self._dpo_loss(out, inputs)
        self._take_metrics(mode, metrics)
        if return_outputs:
            return loss, {"chosen_rewards": rc, "rejected_rewards": rr}
        return loss

    def _train_window(self, window: list) -> list[torch.Tensor]:
        """One optimizer step: the reference's log-probs of every micro-batch first, then the actor's whole window
        through its engine (DDP, FSDP2 or ZeRO)."""
        self.actor.train()
        batches = [self._with_reference(self._prepare_inputs(inputs)) for inputs in window]
        offload = torch.autograd.graph.save_on_cpu(pin_memory=True) if self.args.activation_offloading else \
            contextlib.nullcontext()
        with self.compute_loss_context_manager(), offload:
            result = self.actor.forward_backward(
                batches, lambda out, inputs: self._dpo_loss(out, inputs)[:2], forward=self._forward_request(),
                loss_scale=1.0 / self.current_gradient_accumulation_steps)
        for metrics in result.metrics:
            self._take_metrics("train", metrics)
        return self._window_losses_of(result)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, out = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return loss.detach(), None, None
        preds = torch.stack([out["chosen_rewards"], out["rejected_rewards"]], dim=1)
        return loss.detach(), preds, torch.zeros(preds.shape[0], dtype=torch.long, device=preds.device)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        metrics = self._metrics[mode]
        keys = sorted(k for k, v in metrics.items() if v)
        values = torch.tensor([sum(metrics[k]) / len(metrics[k]) for k in keys], dtype=torch.float64)
        if keys:
            values = comm.reduce(self.dims, values, "mean")
        prefix = "eval_" if mode == "eval" else ""
        logs.update({prefix + k: v for k, v in zip(keys, values.tolist())})
        if mode == "train" and self._data_stats:
            logs.update(self._data_stats)
            self._data_stats = {}
        metrics.clear()
        super().log(logs, start_time)
