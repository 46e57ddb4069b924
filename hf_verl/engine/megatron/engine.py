"""`MegatronEngine`: a model role on Megatron-Core tensor and pipeline parallelism.

The role's HF model is converted once, through the bridge (:mod:`~hf_verl.parallel.megatron.bridge`,
:mod:`~hf_verl.parallel.megatron.families`), into this rank's stage of a Megatron-Core `GPTModel`
(:mod:`~hf_verl.parallel.megatron.model`): its tensor-parallel slice of the layers of its pipeline stage. From
then on the engine owns the weights. It is the parts of a :class:`~hf_verl.engine.base.TrainingEngine` on
Megatron-Core, a module each:

- **the step** (this module): :meth:`MegatronEngine.forward_backward` runs every micro-batch of an optimizer step
  through Megatron-Core's schedule (`get_forward_backward_func()`: no pipelining at `pp=1`, 1F1B at `pp>1`); the
  loss function runs on the last stage, on the request's output, and the losses and metrics are broadcast to the
  other stages. Gradients go through Megatron's `DistributedDataParallel` (one reduction per step, in
  `finalize_model_grads`, which also sums the tied embedding's gradients of the first and last stages);
- **the optimizer** (:mod:`~hf_verl.engine.megatron.optimizer`): Megatron's distributed optimizer, its global
  gradient norm and clipping; the LR schedule is transformers' (`SchedulerSpec`);
- **scoring** (:mod:`~hf_verl.engine.megatron.scoring`): each request's forward as a plan the schedule runs;
  log-probs without the vocabulary gathered;
- **weights** (:mod:`~hf_verl.engine.megatron.weights`): the HF weights converted in, exported out bucket by bucket
  (the weight sync to a rollout engine, `save_model`, `save_pretrained`), each rank's checkpoint;
- **adapters** (:mod:`~hf_verl.engine.megatron.adapters`): a PEFT LoRA actor's adapters on the Megatron linears
  (base frozen, only the adapters in the optimizer); its reference is the stage with the adapters off.

This module builds the engine (Megatron's process groups, the stage, its `DistributedDataParallel`) and holds its
views and its step. On a machine without a GPU every call into Megatron-Core runs inside
:func:`~hf_verl.parallel.megatron.compat.cpu_compat`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hf_verl.data.batch import RolloutBatch
from hf_verl.engine.base import TrainingEngine
from hf_verl.engine.megatron.adapters import MegatronAdapters
from hf_verl.engine.megatron.optimizer import MegatronOptimization
from hf_verl.engine.megatron.scoring import MegatronScoring, Plan
from hf_verl.engine.megatron.weights import MegatronWeights
from hf_verl.engine.parts.scoring import concat_outputs, row_chunks
from hf_verl.engine.parts.stepping import detached
from hf_verl.engine.step import ForwardRequest, LossFn, OptimizerSpec, StepResult
from hf_verl.parallel.dims import ParallelDims
from hf_verl.parallel.megatron.bridge import Bridge, ShardContext
from hf_verl.parallel.megatron.compat import cpu_compat
from hf_verl.parallel.megatron.families import table_for
from hf_verl.parallel.megatron.launch import MEGATRON_BACKEND
from hf_verl.parallel.megatron.lora import read_peft
from hf_verl.parallel.megatron.model import architecture, build_stage, check_layout, import_megatron, transformer_config

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
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (dims.tp, dims.pp, dims.ep):
            raise ValueError(f"Megatron-Core is already laid out as tp={have[0]}, pp={have[1]}, ep={have[2]} in this "
                             "process; every role on backend='megatron' must use that layout (asked: "
                             f"tp={dims.tp}, pp={dims.pp}, ep={dims.ep}).")
        return
    if dims.sp > 1:
        raise ValueError("sequence_parallel_size > 1 (Ulysses) is not available with backend='megatron'; use "
                         "tensor_model_parallel_size for long sequences, or another backend for Ulysses.")
    with cpu_compat():
        ps.initialize_model_parallel(tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                                     expert_model_parallel_size=dims.ep)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


class MegatronEngine(MegatronScoring, MegatronOptimization, MegatronAdapters, MegatronWeights, TrainingEngine):
    """One model role on Megatron-Core (see the module docstring).

    Args:
        model (`PreTrainedModel`): the role's HF model (a bridged family), whole, on the CPU or this rank's device;
            its weights are converted into this rank's shards. A `PeftModel` with LoRA adapters trains its adapters
            only (:mod:`~hf_verl.engine.megatron.adapters`).
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
        peft = read_peft(model)  # None without PEFT adapters
        self.role, self.dims, self.trainable = role, dims, trainable
        self.backend = MEGATRON_BACKEND
        self.padding_free = self.shared_prefix = False  # rows are scored padded (no packing, no shared prompts)
        self._hf_config = model.config
        self._kind = "value" if model.__class__.__name__.endswith("ForSequenceClassification") else "causal_lm"
        self._arch = architecture(model.config)
        # EP splits experts: a dense actor is refused; dense critics / reward models beside an MoE actor run unsplit
        check_layout(self._arch, dims.tp, dims.pp, dims.ep if role == "actor" or self._arch.is_moe else 1)
        self._dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
        init_parallel_state(dims, seed)
        from megatron.core import parallel_state as ps

        self._ps = ps
        self._tp_rank = ps.get_tensor_model_parallel_rank()
        self._pp_rank = ps.get_pipeline_model_parallel_rank()
        self._first, self._last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        with cpu_compat():
            self._config = transformer_config(self._arch, tp=dims.tp, pp=dims.pp, dtype=self._dtype,
                                              gradient_checkpointing=gradient_checkpointing and trainable,
                                              ep=dims.ep if self._arch.is_moe else 1,
                                              # Megatron-Core runs an MoE under TP with sequence parallelism only
                                              sequence_parallel=self._arch.is_moe and dims.tp > 1)
            stage = build_stage(self._arch, self._config, role_kind=self._kind, pre_process=self._first,
                                post_process=self._last, tp=dims.tp)
        per_stage = self._arch.num_layers // dims.pp
        moe = dict(num_experts=self._arch.num_experts, ep_size=ps.get_expert_model_parallel_world_size(),
                   ep_rank=ps.get_expert_model_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
                   etp_rank=ps.get_expert_tensor_parallel_rank()) if self._arch.is_moe else {}
        self._ctx = ShardContext(dims.tp, self._tp_rank, self._arch.num_heads, self._arch.num_query_groups,
                                 self._arch.head_dim, self._arch.vocab_size, self._arch.padded_vocab(dims.tp), **moe)
        self._bridge = Bridge(table_for(self._arch.family, self._kind, self._arch.tied), self._ctx,
                              layer_offset=self._pp_rank * per_stage, num_layers=per_stage, first_stage=self._first,
                              last_stage=self._last)
        self._load_hf(stage, peft.base_state if peft is not None else model.state_dict())
        # built on the CPU (use_cpu_initialization); on a GPU machine the stage moves to this rank's device, where
        # Megatron's DDP puts its gradient buffers (torch.cuda.current_device(), set per rank by accelerate)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        stage.to(device=device, dtype=self._dtype)
        self._keep_padding_row(stage, model)
        self._head_plan: Plan | None = None  # the plan whose forward runs now (its scored positions)
        if self._last and self._kind == "causal_lm":
            stage.output_layer.register_forward_pre_hook(self._select_head_rows, with_kwargs=True)
        self._stage = stage
        self._hook_routers(stage)  # a Mixture of Experts' router inputs, for the HF load-balancing loss
        if peft is not None:
            self._attach_lora(peft)  # before DDP: only the adapters get gradient buffers and optimizer state
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
                keep = args[0] != pad
                if keep.shape != output.shape[:2]:  # sequence parallel: this TP rank's [s / tp, b] slice
                    keep = keep.t().chunk(self.dims.tp)[self._tp_rank]
                keep = keep.unsqueeze(-1).to(output.dtype)
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
    def device(self) -> torch.device:
        return next(self._stage.parameters()).device

    @property
    def training(self) -> bool:
        return self._training

    def train(self, mode: bool = True) -> None:
        self._training = mode
        self._stage.train(mode)

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


def _shape_of(batch: Any) -> tuple[int, int]:
    """`(sequence length, rows)` of a micro-batch (the schedule's nominal shapes; the config's variable sequence
    lengths let each micro-batch send its own)."""
    if isinstance(batch, RolloutBatch):
        return batch.prompt_ids.shape[1] + batch.completion_ids.shape[1], batch.batch_size
    if isinstance(batch, dict) and "input_ids" in batch:
        return batch["input_ids"].shape[1], batch["input_ids"].shape[0]
    return 1, 1
