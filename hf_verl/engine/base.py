"""`TrainingEngine`: what every model role (actor, critic, reference, reward model) offers the RL code.

The trainers and the facade never touch a model directly. They ask its engine for token
log-probs / entropy / values of a batch, run `backward` and `step` on it, stream its full
HF-named weights to a rollout engine, save and load it, and switch it between train and eval.
How the model is laid out (one device, DDP replicas, FSDP2 shards, ZeRO partitions, or, later,
Megatron-Core tensor and pipeline ranks) is the engine's business alone: it gathers inside when a
result needs whole rows, and a Megatron engine implements the same methods over its own model.

Two forward primitives carry everything:

- :meth:`TrainingEngine.token_logprobs`: log-probs (and entropy, mean logit) of chosen next tokens
  at selected positions of a batch of sequences, padded or packed; RL rollouts and DPO pairs are
  both expressed as (input ids, positions, targets);
- :meth:`TrainingEngine.token_values`: a value head's output at selected positions (the critic).

:meth:`TrainingEngine.logprobs` and :meth:`TrainingEngine.values` express a
:class:`~hf_verl.data.batch.RolloutBatch` (left-padded prompt, right-padded completion) in those
terms and return `(B, C)` tensors aligned with `completion_ids`, zero on padding. They pack the rows
padding-free (:mod:`hf_verl.data.packing`, per-row causal attention) under sequence parallelism, and
on one sequence-parallel rank when :attr:`TrainingEngine.padding_free` says so: `None` (the default)
packs a rollout when :func:`packing_pays`, and the two paths agree to float rounding. Rows that continue
the same prompt (a GRPO group, a DPO pair) can instead be scored with the prompt laid out once
(:mod:`hf_verl.data.prefix_sharing`) when :attr:`TrainingEngine.shared_prefix` says so: `None` (the default)
does it when the layout's arithmetic (:func:`~hf_verl.data.prefix_sharing.sharing_cost`) is at most
:data:`SHARE_MAX_COST_RATIO` of the layout it replaces; it too agrees with the padded path to float rounding.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.data.prefix_sharing import (
    MAX_MASK_ELEMENTS,
    SharedPrefixBatch,
    packed_cost,
    padded_cost,
    share_prefixes,
    sharing_cost,
)
from hf_verl.engine.step import (
    ForwardRequest,
    LossFn,
    OptimizerSpec,
    PolicyOutput,
    SchedulerSpec,
    StepResult,
)
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims

# Packing saves the padded positions' work and costs one attention call per row and layer. Measured on the
# CPU (benchmarks/packing.py), that call costs about as much as PACK_ROW_COST / hidden_size tokens do.
PACK_ROW_COST = 2560
PACK_MIN_PADDING_PER_ROW = 8
# The shared-prompt layout is used (shared_prefix=None) when its arithmetic is at most this share of the layout it
# replaces. The estimate leaves out the per-row and padding costs the layout also saves: on every shape of
# benchmarks/prefix_sharing.py the layout was faster than the better of padded and packed, also where the estimate
# was 0.92 (x1.19) and 1.01 (x1.04).
SHARE_MAX_COST_RATIO = 1.0


def packing_pays(attention_mask: torch.Tensor, hidden_size: int) -> bool:
    """Whether packing a padded batch (`attention_mask` `(B, W)`) should beat running it padded: when its rows
    carry, on average, more padding than a per-row attention call costs in tokens of a `hidden_size` model."""
    rows = attention_mask.shape[0]
    if rows == 0:
        return False
    padding_per_row = (attention_mask.numel() - float(attention_mask.sum())) / rows
    return padding_per_row >= max(PACK_MIN_PADDING_PER_ROW, PACK_ROW_COST / max(hidden_size, 1))


@dataclass
class TokenStats:
    """Per-position results of :meth:`TrainingEngine.token_logprobs`, one entry per selected position
    (row-major order of the selection mask)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    mean_logit: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None  # a Mixture of Experts' router load-balancing loss, when asked
    log_sum_sq: torch.Tensor | None = None  # log sum_v p_v^2 per position (no gradient), when asked


def rollout_positions(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask, select, targets)` of a rollout batch: the position before each
    completion token of `completion_mask` is selected, and its target is that token. The attention
    mask (and so the positions) is `batch.attention_mask`, which covers tokens attended but not
    selected (a multi-turn rollout's tool observations, `completion_attention_mask`)."""
    input_ids, mask = batch.input_ids, batch.attention_mask
    P, C = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    select = torch.zeros_like(mask, dtype=torch.bool)
    targets = torch.zeros_like(input_ids)
    select[:, P - 1 : P + C - 1] = batch.completion_mask.bool()
    targets[:, P - 1 : P + C - 1] = batch.completion_ids
    return input_ids, mask, select, targets


def select_positions(hidden: torch.Tensor, targets: torch.Tensor | None,
                     select: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(hidden[select], targets[select])` for a boolean `(B, T)` mask; for a `(N,)` index of flat positions into
    `B * T` (a shared-prompt layout, where one position can predict several tokens), the hidden states at those
    positions in that order, and `targets` as given (already one per entry)."""
    if select.dtype == torch.bool:
        return hidden[select], None if targets is None else targets[select]
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, select), targets


def scatter_completion(batch: RolloutBatch, flat: torch.Tensor) -> torch.Tensor:
    """`(B, C)` tensor with `flat` (one value per real completion token, row-major) in place, 0 elsewhere."""
    out = flat.new_zeros(batch.completion_mask.shape)
    out[batch.completion_mask.bool()] = flat
    return out


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding does not shift them)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class TrainingEngine(abc.ABC):
    """One model role on one parallel layout (see the module docstring).

    Attributes:
        role (`str`): "actor", "critic", "reference" or "reward".
        dims ([`ParallelDims`]): the layout; the only source of ranks and groups.
        backend ([`BackendSpec`]): plain, DDP, FSDP2 or DeepSpeed ZeRO.
        trainable (`bool`): whether the engine runs backward / optimizer steps.
        padding_free (`bool`, *optional*): pack rollouts padding-free in :meth:`logprobs` / :meth:`values`
            (always under sequence parallelism); `None` decides per batch from its padding share.
        shared_prefix (`bool`, *optional*): score the rows of one prompt with the prompt laid out once
            (:meth:`logprobs`, :meth:`shared_layout`; one sequence-parallel rank only); `None` decides per batch
            from its arithmetic, `True` whenever two rows share a prompt, `False` never.
    """

    role: str
    dims: ParallelDims
    backend: BackendSpec
    trainable: bool
    padding_free: bool | None = None
    shared_prefix: bool | None = None

    # ------------------------------------------------------------------ models
    @property
    @abc.abstractmethod
    def model(self) -> torch.nn.Module:
        """The model as the user knows it (a `PreTrainedModel` or `PeftModel`), without wrappers."""

    @property
    @abc.abstractmethod
    def module(self) -> torch.nn.Module:
        """The module forward passes run through (a DDP / DeepSpeed wrapper, an FSDP2 root, or the model)."""

    @property
    def device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's (first) parameters."""
        for p in self.model.parameters():
            return p.dtype
        return torch.float32

    @property
    def holds_full_weights(self) -> bool:
        """Whether every rank holds every parameter whole between forwards (not FSDP2 / ZeRO-3), so that
        another model, such as a rollout engine, may share the parameter tensors."""
        return not self.backend.partitions_parameters

    # ------------------------------------------------------------------ forward primitives
    @abc.abstractmethod
    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, select: torch.Tensor, *,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                       temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                       with_mean_logit: bool = False, with_aux_loss: bool = False,
                       with_log_sum_sq: bool = False) -> TokenStats:
        """Log-probs of `targets[select]` given the prefix up to each selected position (and the router
        load-balancing loss of a Mixture-of-Experts model with `with_aux_loss`).

        Args:
            input_ids (`torch.Tensor` `(B, T)`): token ids (padded rows, or one packed row).
            targets (`torch.Tensor` `(B, T)`): at each selected position, the next token to score.
            select (`torch.Tensor` `(B, T)` bool): the positions to score; or `(N,)` long, flat positions into
                `B * T` in the order of the result, with `targets` `(N,)` (see :func:`select_positions`).
            attention_mask / position_ids: as the model takes them (packed rows: position ids only).
            temperature (`float`): logits are divided by it. chunk_size (`int`): positions per LM-head chunk.
            with_entropy / with_mean_logit (`bool`): also return those per position.
        """

    @abc.abstractmethod
    def token_values(self, input_ids: torch.Tensor, select: torch.Tensor, *,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The value head at `select` positions `(N,)` (a critic: sequence-classification model, one label)."""

    def logprobs(self, batch: RolloutBatch, *, temperature: float = 1.0, chunk_size: int = 1024,
                 with_entropy: bool = False, with_aux_loss: bool = False):
        """`(B, C)` log-probs of a rollout's completion tokens (and entropy if asked), 0 on padding.

        Returns:
            `(logp, entropy)`; with `with_aux_loss`, `(logp, entropy, aux_loss)` where `aux_loss` is the
            model's router load-balancing loss of this forward (a Mixture-of-Experts model).
        """
        if self.dims.sp > 1 and with_aux_loss:
            raise ValueError("a Mixture-of-Experts router aux loss (router_aux_loss_coef > 0) is not supported "
                             "with sequence_parallel_size > 1: set router_aux_loss_coef=0 or "
                             "sequence_parallel_size=1.")
        packs = self._packs(batch, with_aux_loss)
        if self.dims.sp == 1 and (layout := self._rollout_layout(batch, packs, with_aux_loss)) is not None:
            stats = self.shared_token_logprobs(layout, temperature=temperature if temperature > 0 else 1.0,
                                               chunk_size=chunk_size, with_entropy=with_entropy)
            entropy = scatter_completion(batch, stats.entropy) if with_entropy else None
            return scatter_completion(batch, stats.logp), entropy
        if packs:
            return self._packed_logprobs(batch, temperature, chunk_size, with_entropy)
        input_ids, mask, select, targets = rollout_positions(batch)
        stats = self.token_logprobs(input_ids, targets, select, attention_mask=mask,
                                    position_ids=position_ids_from_mask(mask),
                                    temperature=temperature if temperature > 0 else 1.0, chunk_size=chunk_size,
                                    with_entropy=with_entropy, with_aux_loss=with_aux_loss)
        entropy = scatter_completion(batch, stats.entropy) if with_entropy else None
        logp = scatter_completion(batch, stats.logp)
        return (logp, entropy, stats.aux_loss) if with_aux_loss else (logp, entropy)

    def sampling_statistics(self, batch: RolloutBatch, *, temperature: float = 1.0,
                            chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, C)` log-probs of a rollout's completion tokens and `sum_v pi_v^2` at each of them (no gradient;
        0 on padding)."""
        if self.dims.sp > 1:
            raise ValueError("the optimal-token-baseline estimators need per-token sampling statistics, which the "
                             "sequence-parallel path does not compute yet: choose another advantage_estimator or "
                             "sequence_parallel_size=1.")
        input_ids, mask, select, targets = rollout_positions(batch)
        stats = self.token_logprobs(input_ids, targets, select, attention_mask=mask,
                                    position_ids=position_ids_from_mask(mask),
                                    temperature=temperature if temperature > 0 else 1.0, chunk_size=chunk_size,
                                    with_log_sum_sq=True)
        return scatter_completion(batch, stats.logp), scatter_completion(batch, stats.log_sum_sq.exp())

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """`(B, C)` critic values of the states before each completion token, 0 on padding."""
        if self._packs(batch):
            from hf_verl.data.packing import pack_rollout
            from hf_verl.parallel.ulysses import packed_values, use_segment_attention

            use_segment_attention(self.model)
            packed = pack_rollout(batch, multiple_of=self.dims.sp, pad_token_id=self._pad_token_id())
            with self.autocast():
                return packed_values(self.module, self._value_head(), packed, self.dims).float()
        input_ids, mask, select, _ = rollout_positions(batch)
        flat = self.token_values(input_ids, select, attention_mask=mask, position_ids=position_ids_from_mask(mask))
        return scatter_completion(batch, flat.float())

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context of this engine's forwards (none by default)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ padding-free packing, sequence parallelism
    def _packs(self, batch: RolloutBatch, with_aux_loss: bool = False) -> bool:
        """Whether :meth:`logprobs` / :meth:`values` run `batch` packed (see the module docstring)."""
        if self.dims.sp > 1:
            return True
        if self.padding_free is False or with_aux_loss:
            return False
        if not self._model_takes_layout(self.padding_free, "padding_free", f"pack the {self.role}'s rows"):
            return False
        if self.padding_free:
            return True
        config = getattr(self.model, "config", None)
        return packing_pays(batch.attention_mask, getattr(config, "hidden_size", None) or 1024)

    def _model_takes_layout(self, switch: bool | None, option: str, action: str) -> bool:
        """Whether the model can run a padding-free or shared-prompt layout (sdpa attention, no sliding window);
        when it cannot and `switch` is True (the user asked for the layout), a ValueError naming `option`."""
        from hf_verl.parallel.ulysses import packing_unsupported

        reason = packing_unsupported(self.model)
        if reason is not None and switch:
            raise ValueError(f"{option}=True cannot {action}: {reason}. Set {option}=None "
                             "(where possible) or False.")
        return reason is None

    # ------------------------------------------------------------------ shared prompts
    def shared_layout(self, prompts: list[list[int]], completions: list[list[int]], *, rows: int, width: int,
                      packed: bool = False, with_aux_loss: bool = False) -> SharedPrefixBatch | None:
        """The shared-prompt layout of `prompts[i] + completions[i]` (every completion token scored) when this
        engine should use it instead of the current layout: `rows x width` padded, or those rows packed
        (`packed`). `None`: run the current layout (no two rows share a prompt, `shared_prefix` is False or
        the arithmetic says no, sequence parallelism, a router aux loss, or a model the layout does not suit).

        Raises:
            ValueError: `shared_prefix=True` on a model that does not attend with sdpa or has sliding-window layers.
        """
        if self.dims.sp > 1 or self.shared_prefix is False or with_aux_loss:
            return None
        if not self._model_takes_layout(self.shared_prefix, "shared_prefix",
                                        f"lay out the {self.role}'s rows by prompt"):
            return None
        layout = share_prefixes(prompts, completions, pad_token_id=self._pad_token_id())
        if layout is None:
            return None
        if not self.shared_prefix:
            model = self._cost_model()
            current = (packed_cost([len(p) + len(c) for p, c in zip(prompts, completions)], **model) if packed
                       else padded_cost(rows, width, **model))
            if (layout.attention_mask.numel() > MAX_MASK_ELEMENTS
                    or sharing_cost(layout, **model) > SHARE_MAX_COST_RATIO * current):
                return None
        return layout.to(self.device)

    def shared_token_logprobs(self, layout: SharedPrefixBatch, **kwargs) -> TokenStats:
        """:meth:`token_logprobs` over a :meth:`shared_layout`: one entry per scored token, in the input rows' order
        (`layout.row_of` names each entry's row); `kwargs` as :meth:`token_logprobs` takes them."""
        return self.token_logprobs(layout.input_ids, layout.targets, layout.index,
                                   attention_mask=layout.attention_mask, position_ids=layout.position_ids, **kwargs)

    def _rollout_layout(self, batch: RolloutBatch, packs: bool, with_aux_loss: bool) -> SharedPrefixBatch | None:
        """:meth:`shared_layout` of a rollout batch whose completions are plain (no tool observations) and
        scored from their first token on."""
        if self.shared_prefix is False or with_aux_loss or batch.completion_attention_mask is not None:
            return None
        mask = batch.completion_mask.bool()
        lengths = mask.sum(-1)
        if not bool((mask.cumprod(-1).sum(-1) == lengths).all()):  # a scored token after an unscored one
            return None
        prompts = [row[m].tolist() for row, m in zip(batch.prompt_ids, batch.prompt_mask.bool())]
        if len(set(map(tuple, prompts))) == len(prompts):  # nothing shared: skip the layout work
            return None
        completions = [row[:n].tolist() for row, n in zip(batch.completion_ids, lengths.tolist())]
        return self.shared_layout(prompts, completions, rows=batch.input_ids.shape[0],
                                  width=batch.input_ids.shape[1], packed=packs)

    def _cost_model(self) -> dict[str, float]:
        config = getattr(self.model, "config", None)
        hidden = getattr(config, "hidden_size", None) or 1024
        heads = getattr(config, "num_attention_heads", None) or 1
        kv = getattr(config, "num_key_value_heads", None) or heads
        return {"hidden_size": hidden, "intermediate_size": getattr(config, "intermediate_size", None) or 4 * hidden,
                "kv_fraction": kv / heads}

    def _packed_logprobs(self, batch: RolloutBatch, temperature: float, chunk_size: int, with_entropy: bool):
        """:meth:`logprobs` over a padding-free packed batch, its sequence split over the `sp` ranks
        (:mod:`hf_verl.parallel.ulysses`); every rank of the group gets the whole `(B, C)` result."""
        from hf_verl.data.packing import pack_rollout
        from hf_verl.parallel.ulysses import packed_logprobs, use_segment_attention

        use_segment_attention(self.model)  # per-row causal attention (sequence parallelism has set it already)
        packed = pack_rollout(batch, multiple_of=self.dims.sp, pad_token_id=self._pad_token_id())
        with self.autocast():
            return packed_logprobs(self.module, self.model.get_output_embeddings(), packed, self.dims,
                                   temperature=temperature if temperature > 0 else 1.0, chunk_size=chunk_size,
                                   with_entropy=with_entropy)

    def rows_logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], *,
                      temperature: float = 1.0, chunk_size: int = 1024, with_mean_logit: bool = False):
        """`(N, C)` log-probs of each row's completion tokens given its prompt (and mean logits with
        `with_mean_logit`), 0 on padding, through the padding-free packed path: split over the sequence-parallel
        group when `dims.sp > 1` (DPO's pairs), one packed sequence otherwise."""
        from hf_verl.data.packing import pack_rows
        from hf_verl.parallel.ulysses import packed_logprobs, use_segment_attention

        use_segment_attention(self.model)  # per-row causal attention: no T x T mask, no cross-row FLOPs
        packed = pack_rows(prompt_ids, completion_ids, multiple_of=self.dims.sp, pad_token_id=self._pad_token_id())
        with self.autocast():
            logp, _, *rest = packed_logprobs(self.module, self.model.get_output_embeddings(), packed, self.dims,
                                             temperature=temperature if temperature > 0 else 1.0,
                                             chunk_size=chunk_size, with_mean_logit=with_mean_logit)
        return (logp, rest[0]) if with_mean_logit else logp

    def _pad_token_id(self) -> int:
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        return 0 if pad is None else int(pad)

    def _value_head(self) -> torch.nn.Module:
        """The critic's one-output value head module (a sequence-classification model's `score`)."""
        raise NotImplementedError(f"{type(self).__name__} names no value head for sequence parallelism.")

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[TrainingEngine]:
        """This engine with its PEFT adapters switched off (the reference policy of a LoRA actor)."""
        disable = getattr(self.model, "disable_adapter", None)
        if disable is None:
            raise ValueError(f"the {self.role} model has no PEFT adapters to disable; give a reference model.")
        with disable():
            yield self

    # ------------------------------------------------------------------ the step
    def forward_backward(self, micro_batches: Sequence[Any], loss_fn: LossFn, *, forward: ForwardRequest,
                         forward_only: bool = False, loss_scale: float = 1.0,
                         keep_outputs: bool = False) -> StepResult:
        """Run the forward (and, unless `forward_only`, the backward) of every micro-batch of one optimizer step.

        Gradients accumulate over the micro-batches and are reduced across data-parallel ranks once, with the last
        micro-batch's backward (DDP's `no_sync`, FSDP2's deferred reduce-scatter, ZeRO's accumulation boundary);
        the caller then calls :meth:`optimizer_step`. The engine keeps its train / eval mode as it is.

        Args:
            micro_batches (`Sequence`): the step's micro-batches (a [`RolloutBatch`] or whatever `forward` takes).
            loss_fn (`Callable`): `loss_fn(forward_output, micro_batch) -> (loss, metrics)`; runs no collective.
            forward ([`ForwardRequest`]): what each micro-batch's forward computes ([`LogProbs`], [`Values`], ...).
            forward_only (`bool`): no graph and no backward (evaluation, thresholds computed before a step).
            loss_scale (`float`): each loss is multiplied by it before its backward (e.g. 1 / accumulation steps);
                the returned losses are unscaled.
            keep_outputs (`bool`): also return each micro-batch's forward output, detached.

        Returns:
            [`StepResult`]: per micro-batch, the loss (detached) and the metrics.
        """
        if not forward_only and not self.trainable:
            raise ValueError(f"the {self.role} engine is frozen; it runs no backward.")
        result = StepResult()
        last = len(micro_batches) - 1
        for i, micro_batch in enumerate(micro_batches):
            sync = contextlib.nullcontext() if forward_only or i == last else self.no_sync()
            grad = torch.no_grad() if forward_only else contextlib.nullcontext()
            with sync, grad:
                output = forward.run(self, micro_batch)
                loss, metrics = loss_fn(output, micro_batch)
                if not forward_only:
                    self._backward(loss * loss_scale)
            result.losses.append(loss.detach())
            result.metrics.append({k: float(v) for k, v in metrics.items()})
            if keep_outputs:
                result.outputs.append(_detached(output))
        return result

    @torch.no_grad()
    def infer(self, batch: Any, forward: ForwardRequest, *, micro_batch: int | None = None) -> Any:
        """`forward` over `batch` without gradients, in eval mode, `micro_batch` rows at a time (the reference's
        and the old policy's log-probs, a critic's values); tensor outputs are concatenated over the rows and a
        :class:`PolicyOutput` field by field. The engine's train / eval mode is restored afterwards."""
        was_training = self.training
        self.train(False)
        try:
            if micro_batch is None:  # one forward over the whole batch (any type the request takes)
                parts = [forward.run(self, batch)]
            else:
                size = max(1, micro_batch)
                parts = [forward.run(self, batch.select(slice(i, i + size))) for i in range(0, batch.batch_size, size)]
        finally:
            self.train(was_training)
        return _concat(parts)

    @property
    @abc.abstractmethod
    def training(self) -> bool:
        """Whether the engine is in train mode (dropout on)."""

    @abc.abstractmethod
    def train(self, mode: bool = True) -> None: ...

    def eval(self) -> None:
        self.train(False)

    @abc.abstractmethod
    def _backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's (already scaled) loss; called by :meth:`forward_backward` only."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context in which a forward and backward accumulate local gradients without reducing them."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ the optimizer
    @abc.abstractmethod
    def configure_optimizer(self, spec: OptimizerSpec) -> None:
        """Build this engine's optimizer (and LR schedule, when `spec.scheduler` is set) over its own parameters
        in its own layout (a DeepSpeed engine initialises DeepSpeed here)."""

    @abc.abstractmethod
    def configure_scheduler(self, spec: SchedulerSpec | None = None, scheduler: Any = None) -> None:
        """Set the LR schedule after :meth:`configure_optimizer`: built from `spec`, or the user's `scheduler`."""

    @property
    @abc.abstractmethod
    def has_optimizer(self) -> bool:
        """Whether :meth:`configure_optimizer` has run."""

    @abc.abstractmethod
    def optimizer_step(self) -> float | None:
        """The global gradient norm over every rank and parameter shard, clipping to the spec's `max_grad_norm`,
        the optimizer step, the LR schedule's step, and zeroed gradients. Returns the norm before clipping (None
        if the backend reports none)."""

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @property
    @abc.abstractmethod
    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups (their `lr` and `weight_decay` may be changed in place)."""

    @abc.abstractmethod
    def optimizer_state_dict(self) -> dict:
        """The optimizer's state (this rank's shard on sharded layouts)."""

    @abc.abstractmethod
    def load_optimizer_state_dict(self, state: dict) -> None: ...

    @abc.abstractmethod
    def scheduler_state_dict(self) -> dict | None: ...

    @abc.abstractmethod
    def load_scheduler_state_dict(self, state: dict) -> None: ...

    @abc.abstractmethod
    def last_lr(self) -> list[float]:
        """The learning rate of every parameter group now."""

    # ------------------------------------------------------------------ weights and checkpoints
    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                       to_cpu: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors, bucket by bucket (a collective on sharded layouts: every rank iterates)."""

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole, HF-named state dict on the main rank (empty elsewhere); a collective."""

    @abc.abstractmethod
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole, HF-named weights into the (possibly sharded) model; a collective when sharded."""

    @abc.abstractmethod
    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """The HF export: `save_pretrained` of the whole model on the main rank (a collective when sharded)."""

    @abc.abstractmethod
    def save_checkpoint(self, output_dir: str) -> None:
        """Save what resuming needs beyond the HF weights (optimizer and schedule; one shard per rank on sharded
        layouts); a collective."""

    @abc.abstractmethod
    def load_checkpoint(self, input_dir: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""

    # ------------------------------------------------------------------ what other roles may know of the model
    @property
    def config(self) -> Any:
        """The model's `PretrainedConfig` (sizes, token ids), or None."""
        return getattr(self.model, "config", None)

    @property
    def has_adapters(self) -> bool:
        """Whether the model carries PEFT adapters that :meth:`adapters_disabled` can switch off."""
        return hasattr(self.model, "disable_adapter")

    def state_dict_keys(self) -> tuple[set[str], set[str]]:
        """`(the HF state-dict keys of the model, the keys tied to another one)`: what a checkpoint must hold."""
        model = self.model
        return set(model.state_dict().keys()), set(getattr(model, "_tied_weights_keys", None) or [])

    @torch.no_grad()
    def mix_weights_from(self, source: TrainingEngine, alpha: float) -> None:
        """`self <- (1 - alpha) self + alpha source`, parameter by parameter (TR-DPO / TRL's `sync_ref_model`; both
        engines on one layout, so that shards line up)."""
        mine, theirs = list(self.model.parameters()), list(source.model.parameters())
        if len(mine) != len(theirs):
            raise ValueError(f"the {self.role} has {len(mine)} parameters but the {source.role} {len(theirs)}: "
                             "cannot mix.")
        for r, p in zip(mine, theirs):
            r.lerp_(p.detach().to(r.dtype), alpha)

    def shares_weights_with(self, module: Any) -> bool:
        """Whether `module` is this engine's own model (a colocated rollout engine generating on its tensors)."""
        return module is not None and module is self.model

    def rollout_model(self) -> torch.nn.Module:
        """The model, unwrapped, for a rollout engine colocated on the same tensors (a transformers engine on the
        actor) or for building one (vLLM's `from_model`, a copy for asynchronous rollout).

        Raises:
            ValueError: on a layout that partitions parameters (FSDP2, ZeRO-3): no rank holds the whole model.
        """
        if not self.holds_full_weights:
            raise ValueError(f"the {self.role} engine ({self.backend.label}) partitions its parameters: no rank holds "
                             "a whole model to generate with; generate on a replica kept in step by weight sync.")
        return self.model


def _detached(output: Any) -> Any:
    """A forward output with every tensor detached (a tensor, a dataclass of tensors, or a tuple / list / dict)."""
    if isinstance(output, torch.Tensor):
        return output.detach()
    if is_dataclass(output) and not isinstance(output, type):
        return replace(output, **{f.name: _detached(getattr(output, f.name)) for f in fields(output)})
    if isinstance(output, (tuple, list)):
        return type(output)(_detached(x) for x in output)
    if isinstance(output, dict):
        return {k: _detached(v) for k, v in output.items()}
    return output


def _concat(parts: list[Any]) -> Any:
    """Concatenate per-chunk outputs over their rows: tensors, :class:`PolicyOutput` field by field, tuples
    element by element (a `None` field stays None)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(parts).mean() if first.dim() == 0 else torch.cat(parts)  # a scalar: its mean
    if isinstance(first, PolicyOutput):
        return PolicyOutput(*(_concat([getattr(p, f.name) for p in parts]) for f in fields(PolicyOutput)))
    if isinstance(first, tuple):
        return tuple(_concat(list(items)) for items in zip(*parts))
    if first is None:
        return None
    raise TypeError(f"infer() cannot concatenate outputs of type {type(first).__name__}; run one chunk "
                    "(micro_batch=None) or return tensors.")
