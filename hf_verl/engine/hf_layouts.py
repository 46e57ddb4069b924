"""`HFLayouts`: how a transformers-based training engine lays a batch out for a forward.

Mixed into :class:`~hf_verl.engine.accelerate_engine.AccelerateEngine` (and any engine whose model is a
transformers model run whole or in data-parallel / sequence-parallel shards), over the two forward primitives
:meth:`~hf_verl.engine.parts.scoring.ModelScoring.token_logprobs` and `token_values`. A rollout (left-padded prompt,
right-padded completion) is scored in one of three layouts, all equal to float rounding:

- padded rows;
- packed padding-free rows (:mod:`hf_verl.data.packing`, per-row causal attention), always under sequence
  parallelism, and on one rank when :attr:`padding_free` says so: `None` (the default) packs a rollout when
  :func:`packing_pays`;
- each prompt laid out once with its completions after it (:mod:`hf_verl.data.prefix_sharing`, a GRPO group, a
  DPO pair) when :attr:`shared_prefix` says so: `None` (the default) does it when the layout's arithmetic
  (:func:`~hf_verl.data.prefix_sharing.sharing_cost`) is at most :data:`SHARE_MAX_COST_RATIO` of the layout it
  replaces.

An engine with its own layout rules (Megatron's sequence packing, a vocabulary-parallel head) implements
`logprobs` / `values` / `sampling_statistics` itself instead.
"""

from __future__ import annotations

import contextlib

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
from hf_verl.engine.parts.scoring import TokenStats
from hf_verl.engine.positions import (  # noqa: F401 (importable from here too)
    position_ids_from_mask,
    rollout_positions,
    scatter_completion,
)
from hf_verl.engine.vision import has_vision_inputs, vision_logprobs
from hf_verl.moe.metrics import routing_metrics
from hf_verl.moe.routing import RoutingTap

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


def select_positions(hidden: torch.Tensor, targets: torch.Tensor | None,
                     select: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(hidden[select], targets[select])` for a boolean `(B, T)` mask; for a `(N,)` index of flat positions into
    `B * T` (a shared-prompt layout, where one position can predict several tokens), the hidden states at those
    positions in that order, and `targets` as given (already one per entry)."""
    if select.dtype == torch.bool:
        return hidden[select], None if targets is None else targets[select]
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, select), targets


def packed_routing(batch: RolloutBatch, length: int) -> torch.Tensor:
    """A rollout's routing record in the packed layout (:func:`~hf_verl.data.packing.pack_rollout`): the real
    tokens of every row in order, then -1 for the padding tail up to `length`; `(length, layers, top_k)`."""
    real = batch.attention_mask.bool()
    record = batch.routed_experts[real]
    tail = record.new_full((length - record.shape[0], *record.shape[1:]), -1)
    return torch.cat([record, tail])


class HFLayouts:
    """The layout policy of a transformers-based engine (see the module docstring); mixed in before
    :class:`~hf_verl.engine.base.TrainingEngine`.

    Attributes:
        padding_free (`bool`, *optional*): pack rollouts padding-free in :meth:`logprobs` / :meth:`values`
            (always under sequence parallelism); `None` decides per batch from its padding share.
        shared_prefix (`bool`, *optional*): score the rows of one prompt with the prompt laid out once
            (:meth:`logprobs`, :meth:`shared_layout`; one sequence-parallel rank only); `None` decides per batch
            from its arithmetic, `True` whenever two rows share a prompt, `False` never.
    """

    padding_free: bool | None = None
    shared_prefix: bool | None = None
    router_replay: bool = False
    last_routing: dict = {}  # noqa: RUF012 - replaced, never mutated

    def logprobs(self, batch: RolloutBatch, *, temperature: float = 1.0, chunk_size: int = 1024,
                 with_entropy: bool = False, with_aux_loss: bool = False):
        """`(B, C)` log-probs of a rollout's completion tokens (and entropy if asked), 0 on padding.

        Returns:
            `(logp, entropy)`; with `with_aux_loss`, `(logp, entropy, aux_loss)` where `aux_loss` is the
            model's router load-balancing loss of this forward (a Mixture-of-Experts model).
        """
        if has_vision_inputs(batch):  # rows with images: padded, their pixel inputs beside the ids
            return vision_logprobs(self, batch, temperature=temperature, chunk_size=chunk_size,
                                   with_entropy=with_entropy, with_aux_loss=with_aux_loss)
        if self.dims.sp > 1 and with_aux_loss:
            raise ValueError("a Mixture-of-Experts router aux loss (router_aux_loss_coef > 0) is not supported "
                             "with sequence_parallel_size > 1: set router_aux_loss_coef=0 or "
                             "sequence_parallel_size=1.")
        tap = self._routing_tap()
        replay = self.router_replay and batch.routed_experts is not None
        if self.router_replay and not replay and batch.completion_ids.shape[1]:
            raise ValueError("router_replay=True but this rollout batch carries no routing record "
                             "(prompt_routed_experts / completion_routed_experts): its rollout engine does not record "
                             "routing. Use the transformers, vllm or remote engine, or set router_replay=False.")
        packs = self._packs(batch, with_aux_loss)
        if self.dims.sp == 1 and not replay and (layout := self._rollout_layout(batch, packs, with_aux_loss)) \
                is not None:  # a replayed routing is laid out padded or packed, not by shared prompt
            stats = self.shared_token_logprobs(layout, temperature=temperature if temperature > 0 else 1.0,
                                               chunk_size=chunk_size, with_entropy=with_entropy)
            entropy = scatter_completion(batch, stats.entropy) if with_entropy else None
            return scatter_completion(batch, stats.logp), entropy
        if packs:
            return self._packed_logprobs(batch, temperature, chunk_size, with_entropy, tap=tap, replay=replay)
        input_ids, mask, select, targets = rollout_positions(batch)
        record = batch.routed_experts
        record = None if record is None else record.reshape(-1, *record.shape[2:])
        with tap.recording(record if replay else None) if tap is not None else contextlib.nullcontext():
            stats = self.token_logprobs(input_ids, targets, select, attention_mask=mask,
                                        position_ids=position_ids_from_mask(mask),
                                        temperature=temperature if temperature > 0 else 1.0, chunk_size=chunk_size,
                                        with_entropy=with_entropy, with_aux_loss=with_aux_loss)
            if tap is not None:
                self.last_routing = routing_metrics(tap.take(), mask.reshape(-1), tap.num_experts,
                                                    recorded=record, replayed=replay)
        entropy = scatter_completion(batch, stats.entropy) if with_entropy else None
        logp = scatter_completion(batch, stats.logp)
        return (logp, entropy, stats.aux_loss) if with_aux_loss else (logp, entropy)

    # ------------------------------------------------------------------ Mixture of Experts: routing
    def _routing_tap(self) -> RoutingTap | None:
        """The model's routing tap when it is a Mixture-of-Experts model (None otherwise): its forwards record the
        routers' choices (metrics) and replay a rollout's with :attr:`router_replay`."""
        return RoutingTap.of(self.model)

    def routing_window(self) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward: a replayed routing stays in force through the backward
        (activation checkpointing recomputes the layers there)."""
        tap = self._routing_tap() if self.router_replay else None
        return tap.window() if tap is not None else contextlib.nullcontext()

    def take_routing_metrics(self) -> dict[str, float]:
        """The routing metrics of the last :meth:`logprobs` forward (:mod:`hf_verl.moe.metrics`), then cleared."""
        out, self.last_routing = self.last_routing, {}
        return out

    def sampling_statistics(self, batch: RolloutBatch, *, temperature: float = 1.0,
                            chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, C)` log-probs of a rollout's completion tokens and `sum_v pi_v^2` at each of them (no gradient;
        0 on padding)."""
        if has_vision_inputs(batch):
            raise ValueError("the optimal-token-baseline estimators do not run on rows with images yet: choose "
                             "another advantage_estimator.")
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
        if has_vision_inputs(batch):
            raise ValueError("a critic (PPO) does not run on rows with images yet: train vision-language models with "
                             "GRPOTrainer, RLOOTrainer or DPOTrainer.")
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
        config = self.config
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
        config = self.config
        hidden = getattr(config, "hidden_size", None) or 1024
        heads = getattr(config, "num_attention_heads", None) or 1
        kv = getattr(config, "num_key_value_heads", None) or heads
        return {"hidden_size": hidden, "intermediate_size": getattr(config, "intermediate_size", None) or 4 * hidden,
                "kv_fraction": kv / heads}

    def _packed_logprobs(self, batch: RolloutBatch, temperature: float, chunk_size: int, with_entropy: bool,
                         tap: RoutingTap | None = None, replay: bool = False):
        """:meth:`logprobs` over a padding-free packed batch, its sequence split over the `sp` ranks
        (:mod:`hf_verl.parallel.ulysses`); every rank of the group gets the whole `(B, C)` result. A Mixture of
        Experts' routers see this rank's shard of the packed tokens: a replayed routing is packed and sharded
        alike."""
        from hf_verl.data.packing import pack_rollout
        from hf_verl.parallel.ulysses import packed_logprobs, use_segment_attention

        use_segment_attention(self.model)  # per-row causal attention (sequence parallelism has set it already)
        packed = pack_rollout(batch, multiple_of=self.dims.sp, pad_token_id=self._pad_token_id())
        record = packed_routing(batch, packed.length) if tap is not None and batch.routed_experts is not None \
            else None
        length = packed.length // self.dims.sp
        start = self.dims.sp_rank * length if self.dims.sp > 1 else 0
        shard = None if record is None else record[start : start + length]
        with self.autocast(), tap.recording(shard if replay else None) if tap is not None else \
                contextlib.nullcontext():
            out = packed_logprobs(self.module, self._lm_head(), packed, self.dims,
                                  temperature=temperature if temperature > 0 else 1.0, chunk_size=chunk_size,
                                  with_entropy=with_entropy)
            if tap is not None:
                real = torch.arange(start, start + length, device=packed.input_ids.device) < packed.num_tokens
                self.last_routing = routing_metrics(tap.take(), real, tap.num_experts, recorded=shard,
                                                    replayed=replay)
        return out

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
            logp, _, *rest = packed_logprobs(self.module, self._lm_head(), packed, self.dims,
                                             temperature=temperature if temperature > 0 else 1.0,
                                             chunk_size=chunk_size, with_mean_logit=with_mean_logit)
        return (logp, rest[0]) if with_mean_logit else logp

    def _lm_head(self) -> torch.nn.Module:
        """The output-embedding module the packed paths call on selected hidden states."""
        return self.model.get_output_embeddings()

    def _pad_token_id(self) -> int:
        pad = getattr(self.config, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    def _value_head(self) -> torch.nn.Module:
        """The critic's one-output value head module (a sequence-classification model's `score`)."""
        raise NotImplementedError(f"{type(self).__name__} names no value head for sequence parallelism.")
