"""`MegatronEngine`: a model role on Megatron-Core tensor and pipeline parallelism.

The role's HF model is converted once, through the bridge (:mod:`~hf_verl.parallel.megatron.bridge`,
:mod:`~hf_verl.parallel.megatron.families`), into this rank's stage of a Megatron-Core `GPTModel`
(:mod:`~hf_verl.parallel.megatron.model`): its tensor-parallel slice of the layers of its pipeline stage. From
then on the engine owns the weights:

- **the step**: :meth:`forward_backward` runs every micro-batch of an optimizer step through Megatron-Core's
  schedule (`get_forward_backward_func()`: no pipelining at `pp=1`, 1F1B at `pp>1`); the loss function runs on
  the last stage, on the request's output, and the losses and metrics are broadcast to the other stages.
  Gradients go through Megatron's `DistributedDataParallel` (one reduction per step, in `finalize_model_grads`,
  which also sums the tied embedding's gradients of the first and last stages);
- **the optimizer**: Megatron's distributed optimizer (Adam with decoupled weight decay; optimizer states
  sharded over the data-parallel ranks), its global gradient norm (tensor-parallel duplicates counted once,
  every stage and shard included) and clipping; the LR schedule is transformers' (`SchedulerSpec`);
- **log-probs without the vocabulary gathered**: the head's logits stay vocabulary-parallel, and
  :func:`~hf_verl.parallel.megatron.vocab.token_stats` reduces one number per position across the slices;
- **weights out**: :meth:`export_weights` streams HF-named tensors bucket by bucket (tensor-parallel slices
  gathered per parameter, pipeline stages in turn), which is the weight sync to a rollout engine, `save_model`
  and :meth:`save_pretrained`; :meth:`save_checkpoint` / :meth:`load_checkpoint` keep each rank's shards and
  optimizer state.

On a machine without a GPU every call into Megatron-Core runs inside :func:`~.compat.cpu_compat`.

Requests the engine serves at every layout: :class:`~hf_verl.engine.step.LogProbs`,
:class:`~hf_verl.engine.step.Values`, :class:`~hf_verl.engine.step.SamplingStatistics`, and any request that
states its forward as a :class:`~hf_verl.engine.step.TokenQuery` (DPO's pairs); at `pp=1` also any other request
built on the primitives :meth:`token_logprobs` / :meth:`token_values`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.base import TrainingEngine
from hf_verl.engine.hf_layouts import position_ids_from_mask, rollout_positions, scatter_completion
from hf_verl.engine.parts.scoring import TokenStats, concat_outputs, row_chunks
from hf_verl.engine.parts.stepping import detached
from hf_verl.engine.step import (
    ForwardRequest,
    LogProbs,
    LossFn,
    OptimizerSpec,
    PolicyOutput,
    SamplingStatistics,
    SchedulerSpec,
    StepResult,
    Values,
)
from hf_verl.parallel.dims import ParallelDims
from hf_verl.parallel.megatron.bridge import Bridge, Mapping, ShardContext, VocabColumn
from hf_verl.parallel.megatron.compat import cpu_compat
from hf_verl.parallel.megatron.launch import MEGATRON_BACKEND
from hf_verl.parallel.megatron.families import table_for
from hf_verl.parallel.megatron.model import (
    architecture,
    build_stage,
    check_layout,
    import_megatron,
    transformer_config,
)
from hf_verl.parallel.megatron.vocab import token_stats

logger = logging.getLogger(__name__)



def init_parallel_state(dims: ParallelDims, seed: int) -> None:
    """Megatron-Core's process groups for `dims` (once per process; every role of a run shares them)."""
    import_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError("backend='megatron' needs a process group: launch with torchrun or accelerate launch (one "
                           "process is fine), or call torch.distributed.init_process_group first.")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (dims.tp, dims.pp):
            raise ValueError(f"Megatron-Core is already laid out as tp={have[0]}, pp={have[1]} in this process; every "
                             f"role on backend='megatron' must use that layout (asked: tp={dims.tp}, pp={dims.pp}).")
        return
    if dims.sp > 1:
        raise ValueError("sequence_parallel_size > 1 (Ulysses) is not available with backend='megatron'; use "
                         "tensor_model_parallel_size for long sequences, or another backend for Ulysses.")
    with cpu_compat():
        ps.initialize_model_parallel(tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


@dataclass
class _Plan:
    """One micro-batch's forward: the model's inputs and what turns the last stage's output into the request's.
    `head_rows`: the positions the LM head scores (a `(B, T)` mask or a flat `(N,)` index): only those go
    through it, and the output is then `(1, N, V_local)` in that order."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor  # (B, 1, T, T) bool, True = masked
    finish: Callable[[torch.Tensor], Any]
    head_rows: torch.Tensor | None = None
    head_hidden: torch.Tensor | None = None  # the scored positions' final hidden states, set during the forward


def attention_mask_4d(mask: torch.Tensor) -> torch.Tensor:
    """Megatron's `(B, 1, T, T)` boolean mask (True = not attended) from a `(B, T)` padding mask: causal, and
    no attention to padding."""
    T = mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    return ~(causal[None, None] & mask.bool()[:, None, None, :])


class MegatronEngine(TrainingEngine):
    """One model role on Megatron-Core (see the module docstring).

    Args:
        model (`PreTrainedModel`): the role's HF model (a bridged family), whole, on the CPU or this rank's device;
            its weights are converted into this rank's shards.
        role (`str`): "actor", "critic", "reference" or "reward".
        dims ([`ParallelDims`]): the layout (`tp`, `pp`, and the data-parallel ranks left).
        trainable (`bool`): whether it runs backward and optimizer steps.
        gradient_checkpointing (`bool`): Megatron's full-layer recompute.
        bf16 / fp16 (`bool`): the parameters' dtype (else fp32).
        seed (`int`): Megatron's model-parallel RNG seed.
    """

    def __init__(self, model: Any, *, role: str, dims: ParallelDims, trainable: bool = True,
                 gradient_checkpointing: bool = False, bf16: bool = False, fp16: bool = False, seed: int = 42,
                 **_: Any) -> None:
        if getattr(model, "peft_config", None):
            raise ValueError("backend='megatron' trains full weights; PEFT / LoRA adapters are not bridged: drop "
                             "peft_config, or use another backend (ddp, fsdp2, zero) for LoRA.")
        self.role, self.dims, self.trainable = role, dims, trainable
        self.backend = MEGATRON_BACKEND
        self.padding_free = self.shared_prefix = False  # rows are scored padded (no packing, no shared prompts)
        self._hf_config = model.config
        self._kind = "value" if model.__class__.__name__.endswith("ForSequenceClassification") else "causal_lm"
        self._arch = architecture(model.config)
        check_layout(self._arch, dims.tp, dims.pp)
        self._dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
        init_parallel_state(dims, seed)
        from megatron.core import parallel_state as ps

        self._ps = ps
        self._tp_rank = ps.get_tensor_model_parallel_rank()
        self._pp_rank = ps.get_pipeline_model_parallel_rank()
        self._first, self._last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        with cpu_compat():
            self._config = transformer_config(self._arch, tp=dims.tp, pp=dims.pp, dtype=self._dtype,
                                              gradient_checkpointing=gradient_checkpointing and trainable)
            stage = build_stage(self._arch, self._config, role_kind=self._kind, pre_process=self._first,
                                post_process=self._last, tp=dims.tp)
        per_stage = self._arch.num_layers // dims.pp
        self._ctx = ShardContext(dims.tp, self._tp_rank, self._arch.num_heads, self._arch.num_query_groups,
                                 self._arch.head_dim, self._arch.vocab_size, self._arch.padded_vocab(dims.tp))
        self._bridge = Bridge(table_for(self._arch.family, self._kind, self._arch.tied), self._ctx,
                              layer_offset=self._pp_rank * per_stage, num_layers=per_stage, first_stage=self._first,
                              last_stage=self._last)
        self._load_hf(stage, model.state_dict())
        stage.to(dtype=self._dtype)
        self._keep_padding_row(stage, model)
        self._head_plan: _Plan | None = None  # the plan whose forward runs now (its scored positions)
        if self._last and self._kind == "causal_lm":
            stage.output_layer.register_forward_pre_hook(self._select_head_rows, with_kwargs=True)
        self._stage = stage
        self._ddp = None
        self._optimizer = None
        self._schedule = None
        self._shadow: torch.optim.Optimizer | None = None  # carries transformers' LR schedule
        self._spec: OptimizerSpec | None = None
        self._training = True
        if trainable:
            self._wrap_ddp()
        self._stage.train(True)

    # ------------------------------------------------------------------ construction
    def _load_hf(self, stage: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
        def get(name: str) -> torch.Tensor:
            if name not in hf_state:
                raise KeyError(f"the {self.role} model has no tensor {name!r}, which the "
                               f"{self._arch.family.name} bridge table maps; is it a {self._arch.family.name} model?")
            return hf_state[name].detach().to("cpu", torch.float32)

        shards = self._bridge.load(get)
        own = stage.state_dict()
        if "output_layer.weight" in own and "output_layer.weight" not in shards and self._arch.tied:
            # a tied head on a later pipeline stage than the embedding: Megatron keeps a copy there (its gradient
            # summed with the embedding's in finalize_model_grads); it starts as the embedding, and is not exported
            shards["output_layer.weight"] = VocabColumn(("model.embed_tokens.weight",)).shard(
                [get("model.embed_tokens.weight")], self._ctx)
        for name, tensor in shards.items():
            if name not in own:
                raise KeyError(f"the Megatron stage has no parameter {name!r} (bridge table and model disagree).")
            if tuple(own[name].shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: the bridge made {tuple(tensor.shape)}, the stage holds {tuple(own[name].shape)}.")
        missing = [k for k in own if k not in shards and not k.endswith("_extra_state")]
        if missing:
            raise KeyError(f"the bridge table leaves Megatron parameters unset: {missing[:5]}")
        stage.load_state_dict(shards, strict=False)
        # Megatron reads a parameter's split from attributes its initialisation sets (skipped: the weights come
        # from the bridge); its gradient norm counts a tensor-parallel duplicate once by them
        params = dict(stage.named_parameters())
        entries = [(n, m) for n, m, _ in self._bridge.entries()]
        if "output_layer.weight" in shards and "output_layer.weight" not in dict(entries):
            entries.append(("output_layer.weight", VocabColumn(("model.embed_tokens.weight",))))
        for name, mapping in entries:
            if name in params and mapping.tensor_parallel:
                param = params[name]
                param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, mapping.partition_dim, 1

    def _select_head_rows(self, module, args, kwargs):
        """Take the final hidden states of the positions a request scores away from Megatron's LM head call: they
        go into the plan's box, and the head is called on no row (its output is not read). The plan's `finish`
        runs the head on them in chunks (:meth:`_head_stats`): prompt and padding positions never reach it."""
        plan, self._head_plan = self._head_plan, None
        if plan is None or plan.head_rows is None:
            return None
        rows = plan.head_rows
        hidden = args[0].transpose(0, 1)  # [b, s, h]
        plan.head_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows) if rows.dtype != torch.bool \
            else hidden[rows]
        return (args[0][:0], *args[1:]), kwargs

    def _head_stats(self, hidden: torch.Tensor, targets: torch.Tensor, *, chunk_size: int, **kwargs) -> TokenStats:
        """Token statistics of `hidden` `(N, h)` through the vocabulary-parallel LM head, a chunk of positions at a
        time (each chunk's fp32 logits within 256 MiB, recomputed in the backward instead of kept)."""
        stage = self._stage
        weight = stage.shared_embedding_or_output_weight() if stage.share_embeddings_and_output_weights else None
        v_local = self._ctx.padded_vocab_size // self.dims.tp
        step = max(1, min(chunk_size, (64 << 20) // v_local))
        start = self._tp_rank * v_local

        def chunk(h, t):
            logits, _ = stage.output_layer(h.unsqueeze(1), weight=weight)
            return token_stats(logits[:, 0], t, vocab_start=start, vocab_size=self._arch.vocab_size,
                               reduce_sum=self._tp_sum, reduce_max=self._tp_max, **kwargs)

        parts = []
        for i in range(0, max(hidden.shape[0], 1), step):
            h, t = hidden[i : i + step], targets[i : i + step]
            if torch.is_grad_enabled() and h.requires_grad:
                parts.append(torch.utils.checkpoint.checkpoint(chunk, h, t, use_reentrant=False))
            else:
                parts.append(chunk(h, t))
        logp, entropy, log_sum_sq, mean_logit = (
            None if p[0] is None else torch.cat(p) for p in zip(*parts))
        return TokenStats(logp=logp, entropy=entropy, mean_logit=mean_logit, log_sum_sq=log_sum_sq)

    def _keep_padding_row(self, stage: torch.nn.Module, model: Any) -> None:
        """HF embeddings built with `padding_idx` never train that row (`nn.Embedding` zeroes its gradient from the
        lookup); Megatron's embedding has no such index, so the lookup's output gradient is zeroed at the padding
        token's positions, which is the same arithmetic (a tied LM head still trains the row, as in HF)."""
        embed = getattr(model, "get_input_embeddings", lambda: None)()
        pad = getattr(embed, "padding_idx", None)
        lookup = getattr(getattr(stage, "embedding", None), "word_embeddings", None)
        if pad is None or lookup is None:
            return

        def hook(module, args, output):
            if output.requires_grad:
                keep = (args[0] != pad).unsqueeze(-1).to(output.dtype)
                output.register_hook(lambda grad: grad * keep)

        lookup.register_forward_hook(hook)

    def _wrap_ddp(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True, check_for_nan_in_grad=False)
        with cpu_compat():
            self._ddp = DistributedDataParallel(config=self._config, ddp_config=ddp_config, module=self._stage)
        self._config.no_sync_func = self._ddp.no_sync
        self._config.finalize_model_grads_func = finalize_model_grads

    # ------------------------------------------------------------------ views
    @property
    def model(self) -> torch.nn.Module:
        return self._stage

    @property
    def module(self) -> torch.nn.Module:
        return self._ddp if self._ddp is not None else self._stage

    @property
    def config(self) -> Any:
        return self._hf_config

    @property
    def holds_full_weights(self) -> bool:
        return False

    @property
    def has_adapters(self) -> bool:
        return False

    @property
    def device(self) -> torch.device:
        return next(self._stage.parameters()).device

    def shares_weights_with(self, module: Any) -> bool:
        return False

    def state_dict_keys(self) -> tuple[set[str], set[str]]:
        """The HF names of the whole model (every stage) and the tied head's name."""
        whole = Bridge(self._bridge.table, self._ctx, layer_offset=0, num_layers=self._arch.num_layers,
                       first_stage=True, last_stage=True)
        tied = {"lm_head.weight"} if self._arch.tied and self._kind == "causal_lm" else set()
        return set(whole.hf_names()), tied

    def mix_weights_from(self, source: TrainingEngine, alpha: float) -> None:
        raise ValueError("sync_ref_model (mixing the policy into the reference) is not available with "
                         "backend='megatron' yet; set sync_ref_model=False.")

    def rollout_model(self) -> torch.nn.Module:
        raise ValueError("a Megatron engine holds shards, not an HF model to generate with: generate on a replica "
                         "synced by export_weights (the trainers and the facade do so).")

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[TrainingEngine]:
        raise ValueError(f"the {self.role} on backend='megatron' has no PEFT adapters; give a reference model.")
        yield self  # pragma: no cover

    @property
    def training(self) -> bool:
        return self._training

    def train(self, mode: bool = True) -> None:
        self._training = mode
        self._stage.train(mode)

    # ------------------------------------------------------------------ forwards
    def _run(self, plan: _Plan, model: torch.nn.Module | None = None) -> torch.Tensor:
        """The stage's forward of a plan (the LM head on the plan's scored positions only)."""
        self._head_plan = plan if self._last else None
        with cpu_compat():
            return (model or self.module)(plan.input_ids, plan.position_ids, plan.attention_mask)

    def _check_length(self, T: int) -> None:
        window = self._arch.sliding_window
        if window is not None and T > window:
            raise ValueError(f"a sequence of {T} tokens exceeds the model's sliding_window={window}, which the Megatron "
                             "bridge does not apply: shorten max_prompt_length + max_completion_length, or use "
                             "another backend.")

    def _stats_plan(self, input_ids: torch.Tensor, targets: torch.Tensor, select: torch.Tensor,
                    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, *, temperature: float,
                    with_entropy: bool = False, with_log_sum_sq: bool = False,
                    with_mean_logit: bool = False, chunk_size: int = 1024) -> _Plan:
        if self._kind != "causal_lm":
            raise ValueError(f"the {self.role} is a value model; it has no token log-probs.")
        self._check_length(input_ids.shape[1])
        if attention_mask is None:
            if position_ids is not None and bool((position_ids.diff(dim=-1) < 0).any()):
                raise ValueError("packed rows (several sequences in one row) are not supported with backend='megatron'; "
                                 "turn padding_free off.")
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        tgt = targets if select.dtype != torch.bool else targets[select]
        plan = _Plan(input_ids, position_ids, attention_mask_4d(attention_mask), lambda _: None, head_rows=select)
        plan.finish = lambda _output: self._head_stats(
            plan.head_hidden, tgt, chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy,
            with_log_sum_sq=with_log_sum_sq, with_mean_logit=with_mean_logit)
        return plan

    def _values_plan(self, input_ids, select, attention_mask, position_ids) -> _Plan:
        if self._kind != "value":
            raise ValueError(f"the {self.role} is a causal LM; values come from a critic (a value model).")
        self._check_length(input_ids.shape[1])
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        position_ids = position_ids_from_mask(attention_mask) if position_ids is None else position_ids
        return _Plan(input_ids, position_ids, attention_mask_4d(attention_mask),
                     lambda out: out[..., 0][select].float())

    def _tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims.tp == 1:
            return t
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(t)

    def _tp_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims.tp > 1:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ps.get_tensor_model_parallel_group())
        return t

    def _plan(self, request: ForwardRequest, batch: Any) -> _Plan | None:
        """The plan of a request this engine serves itself (None: run the request on the primitives)."""
        if isinstance(request, LogProbs):
            if request.with_aux_loss:
                raise ValueError("a router aux loss (Mixture of Experts) is not bridged to backend='megatron'.")
            ids, mask, select, targets = rollout_positions(batch)
            plan = self._stats_plan(ids, targets, select, mask, None, with_entropy=request.with_entropy,
                                    temperature=request.temperature if request.temperature > 0 else 1.0,
                                    chunk_size=request.chunk_size)
            stats = plan.finish
            plan.finish = lambda out: PolicyOutput(
                logp=scatter_completion(batch, (s := stats(out)).logp),
                entropy=scatter_completion(batch, s.entropy) if request.with_entropy else None)
            return plan
        if isinstance(request, SamplingStatistics):
            ids, mask, select, targets = rollout_positions(batch)
            plan = self._stats_plan(ids, targets, select, mask, None, with_log_sum_sq=True,
                                    temperature=request.temperature if request.temperature > 0 else 1.0,
                                    chunk_size=request.chunk_size)
            stats = plan.finish
            plan.finish = lambda out: (scatter_completion(batch, (s := stats(out)).logp),
                                       scatter_completion(batch, s.log_sum_sq.exp()))
            return plan
        if isinstance(request, Values):
            ids, mask, select, _ = rollout_positions(batch)
            plan = self._values_plan(ids, select, mask, None)
            values = plan.finish
            plan.finish = lambda out: scatter_completion(batch, values(out))
            return plan
        query = request.token_query(self, batch) if hasattr(request, "token_query") else None
        if query is not None:  # one token_logprobs call and a reduction (DPO's pairs): schedulable
            if query.with_aux_loss:
                raise ValueError("a router aux loss (Mixture of Experts) is not bridged to backend='megatron'.")
            plan = self._stats_plan(query.input_ids, query.targets, query.select, query.attention_mask,
                                    query.position_ids, temperature=query.temperature,
                                    with_entropy=query.with_entropy, with_log_sum_sq=query.with_log_sum_sq,
                                    with_mean_logit=query.with_mean_logit, chunk_size=query.chunk_size)
            stats = plan.finish
            plan.finish = lambda out: request.from_stats(stats(out), batch)
            return plan
        return None

    def _whole_model(self, what: str) -> None:
        if self.dims.pp > 1:
            raise ValueError(f"{what} runs the whole model in one call, which a pipeline of "
                             f"{self.dims.pp} stages cannot: use a request the Megatron engine schedules (LogProbs, "
                             "Values, SamplingStatistics), or pipeline_model_parallel_size=1.")

    def token_logprobs(self, input_ids, targets, select, *, attention_mask=None, position_ids=None, temperature=1.0,
                       chunk_size=1024, with_entropy=False, with_mean_logit=False, with_aux_loss=False,
                       with_log_sum_sq=False) -> TokenStats:
        self._whole_model("token_logprobs")
        if with_aux_loss:
            raise ValueError("a router aux loss (Mixture of Experts) is not bridged to backend='megatron'.")
        plan = self._stats_plan(input_ids, targets, select, attention_mask, position_ids, temperature=temperature,
                                with_entropy=with_entropy, with_log_sum_sq=with_log_sum_sq,
                                with_mean_logit=with_mean_logit, chunk_size=chunk_size)
        return plan.finish(self._run(plan))

    def token_values(self, input_ids, select, *, attention_mask=None, position_ids=None) -> torch.Tensor:
        self._whole_model("token_values")
        plan = self._values_plan(input_ids, select, attention_mask, position_ids)
        return plan.finish(self._run(plan))

    def logprobs(self, batch: RolloutBatch, *, temperature: float = 1.0, chunk_size: int = 1024,
                 with_entropy: bool = False, with_aux_loss: bool = False):
        self._whole_model("logprobs")
        plan = self._plan(LogProbs(temperature, chunk_size, with_entropy, with_aux_loss), batch)
        out = plan.finish(self._run(plan))
        return out.logp, out.entropy

    def sampling_statistics(self, batch: RolloutBatch, *, temperature: float = 1.0,
                            chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        self._whole_model("sampling_statistics")
        plan = self._plan(SamplingStatistics(temperature, chunk_size), batch)
        return plan.finish(self._run(plan))

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        self._whole_model("values")
        plan = self._plan(Values(), batch)
        return plan.finish(self._run(plan))

    # ------------------------------------------------------------------ the step
    def forward_backward(self, micro_batches: Sequence[Any], loss_fn: LossFn, *, forward: ForwardRequest,
                         forward_only: bool = False, loss_scale: float = 1.0,
                         keep_outputs: bool = False) -> StepResult:
        """Every micro-batch of an optimizer step through Megatron-Core's schedule (see the module docstring)."""
        if not forward_only and not self.trainable:
            raise ValueError(f"the {self.role} engine is frozen; it runs no backward.")
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = len(micro_batches)
        if n == 0:
            return StepResult()
        records: list[dict] = []

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            plan = self._plan(forward, batch)
            if plan is None:
                self._whole_model(type(forward).__name__)
                output = forward.run(self, batch)  # the request calls the primitives, which run the model
                finish = None
            else:
                output = self._run(plan, model)
                finish = plan.finish

            def loss_func(output_tensor):
                out = finish(output_tensor) if finish is not None else output_tensor
                loss, metrics = loss_fn(out, batch)
                records.append({"loss": loss.detach().float().cpu(),
                                "metrics": {k: float(v) for k, v in metrics.items()},
                                "output": detached(out) if keep_outputs else None})
                # the schedule divides each micro-batch's loss by their number; the engine's contract is loss_scale
                return loss * (loss_scale * n), {}

            return output, loss_func

        first = micro_batches[0]
        seq, mbs = _shape_of(first)
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        with cpu_compat(), grad:
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                                        model=[self.module], num_microbatches=n, seq_length=seq,
                                        micro_batch_size=mbs, forward_only=forward_only)
        if self.dims.pp > 1:  # the last stage computed the losses: every stage returns them
            records = self._from_last_stage(records)
        result = StepResult(is_output_rank=self._last)
        for r in records:
            result.losses.append(r["loss"])
            result.metrics.append(r["metrics"])
            if keep_outputs:
                result.outputs.append(r["output"])
        return result

    def _from_last_stage(self, obj: Any) -> Any:
        holder = [obj if self._last else None]
        group = self._ps.get_pipeline_model_parallel_group()
        dist.broadcast_object_list(holder, src=self._ps.get_pipeline_model_parallel_last_rank(), group=group)
        return holder[0]

    @torch.no_grad()
    def infer(self, batch: Any, forward: ForwardRequest, *, micro_batch: int | None = None) -> Any:
        if self.dims.pp == 1:
            return super().infer(batch, forward, micro_batch=micro_batch)
        was_training = self.training
        self.train(False)
        try:
            # one forward over the whole batch (any type the request takes), or micro_batch rows at a time
            parts = [batch] if micro_batch is None else list(row_chunks(batch, micro_batch))
            zero = torch.zeros(())
            result = self.forward_backward(parts, lambda out, mb: (zero, {}), forward=forward, forward_only=True,
                                           keep_outputs=True)
        finally:
            self.train(was_training)
        return concat_outputs(result.outputs)

    def _backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError("the Megatron engine runs its backward inside forward_backward's schedule.")

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ optimizer
    def configure_optimizer(self, spec: OptimizerSpec) -> None:
        if not self.trainable:
            raise ValueError(f"the {self.role} engine is frozen; it has no optimizer.")
        if spec.optimizer is not None:
            raise ValueError("backend='megatron' builds its own distributed optimizer; a user-built optimizer "
                             "(optimizers=) cannot shard over its layout: pass the settings (learning_rate, "
                             "weight_decay, adam_beta1/2, adam_epsilon) instead.")
        name = getattr(spec.optimizer_cls, "__name__", str(spec.optimizer_cls))
        if "adam" not in name.lower():
            raise ValueError(f"backend='megatron' runs Adam with decoupled weight decay (AdamW); {name} is not "
                             "available there: set optim='adamw_torch'.")
        import_megatron()
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        kw = spec.optimizer_kwargs
        betas = kw.get("betas", (0.9, 0.999))
        clip = float(spec.max_grad_norm or 0.0)
        config = OptimizerConfig(optimizer="adam", lr=float(kw.get("lr", 1e-3)), weight_decay=spec.weight_decay,
                                 adam_beta1=float(betas[0]), adam_beta2=float(betas[1]),
                                 adam_eps=float(kw.get("eps", 1e-8)), clip_grad=clip,
                                 use_distributed_optimizer=True, bf16=self._dtype == torch.bfloat16,
                                 fp16=self._dtype == torch.float16, params_dtype=self._dtype)
        with cpu_compat():
            self._optimizer = get_megatron_optimizer(config, [self._ddp])
        self._spec = spec
        self._base_lrs = [config.lr for _ in self._optimizer.param_groups]
        self._shadow = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr}
                                        for lr in self._base_lrs], lr=config.lr)
        self.configure_scheduler(spec.scheduler)

    def configure_scheduler(self, spec: SchedulerSpec | None = None, scheduler: Any = None) -> None:
        if scheduler is not None:
            raise ValueError("backend='megatron' steps transformers' LR schedule by name (lr_scheduler_type); a "
                             "user-built scheduler object cannot drive its distributed optimizer.")
        if self._shadow is None:
            return
        self._schedule = (spec or SchedulerSpec()).build(self._shadow)
        self._apply_lr()

    def _follow_external_lr(self) -> None:
        """A learning rate set on `param_groups` from outside (the facade's live `config.learning_rate`) rescales
        the schedule's base, so the schedule goes on from it."""
        for i, (group, shadow) in enumerate(zip(self._optimizer.param_groups, self._shadow.param_groups)):
            if group["lr"] != shadow["lr"] and shadow["lr"] > 0:
                self._schedule.base_lrs[i] *= group["lr"] / shadow["lr"]
                shadow["lr"] = group["lr"]
            elif group["lr"] != shadow["lr"]:  # from a zero point of the schedule: take the new value as the base
                self._schedule.base_lrs[i] = group["lr"]

    def _apply_lr(self) -> None:
        for group, shadow in zip(self._optimizer.param_groups, self._shadow.param_groups):
            group["lr"] = shadow["lr"]

    @property
    def has_optimizer(self) -> bool:
        return self._optimizer is not None

    def optimizer_step(self) -> float | None:
        if self._optimizer is None:
            raise RuntimeError(f"the {self.role} engine has no optimizer: call configure_optimizer first.")
        with cpu_compat():
            norm = None
            if not self._optimizer.config.clip_grad:
                self._optimizer.prepare_grads()
                norm = float(self._optimizer.get_grad_norm())
            ok, clipped_norm, _ = self._optimizer.step()
            self._ddp.zero_grad_buffer()
            self._optimizer.zero_grad()
        if self._schedule is not None:
            self._follow_external_lr()
            self._shadow.step()
            self._schedule.step()
            self._apply_lr()
        return float(clipped_norm) if norm is None else norm

    def zero_grad(self) -> None:
        if self._ddp is not None:
            self._ddp.zero_grad_buffer()
        if self._optimizer is not None:
            self._optimizer.zero_grad()

    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups if self._optimizer is not None else []

    def last_lr(self) -> list[float]:
        return [g["lr"] for g in self.param_groups]

    def _chained(self) -> list:
        return list(getattr(self._optimizer, "chained_optimizers", [self._optimizer]))

    def optimizer_state_dict(self) -> dict:
        """This rank's optimizer state: for each of Megatron's (chained) optimizers, the inner torch optimizer's
        state dict (its shard of the Adam moments and step counts) and its main parameters (the fp32 copies a
        bf16 / fp16 run steps; views of the weights in fp32). Resumable on the same layout."""
        return {"parts": [{"inner": opt.optimizer.state_dict(),
                           "main": [p.detach().clone() for g in opt.optimizer.param_groups for p in g["params"]]}
                          for opt in self._chained()]}

    @torch.no_grad()
    def load_optimizer_state_dict(self, state: dict) -> None:
        """The inverse of :meth:`optimizer_state_dict` (after the weights are loaded)."""
        for opt, part in zip(self._chained(), state["parts"], strict=True):
            params = [p for g in opt.optimizer.param_groups for p in g["params"]]
            if len(params) != len(part["main"]):
                raise ValueError("the optimizer checkpoint was written on another layout (tensor / pipeline / data "
                                 "parallel sizes): resume on the layout that saved it.")
            for p, saved in zip(params, part["main"]):
                p.copy_(saved)
            opt.optimizer.load_state_dict(part["inner"])
            if self._dtype != torch.float32:  # the fp32 main copies back into the bf16 / fp16 weights
                with cpu_compat():
                    opt._copy_main_params_to_model_params()

    def scheduler_state_dict(self) -> dict | None:
        return None if self._schedule is None else self._schedule.state_dict()

    def load_scheduler_state_dict(self, state: dict) -> None:
        if self._schedule is not None and state is not None:
            self._schedule.load_state_dict(state)
            for group, lr in zip(self._shadow.param_groups, self._schedule.get_last_lr()):
                group["lr"] = lr
            self._apply_lr()

    # ------------------------------------------------------------------ weights
    def _gather(self, name: str, tensor: torch.Tensor, mapping: Mapping) -> list[torch.Tensor]:
        tensor = tensor.detach()
        if not mapping.tensor_parallel or self.dims.tp == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.dims.tp)]
        dist.all_gather(parts, tensor.contiguous(), group=self._ps.get_tensor_model_parallel_group())
        return parts

    def _named_hf(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor of the model on every rank, pipeline stages in turn (collectives on every rank)."""
        params = {k: v for k, v in self._stage.state_dict().items() if not k.endswith("_extra_state")}
        mine = list(self._bridge.export(self._gather, params))
        if self.dims.pp == 1:
            for name, t in mine:
                yield name, t if dtype is None else t.to(dtype)
            return
        group = self._ps.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        for stage, src in enumerate(ranks):
            meta = [[(n, tuple(t.shape), str(t.dtype)) for n, t in mine] if stage == self._pp_rank else None]
            dist.broadcast_object_list(meta, src=src, group=group)
            for i, (name, shape, dt) in enumerate(meta[0]):
                t = mine[i][1].contiguous() if stage == self._pp_rank else \
                    torch.empty(shape, dtype=getattr(torch, dt.replace("torch.", "")))
                dist.broadcast(t, src=src, group=group)
                yield name, t if dtype is None else t.to(dtype)

    def export_weights(self, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                       **_: Any) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket, size = [], 0
        for name, t in self._named_hf(dtype):
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._named_hf(None))

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._load_hf(self._stage, state)
        if self._optimizer is not None:  # the distributed optimizer's fp32 main copy follows the weights
            with cpu_compat():
                self._optimizer.reload_model_params()

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """The HF model (weights gathered from every shard and stage, safetensors) in `output_dir`, written by the
        main rank; call on every rank."""
        state = self.full_state_dict()
        if not self.dims.is_main:
            return
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        auto = AutoModelForSequenceClassification if self._kind == "value" else AutoModelForCausalLM
        with torch.device("meta"):
            hf = auto.from_config(self._hf_config)
        hf.load_state_dict(state, strict=False, assign=True)
        if self._arch.tied and self._kind == "causal_lm":
            hf.tie_weights()
        hf.save_pretrained(output_dir, safe_serialization=True, **kwargs)

    def save_checkpoint(self, output_dir: str) -> None:
        """Each rank's shards (safetensors) and optimizer / schedule state, resumable on the same layout."""
        from safetensors.torch import save_file

        os.makedirs(output_dir, exist_ok=True)
        tag = f"tp{self._tp_rank}_pp{self._pp_rank}"
        weights = {k: v.detach().contiguous() for k, v in self._stage.state_dict().items()
                   if not k.endswith("_extra_state")}
        if self.dims.dp_rank == 0:
            save_file(weights, os.path.join(output_dir, f"megatron_{self.role}_{tag}.safetensors"))
        if self._optimizer is not None:  # every rank its shard of the distributed optimizer
            state = {"optimizer": self.optimizer_state_dict(), "scheduler": self.scheduler_state_dict()}
            torch.save(state, os.path.join(output_dir, f"megatron_{self.role}_{tag}_dp{self.dims.dp_rank}_optim.pt"))
        dist.barrier()

    @torch.no_grad()
    def load_checkpoint(self, input_dir: str) -> None:
        from safetensors.torch import load_file

        tag = f"tp{self._tp_rank}_pp{self._pp_rank}"
        path = os.path.join(input_dir, f"megatron_{self.role}_{tag}.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint was not written by a Megatron {self.role} on "
                                    f"tp={self.dims.tp}, pp={self.dims.pp} (resume on the layout that saved it).")
        self._stage.load_state_dict(load_file(path), strict=False)
        optim = os.path.join(input_dir, f"megatron_{self.role}_{tag}_dp{self.dims.dp_rank}_optim.pt")
        if self._optimizer is not None and os.path.exists(optim):
            state = torch.load(optim, weights_only=True)  # tensors, numbers and strings only
            self.load_optimizer_state_dict(state["optimizer"])
            self.load_scheduler_state_dict(state["scheduler"])


def _shape_of(batch: Any) -> tuple[int, int]:
    """`(sequence length, rows)` of a micro-batch (the schedule's nominal shapes; the config's variable sequence
    lengths let each micro-batch send its own)."""
    if isinstance(batch, RolloutBatch):
        return batch.prompt_ids.shape[1] + batch.completion_ids.shape[1], batch.batch_size
    if isinstance(batch, dict) and "input_ids" in batch:
        return batch["input_ids"].shape[1], batch["input_ids"].shape[0]
    return 1, 1
