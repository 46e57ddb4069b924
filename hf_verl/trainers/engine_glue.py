"""`EngineTrainerMixin`: `transformers.Trainer` on hf_verl's training engines.

The TRL-style trainers keep `transformers.Trainer`'s loop (data, callbacks, logging, checkpoint
schedule, resume) and give it the actor's engine as the module it trains (an
:class:`~hf_verl.engine.module.EngineModule`), so that the layout (DDP, FSDP2, ZeRO) is chosen and
applied once, by the engine, whatever launched the run. The Trainer has no public hooks for a
model it did not wrap itself, so this mixin overrides the few private methods that touch it:
`_wrap_model` (hand over the engine), and, for sharded layouts only, `_load_from_checkpoint`,
`_save_optimizer_and_scheduler` and `_load_optimizer_and_scheduler` (every rank saves and loads its
own shard; the Trainer's defaults save rank 0's state only). Everything else is public API.

Also here, shared by every trainer: loading a model given by id with TRL's defaults
(:func:`load_pretrained`), and the Hub tags a trainer puts on its model (`_tag_names`, as TRL's
trainers do; they end up in the model card).
"""

from __future__ import annotations

import logging
import os

from hf_verl.engine.accelerate_engine import AccelerateEngine
from hf_verl.engine.module import EngineModule
from hf_verl.parallel.backend import BackendSpec, resolve_backend
from hf_verl.parallel.dims import ParallelDims
from hf_verl.trainers.rollout_args import RolloutArguments

logger = logging.getLogger(__name__)


_DTYPE_NAMES = ("bfloat16", "float16", "float32")


def load_pretrained(model_id: str, model_init_kwargs: dict | None = None, *, trust_remote_code: bool = False,
                    auto_class=None):
    """`auto_class.from_pretrained(model_id, **model_init_kwargs)` with TRL's defaults: float32 unless
    `model_init_kwargs` names a `dtype` (a `torch.dtype`, one of 'bfloat16' / 'float16' / 'float32', or
    'auto' for the checkpoint's own), and `trust_remote_code` from the config unless given there.

    Raises:
        ValueError: an unknown `dtype` string.
    """
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = dict(model_init_kwargs or {})  # a copy: the config's dict is not changed
    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES:
        kwargs["dtype"] = getattr(torch, dtype)
    elif not (dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype)):
        raise ValueError(f"model_init_kwargs['dtype'] must be a torch.dtype, 'auto' or one of {_DTYPE_NAMES}, "
                         f"got {dtype!r}.")
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    return (auto_class or AutoModelForCausalLM).from_pretrained(model_id, **kwargs)


def launch_layout(num_processes: int, sequence_parallel_size: int = 1) -> tuple[BackendSpec, ParallelDims]:
    """The run's backend (checked against the machine) and its `ParallelDims` (with the `sp` axis of
    `sequence_parallel_size`; the processes it leaves are data-parallel ranks)."""
    import torch.distributed as dist

    from hf_verl.parallel.dims import _world_and_rank

    world, _ = _world_and_rank()
    ready = dist.is_available() and dist.is_initialized()
    backend = resolve_backend(world, ready and num_processes == world)
    return backend, ParallelDims.from_environment(shard=backend.shards, sp=sequence_parallel_size)


class EngineTrainerMixin:
    """Mixed into a `transformers.Trainer` subclass; call :meth:`_init_engines` after `Trainer.__init__`.

    A subclass names its Hub tags in `_tag_names` (TRL's attribute: e.g. `["trl", "grpo"]`); they are added
    to the trained model (`model.model_tags`, written to the model card on save and push).
    """

    _tag_names: list[str] = []

    def _init_engines(self, backend: BackendSpec | None = None, dims: ParallelDims | None = None) -> None:
        if backend is None or dims is None:
            backend, dims = launch_layout(self.accelerator.num_processes,
                                          getattr(self.args, "sequence_parallel_size", 1))
        self.backend, self.dims = backend, dims
        self._add_model_tags(self.model)
        # the engine lays the model out; the Trainer must not also run its own FSDP / DeepSpeed path (which
        # accelerate engages on GPU machines from the same launch config)
        self.is_fsdp_enabled = self.is_deepspeed_enabled = False
        self.actor = self._make_engine(self.model, "actor", trainable=True)
        self._engine_module = EngineModule(self.actor)
        self.model_wrapped = self._engine_module

    def _over_data_parallel_ranks(self, dataloader):
        """`dataloader` (prepared by accelerate over every process) dealt over the data-parallel ranks instead: the
        ranks of one sequence-parallel group read the same batches. As transformers does for its rank-aware batch
        samplers, the shard wrapper's process count and index are set (here to the data-parallel ones)."""
        if self.dims.sp == 1:
            return dataloader
        from accelerate.data_loader import BatchSamplerShard

        shard = getattr(dataloader, "batch_sampler", None)
        if not isinstance(shard, BatchSamplerShard):
            raise ValueError("sequence_parallel_size > 1 needs a map-style dataset (a datasets.Dataset), dealt in "
                             "batches over the data-parallel ranks; an iterable dataset is not supported.")
        shard.num_processes, shard.process_index = self.dims.dp_size, self.dims.dp_rank
        return dataloader

    def _add_model_tags(self, model) -> None:
        # transformers models (and PEFT models, which forward to them) carry tags; other modules have none
        if self._tag_names and callable(getattr(model, "add_model_tags", None)):
            model.add_model_tags(list(self._tag_names))

    def _make_engine(self, model, role: str, *, trainable: bool, **kwargs) -> AccelerateEngine:
        args = self.args
        return AccelerateEngine(
            model, role=role, dims=self.dims, backend=self.backend, accelerator=self.accelerator,
            trainable=trainable, micro_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=args.max_grad_norm,
            bf16=bool(args.bf16), fp16=bool(args.fp16),
            gradient_checkpointing=trainable and bool(args.gradient_checkpointing),
            # rollouts' packing (DPO's `padding_free` is its collator's, a different switch)
            padding_free=args.padding_free if isinstance(args, RolloutArguments) else None,
            shared_prefix=getattr(args, "shared_prefix", None), **kwargs)

    # ------------------------------------------------------------------ the Trainer's model and optimizer
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # transformers.Trainer wraps (DDP / FSDP / DeepSpeed) what this returns unless it is already a
        # wrapper: the engine has laid the model out, so it is handed over as it is
        return self._engine_module

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if self.actor.optimizer is None:
            optimizer = self.actor.attach_optimizer(optimizer)
            if self.backend.kind == "deepspeed":
                # DeepSpeed's optimizer is stepped by the engine; accelerate must not re-wrap (and re-place)
                # the no-op wrapper the Trainer steps: accelerate's own "already prepared" marker
                optimizer._is_accelerate_prepared = True
            self.optimizer = optimizer
        return self.optimizer

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self.backend.partitions_parameters:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        state = self.actor.full_state_dict()  # a collective: every rank gathers, the main rank keeps
        if self.args.should_save:
            self._save(output_dir, state_dict=state)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not self.backend.partitions_parameters:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from safetensors.torch import load_file

        path = os.path.join(resume_from_checkpoint, "model.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no model.safetensors in {resume_from_checkpoint} to resume the sharded actor from.")
        self.actor.load_full_state_dict(load_file(path))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.backend.shards:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.actor.save_state(output_dir)  # every rank its shard
        if self.args.should_save and self.lr_scheduler is not None:
            import torch

            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None or not self.backend.shards:
            return super()._load_optimizer_and_scheduler(checkpoint)
        import torch

        self.actor.load_state(checkpoint)
        path = os.path.join(checkpoint, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.exists(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _engine_grad_norm(self, logs: dict) -> None:
        """DeepSpeed clips inside its own step, so the Trainer's `grad_norm` reads 0: report the engine's."""
        if self.backend.kind == "deepspeed" and "grad_norm" in logs and self.actor.trainable:
            norm = self.actor.clip_grad_norm(None)
            if norm == norm:  # not NaN
                logs["grad_norm"] = norm
