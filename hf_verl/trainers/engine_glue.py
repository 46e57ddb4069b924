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
(:func:`load_pretrained`), or, under a launch that shards parameters (FSDP2 / ZeRO-3 over 2+ processes),
so that each rank reads only its own shards (:func:`load_for_launch`, see docs/loading.md), and the Hub tags a trainer puts on its model (`_tag_names`, as TRL's
trainers do; they end up in the model card).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from hf_verl.engine.base import TrainingEngine
from hf_verl.engine.module import EngineModule
from hf_verl.engine.registry import RoleLayout, launch_role_layout
from hf_verl.engine.step import OptimizerSpec, SchedulerSpec, StepResult
from hf_verl.parallel import watchdog
from hf_verl.pipeline.role_builder import RoleBuilder
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
    if auto_class is None:
        auto_class = _image_text_class(model_id, kwargs["trust_remote_code"]) or AutoModelForCausalLM
    model = auto_class.from_pretrained(model_id, **kwargs)
    if kwargs.get("quantization_config") is not None:  # QLoRA: its 4-bit layers must stay trainable on the CPU
        from hf_verl.trainers.quantization import keep_kbit_layers_trainable

        keep_kbit_layers_trainable(model)
    return model


def _image_text_class(model_id: str, trust_remote_code: bool):
    """`AutoModelForImageTextToText` for a vision-language checkpoint that `AutoModelForCausalLM` does not map
    (Qwen2-VL, LLaVA, SmolVLM, ...: TRL loads them so), else None."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code)
    if getattr(config, "vision_config", None) is None or config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    return AutoModelForImageTextToText


def load_for_launch(model_id: str, model_init_kwargs: dict | None, args: Any, *, trust_remote_code: bool = False,
                    auto_class=None, load_whole=None):
    """A model given by id, loaded for the launch's layout: under FSDP2 or ZeRO-3 over 2 or more data-parallel
    shards through :func:`~hf_verl.parallel.sharded_load.load_sharded` (no rank holds the whole model; its engine
    fills or takes it as it is), else :func:`load_pretrained`. `model_init_kwargs` other than `dtype` /
    `trust_remote_code` (a quantization config, an attention implementation, ...) need `from_pretrained`: the model
    is then loaded whole, and the log says so. `dtype="auto"` loads sharded in the checkpoint config's dtype.
    `load_whole` (*optional*, a callable of `model_id`) replaces :func:`load_pretrained` where the model loads whole.

    Raises:
        ValueError: an unknown `dtype` string.
    """
    from hf_verl.parallel.sharded_load import load_sharded, sharded_load_applies

    layout = launch_layout(args.world_size, args)
    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.pop("dtype", "float32")
    trust_remote_code = kwargs.pop("trust_remote_code", trust_remote_code)
    def whole():
        if load_whole is not None:
            return load_whole(model_id)
        return load_pretrained(model_id, model_init_kwargs, trust_remote_code=trust_remote_code, auto_class=auto_class)

    if not sharded_load_applies(layout):
        return whole()
    if kwargs:
        logger.info("loading %s whole on every rank (model_init_kwargs %s need from_pretrained; sharded loading takes "
                    "a dtype only)", model_id, sorted(kwargs))
        return whole()
    if dtype is None or dtype == "auto":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code)
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"model_init_kwargs['dtype'] must be a torch.dtype, 'auto' or one of {_DTYPE_NAMES}, "
                             f"got {dtype!r}.")
        dtype = getattr(torch, dtype)
    return load_sharded(model_id, layout, auto_class=auto_class, dtype=dtype, trust_remote_code=trust_remote_code,
                        bf16=bool(getattr(args, "bf16", False)), fp16=bool(getattr(args, "fp16", False)))


def launch_layout(num_processes: int, args: Any) -> RoleLayout:
    """The launch's default :class:`~hf_verl.engine.registry.RoleLayout` for a trainer config: the launch's
    backend (checked against the machine), or Megatron with `backend="megatron"`, and its `ParallelDims` with the
    config's `sequence_parallel_size`, `tensor_model_parallel_size` and `pipeline_model_parallel_size`."""
    return launch_role_layout(num_processes, sequence_parallel_size=getattr(args, "sequence_parallel_size", 1),
                              tensor_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
                              pipeline_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
                              expert_parallel_size=getattr(args, "expert_model_parallel_size", 1) or 1,
                              engine="megatron" if getattr(args, "backend", None) == "megatron" else None)


class EngineOptimizer:
    """The optimizer a `transformers.Trainer` steps: the engine's own (built from an
    :class:`~hf_verl.engine.step.OptimizerSpec`), reached through the engine's interface. `step()` is the
    engine's :meth:`~hf_verl.engine.base.TrainingEngine.optimizer_step` (global norm, clipping, optimizer, LR
    schedule); the norm it returns fills the tensor :meth:`pending_norm` handed to the Trainer's logging."""

    _is_accelerate_prepared = True  # accelerate must not wrap it: the engine steps its own optimizer

    def __init__(self, engine: TrainingEngine, after_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._norm: torch.Tensor | None = None
        self._after_step = after_step  # the trainer's work once the weights moved (in-flight weight updates)

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.param_groups

    @property
    def defaults(self) -> dict:
        return {}

    def pending_norm(self) -> torch.Tensor:
        """A 0-d tensor the next `step()` fills with the gradient norm (NaN if the backend reports none)."""
        self._norm = torch.full((), float("nan"), dtype=torch.float64)
        return self._norm

    def step(self, closure=None) -> None:
        with watchdog.phase("optimizer_step", role=self.engine.role):
            norm = self.engine.optimizer_step()
        if self._norm is not None:
            self._norm.fill_(float("nan") if norm is None else norm)
            self._norm = None
        if self._after_step is not None:
            self._after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_dict(self) -> dict:
        return self.engine.optimizer_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_optimizer_state_dict(state)


class EngineSchedule:
    """The LR schedule a `transformers.Trainer` steps: the engine's own, which
    :meth:`~hf_verl.engine.base.TrainingEngine.optimizer_step` already stepped, so `step()` does nothing here."""

    def __init__(self, engine: TrainingEngine) -> None:
        self.engine = engine

    def step(self, *args, **kwargs) -> None:
        """The engine stepped its schedule with its optimizer."""

    def get_last_lr(self) -> list[float]:
        return self.engine.last_lr()

    def state_dict(self) -> dict:
        return self.engine.scheduler_state_dict() or {}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_scheduler_state_dict(state)


def optimizer_spec(trainer, model) -> OptimizerSpec:
    """The :class:`OptimizerSpec` of a Trainer's arguments, as `transformers.Trainer.create_optimizer` would build
    the optimizer: `optim` (or the Trainer's `optimizer_cls_and_kwargs`), transformers' decay / no-decay groups,
    `max_grad_norm`."""
    args = trainer.args
    if trainer.optimizer_cls_and_kwargs is not None:
        cls, kwargs = trainer.optimizer_cls_and_kwargs
    else:
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
    kwargs = dict(kwargs)
    for key in ("params", "model", "optimizer_dict"):
        if key in kwargs:
            raise ValueError(f"optim={args.optim!r} builds its optimizer over the model itself ({key}=), which an "
                             "hf_verl engine cannot lay out; choose a torch optimizer such as adamw_torch.")
    return OptimizerSpec(cls, kwargs, weight_decay=args.weight_decay,
                         decay_parameter_names=set(trainer.get_decay_parameter_names(model)),
                         max_grad_norm=args.max_grad_norm)


def scheduler_spec(args, num_training_steps: int) -> SchedulerSpec:
    """The LR schedule of a Trainer's arguments over `num_training_steps` optimizer steps."""
    return SchedulerSpec(args.lr_scheduler_type, args.get_warmup_steps(num_training_steps), num_training_steps,
                         dict(args.lr_scheduler_kwargs or {}))


class EngineTrainerMixin:
    """Mixed into a `transformers.Trainer` subclass; call :meth:`_init_engines` after `Trainer.__init__`.

    The Trainer's loop stays the Trainer's (data, callbacks, logging, checkpoint schedule, resume), but each
    optimizer step is the engine's: :meth:`get_batch_samples` keeps the accumulation window the Trainer has just
    drawn, the window's first `training_step` hands the whole window to :meth:`_train_window` (a subclass runs
    it through `engine.forward_backward`), the later ones return its per-micro-batch losses, and the optimizer
    and LR schedule the Trainer steps are the engine's (:class:`EngineOptimizer`, :class:`EngineSchedule`).

    A subclass names its Hub tags in `_tag_names` (TRL's attribute: e.g. `["trl", "grpo"]`); they are added
    to the trained model (`model.model_tags`, written to the model card on save and push).
    """

    _tag_names: list[str] = []
    _layout_logged: bool = False
    _window: list | None = None
    _window_losses: list | None = None
    _window_pos: int = 0

    def train(self, *args, **kwargs):
        """`transformers.Trainer.train`, after one INFO line naming the layout each role runs on."""
        if not self._layout_logged and self.is_world_process_zero():
            from hf_verl.engine.registry import describe_layout

            roles = {name: getattr(self, name, None) for name in ("actor", "critic", "reference")}
            logger.info("hf_verl layout: %s", describe_layout(roles, getattr(self, "engine", None)))
        self._layout_logged = True
        return super().train(*args, **kwargs)

    def supported_parallelisms(self, reasons: bool = False) -> list[str] | dict[str, str]:
        """The parallelisms this installation and machine can run now: "data" (DDP), "fsdp" (FSDP2),
        "zero" (DeepSpeed), "sequence", "tensor", "pipeline"; the facade's answer, from the same checks
        (:func:`hf_verl.planner.capabilities.supported_parallelisms`).

        Args:
            reasons (`bool`): return `{name: reason}` for every parallelism instead, the reason saying
                what it runs on or why it cannot run (missing backend, too few devices).
        """
        from hf_verl.planner.capabilities import supported_parallelisms

        return supported_parallelisms(reasons)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | list[str] | None = None,
                          tags: str | list[str] | None = None, **kwargs) -> None:
        """Write the model card (`README.md` in `output_dir`), taking TRL's arguments as TRL's trainers do.

        `trainer.push_to_hub(dataset_name=...)` passes its keyword arguments here; TRL names the dataset
        `dataset_name`, transformers `dataset`. Both are accepted; the trainer's Hub tags are always added.

        Args:
            model_name (`str`, *optional*): the model's name on the card.
            dataset_name (`str` or `list[str]`, *optional*): the dataset(s) trained on (TRL's name).
            tags (`str` or `list[str]`, *optional*): tags beside the trainer's own (`_tag_names`).
            kwargs: the rest of `transformers.Trainer.create_model_card`'s arguments (`language`, `license`, ...).
        """
        if dataset_name is not None:
            if kwargs.get("dataset") is not None:
                raise ValueError("create_model_card: pass the dataset as dataset_name (TRL) or dataset (transformers), "
                                 "not both.")
            kwargs["dataset"] = dataset_name
        extra = [tags] if isinstance(tags, str) else list(tags or [])
        merged = list(dict.fromkeys([*self._tag_names, *extra]))
        return super().create_model_card(model_name=model_name, tags=merged or None, **kwargs)

    def _role_builder(self, args: Any, layout: RoleLayout, *, has_reference: bool | None, has_critic: bool = False
                      ) -> RoleBuilder:
        """The run's :class:`~hf_verl.pipeline.role_builder.RoleBuilder` (the facade's too), on the launch's layout
        and the config's `placement`, checked against the roles this trainer has. The accelerator is attached by
        :meth:`_init_engines`, once the Trainer has made it."""
        from hf_verl.engine.registry import ENGINES
        from hf_verl.pipeline.placement import check_placement
        from hf_verl.trainers.model_parallel_args import TRL_ARGUMENTS

        placement = check_placement(getattr(args, "placement", None), has_reference=has_reference,
                                    has_critic=has_critic, world_size=layout.dims.world_size, engines=tuple(ENGINES),
                                    roles=getattr(args, "_placement_roles", ("reference",)), arguments=TRL_ARGUMENTS,
                                    owner=f"{type(args).__name__}.placement")
        return RoleBuilder(layout, placement, accelerator=None, engine_options=self._engine_options)

    def _init_engines(self, builder: RoleBuilder) -> None:
        """After `Trainer.__init__`: the actor's engine, laid out by the role builder."""
        builder.accelerator = self.accelerator
        self.roles_builder = builder
        self.layout = builder.launch
        self.backend, self.dims = self.layout.backend, self.layout.dims
        self._add_model_tags(self.model)
        # the engine lays the model out; the Trainer must not also run its own FSDP / DeepSpeed path (which
        # accelerate engages on GPU machines from the same launch config)
        self.is_fsdp_enabled = self.is_deepspeed_enabled = False
        self.actor = self._make_engine(self.model, "actor", trainable=True)
        self._engine_module = EngineModule(self.actor)
        self.model_wrapped = self._engine_module
        # a rank stalled past ddp_timeout is named instead of hanging; the process group is left cleanly at exit
        watchdog.start(self.args.ddp_timeout)

    def _over_data_parallel_ranks(self, dataloader):
        """`dataloader` (prepared by accelerate over every process) dealt over the data-parallel ranks instead: the
        ranks of one data-parallel replica (sequence, tensor or pipeline peers) read the same batches. As
        transformers does for its rank-aware batch samplers, the shard wrapper's process count and index are set
        (here to the data-parallel ones).

        The shuffled order is seeded with `data_seed`, else `seed` (what transformers documents, and what a
        one-process run gets from `Trainer.__init__`'s `set_seed`), not with the global RNG's seed at the time the
        dataloader is built, which an engine may have changed since (Megatron-Core seeds its model-parallel RNG
        on start): so every layout reads the same global sequence of rows for the same seed."""
        from accelerate.data_loader import SeedableRandomSampler, get_sampler

        sampler = get_sampler(dataloader) if hasattr(dataloader, "sampler") else None
        if isinstance(sampler, SeedableRandomSampler):
            sampler.initial_seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        if self.dims.replica_size == 1:
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

    def _make_engine(self, model, role: str, *, trainable: bool, **kwargs) -> TrainingEngine:
        """`role`'s engine over `model`, on its layout (the launch's, or its placement's), by the role builder."""
        return self.roles_builder.engine(model, role, trainable=trainable, **kwargs)

    def _engine_options(self, role: str, trainable: bool) -> dict:
        """The engine options of a role from the Trainer's arguments (mixed precision, micro-batch, clipping,
        checkpointing of trained roles, the rollouts' packing switches)."""
        args = self.args
        return dict(seed=args.seed, micro_batch_size=args.per_device_train_batch_size,
                    gradient_accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=args.max_grad_norm,
                    bf16=bool(args.bf16), fp16=bool(args.fp16),
                    gradient_checkpointing=trainable and bool(args.gradient_checkpointing),
                    # rollouts' packing (DPO's `padding_free` is its collator's, a different switch)
                    padding_free=args.padding_free if isinstance(args, RolloutArguments) else None,
                    shared_prefix=getattr(args, "shared_prefix", None))

    # ------------------------------------------------------------------ the Trainer's model, optimizer and step
    def _move_model_to_device(self, model, device) -> None:
        # a model loaded sharded (meta parameters under FSDP2, ZeRO-3 partitions) is placed by its engine
        from hf_verl.parallel.sharded_load import loaded_sharded

        if not loaded_sharded(model):
            super()._move_model_to_device(model, device)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # transformers.Trainer wraps (DDP / FSDP / DeepSpeed) what this returns unless it is already a
        # wrapper: the engine has laid the model out, so it is handed over as it is
        return self._engine_module

    def create_optimizer(self, model=None):
        """The actor engine builds its optimizer from the Trainer's arguments (:func:`optimizer_spec`); a user's
        optimizer (`optimizers=(optimizer, scheduler)`) is adopted by the engine as it is."""
        if not self.actor.has_optimizer:
            if self.optimizer is not None and not isinstance(self.optimizer, EngineOptimizer):
                spec = OptimizerSpec(optimizer=self.optimizer, max_grad_norm=self.args.max_grad_norm)
            else:
                spec = optimizer_spec(self, self.model)
            self.actor.configure_optimizer(spec)
        self.optimizer = EngineOptimizer(self.actor, after_step=self._after_optimizer_step)
        return self.optimizer

    def _after_optimizer_step(self) -> None:
        """Runs right after each optimizer step of the actor (nothing by default)."""

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The actor engine's LR schedule (the user's, when given with `optimizers=`), stepped by the engine."""
        if not isinstance(self.lr_scheduler, EngineSchedule):
            if self.lr_scheduler is not None:
                self.actor.configure_scheduler(scheduler=self.lr_scheduler)
            else:
                self.actor.configure_scheduler(scheduler_spec(self.args, num_training_steps))
                self._created_lr_scheduler = True
            self.lr_scheduler = EngineSchedule(self.actor)
        return self.lr_scheduler

    def _clip_grad_norm(self, model):
        # the engine clips inside its optimizer_step (the global norm over every shard); the norm is filled in then
        return self.optimizer.pending_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm if grad_norm is not None else self.optimizer.pending_norm()

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The Trainer's accumulation window (the micro-batches of one optimizer step), kept for
        :meth:`training_step`, which hands it to the engine whole."""
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._window, self._window_losses, self._window_pos = list(batch_samples), None, 0
        return batch_samples, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The loss of one micro-batch of the window; the window's first call runs the whole window through the
        engine (:meth:`_train_window`). A call outside a window (a direct call) is a window of its own."""
        window = self._window
        if window is None or self._window_pos >= len(window) or window[self._window_pos] is not inputs:
            window, self._window, self._window_pos = [inputs], None, 0
        if self._window_pos == 0:
            watchdog.set_step(self.state.global_step + 1)
            self._window_losses = self._train_window(window)
        loss = self._window_losses[self._window_pos]
        self._window_pos += 1
        if self._window is None:
            self._window_losses = None
        return loss

    def _train_window(self, window: list) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch of `window` through the engines; returns each micro-batch's
        loss as the Trainer logs it (divided by the accumulation steps)."""
        raise NotImplementedError

    def _window_losses_of(self, *results: StepResult) -> list[torch.Tensor]:
        """Per micro-batch, the sum over the roles' step results, divided by the accumulation steps."""
        scale = 1.0 / self.current_gradient_accumulation_steps
        n = max(len(r.losses) for r in results)
        device = self.args.device
        return [sum((r.losses[i].to(device) for r in results if i < len(r.losses)),
                    torch.zeros((), device=device)) * scale for i in range(n)]

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self.backend.partitions_parameters:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.backend.kind == "megatron" and self.actor.has_adapters:
            # a LoRA actor: its adapters only, under the PeftModel's own keys, which PEFT's save_pretrained writes
            # as an adapter directory (as for a PEFT actor on the other backends)
            state = self.actor.adapter_state_dict(adapter_name=self.model.active_adapter)
        else:
            state = self.actor.full_state_dict()  # a collective: every rank gathers, the main rank keeps
        if self.args.should_save:
            self._save(output_dir, state_dict=state)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not self.backend.partitions_parameters:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.backend.kind == "megatron" and self.actor.has_adapters:
            return  # a LoRA actor's base shards and adapters come back with its per-rank checkpoint
        from safetensors.torch import load_file

        path = os.path.join(resume_from_checkpoint, "model.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no model.safetensors in {resume_from_checkpoint} to resume the sharded actor from.")
        self.actor.load_full_state_dict(load_file(path))

    def _rank_local_optimizer(self) -> bool:
        """Whether each rank holds its own part of the optimizer state (FSDP2, ZeRO, Megatron's tensor / pipeline
        shards and distributed optimizer): checkpoints are then written per rank by the engine."""
        return self.backend.shards or self.backend.kind == "megatron"

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._rank_local_optimizer():
            return super()._save_optimizer_and_scheduler(output_dir)
        self.actor.save_checkpoint(output_dir)  # every rank its shard, and the schedule

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None or not self._rank_local_optimizer():
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.actor.load_checkpoint(checkpoint)
