"""`AccelerateEngine`: the training engine over one process, DDP, FSDP2 or DeepSpeed ZeRO-1/2/3.

One class for the four layouts `accelerate launch` offers, chosen by the run's
:class:`~hf_verl.parallel.backend.BackendSpec`:

| backend | trained role | frozen role (reference, reward model) |
|---|---|---|
| plain | the model itself | the model itself |
| ddp | `accelerator.prepare_model` (DistributedDataParallel) | a replica, no wrapper |
| fsdp2 | :func:`~hf_verl.parallel.fsdp.apply_fsdp` over the data-parallel mesh | sharded the same way |
| deepspeed | `deepspeed.initialize` with the trainer's optimizer | ZeRO-3: a partitioned inference engine; ZeRO-1/2: a replica |

On the plain and DDP layouts, which keep fp32 parameters, `bf16` / `fp16` run every forward (and
the LM head) under `torch.autocast` (:mod:`hf_verl.parallel.precision`); fp16, which needs loss scaling,
is refused there for a trained role.

Every forward runs through :attr:`module` (so DDP's and ZeRO's hooks fire and FSDP2's root gathers
its parameters) and the LM / value head is then called as a module on the selected final hidden
states: its weight is never read as a plain tensor, which under FSDP2 would be a shard and under
ZeRO-3 an empty placeholder.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from hf_verl.algorithms.logprobs import logprobs_from_head
from hf_verl.engine.base import TrainingEngine
from hf_verl.engine.hf_layouts import HFLayouts, select_positions
from hf_verl.engine.parts.scoring import TokenStats
from hf_verl.engine.router_loss import global_load_balancing_loss
from hf_verl.parallel.precision import amp_dtype, autocast
from hf_verl.engine.step import OptimizerSpec, SchedulerSpec
from hf_verl.parallel import deepspeed as ds
from hf_verl.parallel.backend import BackendSpec
from hf_verl.parallel.dims import ParallelDims
from hf_verl.parallel.fsdp import apply_fsdp, release_root
from hf_verl.parallel.sharded_load import load_fsdp_shards, pending_checkpoint
from hf_verl.parallel.ulysses import apply_sequence_parallel
from hf_verl.parallel.weight_export import iter_weight_buckets, plain_state_items

logger = logging.getLogger(__name__)

OPTIMIZER_DIR = "optimizer_shards"


def value_head(model: torch.nn.Module) -> torch.nn.Module:
    """The one-output `score` head of a sequence-classification value model (PEFT-wrapped or not)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(base, "score", None)
    if head is None:
        raise TypeError(f"the value model {type(base).__name__} has no `score` head; pass an "
                        "AutoModelForSequenceClassification model with num_labels=1.")
    return head


class AccelerateEngine(HFLayouts, TrainingEngine):
    """A model role trained (or run frozen) on one of accelerate's layouts (see the module docstring).

    Args:
        model (`torch.nn.Module`): a transformers model (or a `PeftModel`), unsharded, on its device; under FSDP2
            also a model from :func:`~hf_verl.parallel.sharded_load.load_sharded` (parameters on the meta device),
            whose shards are read from its checkpoint once sharded; under ZeRO-3 also one already partitioned by it.
        role (`str`): "actor", "critic", "reference" or "reward".
        dims ([`ParallelDims`]): the run's layout.
        backend ([`BackendSpec`]): the run's backend.
        accelerator (`accelerate.Accelerator`, *optional*): prepares DDP (device placement, DDP kwargs,
            autocast); needed for `backend.kind == "ddp"`.
        trainable (`bool`): False for frozen roles (no gradients, eval mode).
        micro_batch_size / gradient_accumulation_steps / max_grad_norm / bf16 / fp16: DeepSpeed's config.
        gradient_checkpointing (`bool`): activation checkpointing (applied before sharding).
        pad_token_id (`int`, *optional*): set on a value model's config when it has none (its forward
            needs one to batch rows).
        padding_free (`bool`, *optional*): see [`TrainingEngine`]: pack rollouts padding-free (`None`: when
            a batch's padding share makes it pay).
        shared_prefix (`bool`, *optional*): see [`TrainingEngine`]: score the rows of one prompt with the prompt
            laid out once (`None`: when the layout's arithmetic makes it pay).
    """

    def __init__(self, model: torch.nn.Module, *, role: str, dims: ParallelDims, backend: BackendSpec,
                 accelerator: Any = None, trainable: bool = True, micro_batch_size: int = 1,
                 gradient_accumulation_steps: int = 1, max_grad_norm: float | None = 1.0, bf16: bool = False,
                 fp16: bool = False, gradient_checkpointing: bool = False, pad_token_id: int | None = None,
                 padding_free: bool | None = None, shared_prefix: bool | None = None) -> None:
        self.role, self.dims, self.backend, self.trainable = role, dims, backend, trainable
        self.padding_free, self.shared_prefix = padding_free, shared_prefix
        self._model = model
        self._module: torch.nn.Module = model
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler = None
        self._spec: OptimizerSpec | None = None
        self.last_grad_norm: float | None = None
        self._ds_config = None
        config = getattr(model, "config", None)
        if pad_token_id is not None and config is not None and getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = pad_token_id
        # the composition order: sequence parallelism, then activation checkpointing, then sharding
        apply_sequence_parallel(model, dims)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        elif gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if config is not None:
                config.use_cache = False
        kind = backend.kind
        pending = pending_checkpoint(model)
        if pending is not None and kind != "fsdp2":
            raise ValueError(f"the {role} model was built without its weights for FSDP2 (its parameters are on the meta "
                             f"device, to be read from {pending}), but the {role} runs on {backend.label}: load it "
                             "with hf_verl.parallel.sharded_load.load_sharded for this layout, or with from_pretrained.")
        low = amp_dtype(bf16, fp16)
        # FSDP2 casts parameters (param_dtype) and DeepSpeed runs its own bf16 / fp16; the rest autocast
        self.autocast_dtype = low if kind in ("plain", "ddp") else None
        if trainable and self.autocast_dtype == torch.float16:
            raise ValueError(f"fp16=True on the {backend.label} layout: fp16 mixed precision needs loss scaling, which "
                             "hf_verl runs through FSDP2 or DeepSpeed only. Use bf16=True (GPUs from Ampere on), an "
                             "FSDP2 or DeepSpeed accelerate config, or full precision.")
        if kind == "ddp" and trainable:
            if accelerator is None:
                raise ValueError("a DDP engine needs the run's accelerate.Accelerator to prepare the model.")
            self._module = accelerator.prepare_model(model)
        elif kind == "fsdp2":
            apply_fsdp(model, dims.fsdp_mesh(), reshard_after_forward=backend.reshard_after_forward,
                       param_dtype=low, reduce_dtype=torch.float32 if low is not None else None,
                       offload_params=backend.offload_params)
            if pending is not None:  # built on the meta device: this rank's shards are read from the checkpoint
                load_fsdp_shards(model, device=_shard_device(dims, backend))
        elif kind == "deepspeed":
            self._ds_config = ds.deepspeed_config(
                backend, micro_batch_size=micro_batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
                max_grad_norm=max_grad_norm, bf16=bf16, fp16=fp16, trainable=trainable)
            if not trainable and backend.zero_stage == 3:
                self._module = ds.initialize(model, self._ds_config)
        logger.info("%s engine: %s%s", role, backend.label, "" if trainable else " (frozen)")

    # ------------------------------------------------------------------ models
    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    @property
    def _is_deepspeed(self) -> bool:
        return self.backend.kind == "deepspeed" and self._module is not self._model

    def _forward(self, input_ids, attention_mask, position_ids):
        kwargs: dict[str, Any] = {"input_ids": input_ids, "output_hidden_states": True, "use_cache": False}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        return kwargs

    # ------------------------------------------------------------------ forward primitives
    def token_logprobs(self, input_ids, targets, select, *, attention_mask=None, position_ids=None,
                       temperature=1.0, chunk_size=1024, with_entropy=False, with_mean_logit=False,
                       with_aux_loss=False, with_log_sum_sq=False, model_inputs=None) -> TokenStats:
        kwargs = self._forward(input_ids, attention_mask, position_ids)
        kwargs.update(model_inputs or {})  # a vision-language model's pixel inputs (hf_verl/engine/vision.py)
        if with_aux_loss:
            kwargs["output_router_logits"] = True
        with self.autocast():
            out = self.module(logits_to_keep=1, **kwargs)
            hidden, targets = select_positions(out.hidden_states[-1], targets, select)
            aux = getattr(out, "aux_loss", None) if with_aux_loss else None
            if with_aux_loss and aux is None:
                raise ValueError(f"the {self.role} model returned no aux_loss with output_router_logits=True: it is "
                                 "not a Mixture-of-Experts model; set router_aux_loss_coef=0.")
            if aux is not None and self.dims.dp_size > 1:  # the loss of every rank's tokens, as one process has it
                aux = global_load_balancing_loss(out.router_logits, aux, self.model.config, attention_mask, self.dims)
            del out
            head = self.model.get_output_embeddings()
            logp, entropy, mean_logit, *sq = logprobs_from_head(
                hidden, head, targets, temperature=temperature, chunk_size=chunk_size,
                with_entropy=with_entropy, with_mean_logit=with_mean_logit, with_log_sum_sq=with_log_sum_sq)
        self._release_after_forward(logp)
        return TokenStats(logp, entropy, mean_logit, aux, sq[0] if sq else None)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context forwards of this engine run in (a no-op in full precision, under
        FSDP2 and under DeepSpeed, which cast parameters themselves)."""
        return autocast(self.device, self.autocast_dtype)

    def _release_after_forward(self, result: torch.Tensor) -> None:
        """An FSDP2 root stays gathered after its forward for the backward; without one, reshard it now."""
        if self.backend.kind == "fsdp2" and not result.requires_grad:
            release_root(self._model)

    def _value_head(self) -> torch.nn.Module:
        return value_head(self.model)

    def token_values(self, input_ids, select, *, attention_mask=None, position_ids=None) -> torch.Tensor:
        with self.autocast():
            out = self.module(**self._forward(input_ids, attention_mask, position_ids))
            hidden = select_positions(out.hidden_states[-1], None, select)[0]
            del out
            values = value_head(self.model)(hidden).float()
        if values.shape[-1] != 1:
            raise ValueError(f"the {self.role}'s score head has {values.shape[-1]} outputs; it needs num_labels=1.")
        self._release_after_forward(values)
        return values.squeeze(-1)

    def forward(self, **kwargs: Any) -> Any:
        """The model's own forward through :attr:`module` (a frozen role such as a reward model); an
        FSDP2 root gathered by a forward without backward is resharded afterwards."""
        with self.autocast():
            out = self.module(**kwargs)
        if self.backend.kind == "fsdp2" and not torch.is_grad_enabled():
            release_root(self._model)
        return out

    # ------------------------------------------------------------------ the step
    @property
    def training(self) -> bool:
        return self._model.training

    def train(self, mode: bool = True) -> None:
        self.module.train(mode and self.trainable)

    def configure_optimizer(self, spec: OptimizerSpec) -> None:
        if not self.trainable:
            raise ValueError(f"the {self.role} engine is frozen; it takes no optimizer.")
        if self._optimizer is not None:
            raise RuntimeError(f"the {self.role} engine already has an optimizer.")
        self._spec = spec
        self._optimizer = spec.build(list(self._model.named_parameters()))
        if self.backend.kind == "deepspeed":
            self._module = ds.initialize(self._model, self._ds_config, self._optimizer)
        self.configure_scheduler(spec.scheduler, spec.lr_scheduler)

    def configure_scheduler(self, spec: SchedulerSpec | None = None, scheduler: Any = None) -> None:
        if self._optimizer is None:
            raise RuntimeError(f"the {self.role} engine has no optimizer: call configure_optimizer() first.")
        if scheduler is None and spec is not None:
            scheduler = spec.build(self._schedulable_optimizer())
        self._scheduler = scheduler

    def _schedulable_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer an LR schedule is built over: DeepSpeed steps its own (wrapped) optimizer, whose param
        groups are the ones to schedule; accelerate's wrapper presents it as a `torch.optim.Optimizer`."""
        if self._is_deepspeed:
            from accelerate.utils import DeepSpeedOptimizerWrapper

            return DeepSpeedOptimizerWrapper(self._module.optimizer)
        return self._optimizer

    @property
    def has_optimizer(self) -> bool:
        return self._optimizer is not None

    def _backward(self, loss: torch.Tensor) -> None:
        if self.dims.sp > 1:
            # each rank of a sequence-parallel group backpropagates only its own shard's tokens, so the full
            # gradient is the sum over the group; DDP / DeepSpeed (over the world) and FSDP2 (over dp x sp)
            # average over the group instead: scaling by sp turns that mean into the sum
            loss = loss * self.dims.sp
        if self._is_deepspeed:
            self._module.backward(loss, scale_wrt_gas=False)
            self._module.step()  # a no-op before the accumulation boundary
        elif self.backend.kind == "deepspeed":
            raise RuntimeError(f"the {self.role} DeepSpeed engine has no optimizer yet: call configure_optimizer().")
        else:
            loss.backward()

    def _trained_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad and p.grad is not None]

    def _clip_grad_norm(self, max_norm: float | None) -> float:
        """Global gradient norm over all ranks (FSDP2 shards reduced) before clipping to `max_norm`."""
        if self._is_deepspeed:  # DeepSpeed clips inside its step (gradient_clipping) and keeps the norm
            norm = self._module.get_global_grad_norm()
            return float("nan") if norm is None else float(norm)
        params = self._trained_params()
        if not params:
            return 0.0
        limit = max_norm if max_norm and max_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        from torch.distributed.tensor import DTensor

        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def optimizer_step(self) -> float | None:
        if self._optimizer is None:
            raise RuntimeError(f"the {self.role} engine has no optimizer: call configure_optimizer() first.")
        norm = self._clip_grad_norm(self._spec.max_grad_norm)
        if not self._is_deepspeed:  # DeepSpeed stepped at its accumulation boundary, inside the last backward
            self._optimizer.step()
            self.zero_grad()
        if self._scheduler is not None:
            self._scheduler.step()
        self.last_grad_norm = norm
        return norm

    def zero_grad(self) -> None:
        if not self._is_deepspeed and self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)

    @property
    def param_groups(self) -> list[dict]:
        if self._optimizer is None:
            return []
        return self._schedulable_optimizer().param_groups if self._is_deepspeed else self._optimizer.param_groups

    def optimizer_state_dict(self) -> dict:
        return self._optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        self._optimizer.load_state_dict(state)

    def scheduler_state_dict(self) -> dict | None:
        return None if self._scheduler is None else self._scheduler.state_dict()

    def load_scheduler_state_dict(self, state: dict) -> None:
        if self._scheduler is not None:
            self._scheduler.load_state_dict(state)

    def last_lr(self) -> list[float]:
        if self._scheduler is not None:
            return list(self._scheduler.get_last_lr())
        return [group["lr"] for group in self.param_groups]

    def no_sync(self) -> contextlib.AbstractContextManager:
        if self.backend.kind == "ddp" and hasattr(self._module, "no_sync"):
            return self._module.no_sync()
        if self.backend.kind == "fsdp2":
            return _fsdp_no_sync(self._model)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ weights
    def export_weights(self, bucket_bytes: int, *, dtype: torch.dtype | None = None,
                       to_cpu: bool = False, lora: str = "merged") -> Iterator[list[tuple[str, torch.Tensor]]]:
        return iter_weight_buckets(self._model, bucket_bytes, dtype=dtype, to_cpu=to_cpu, lora=lora)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's own state dict (PEFT keys included), whole, on the main rank; a collective."""
        out = {}
        for name, tensor in plain_state_items(self._model):
            if self.dims.is_main:
                out[name] = tensor.detach().to("cpu", copy=True)
        return out

    def save_pretrained(self, output_dir: str, **kwargs: Any) -> None:
        """`save_pretrained` of the whole model on the main rank (a collective for sharded layouts)."""
        state = self.full_state_dict() if self.backend.partitions_parameters else None
        if self.dims.is_main:
            self._model.save_pretrained(output_dir, state_dict=state, safe_serialization=True, **kwargs)

    def save_checkpoint(self, output_dir: str) -> None:
        """Optimizer and schedule state for resuming: DeepSpeed's own checkpoint, FSDP2's optimizer shards through
        `torch.distributed.checkpoint` (one per rank), else one file on the main rank; a collective."""
        if self._optimizer is None:
            return
        os.makedirs(output_dir, exist_ok=True)
        if self._is_deepspeed:
            self._module.save_checkpoint(os.path.join(output_dir, OPTIMIZER_DIR), tag=self.role)
        elif self.backend.kind == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            state = {"optimizer": get_optimizer_state_dict(self._model, self._optimizer)}
            dcp.save(state, checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR, self.role))
        elif self.dims.is_main:
            torch.save(self._optimizer.state_dict(), os.path.join(output_dir, f"{self.role}_optimizer.pt"))
        if self.dims.is_main and self._scheduler is not None:
            torch.save(self._scheduler.state_dict(), os.path.join(output_dir, f"{self.role}_scheduler.pt"))

    def load_checkpoint(self, input_dir: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (the schedule when it was saved)."""
        if self._optimizer is None:
            return
        if self._is_deepspeed:
            self._module.load_checkpoint(os.path.join(input_dir, OPTIMIZER_DIR), tag=self.role)
        elif self.backend.kind == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (
                get_optimizer_state_dict,
                set_optimizer_state_dict,
            )

            state = {"optimizer": get_optimizer_state_dict(self._model, self._optimizer)}
            dcp.load(state, checkpoint_id=os.path.join(input_dir, OPTIMIZER_DIR, self.role))
            set_optimizer_state_dict(self._model, self._optimizer, state["optimizer"])
        else:
            path = os.path.join(input_dir, f"{self.role}_optimizer.pt")
            if not os.path.exists(path):
                raise FileNotFoundError(f"no {self.role} optimizer state in {input_dir}.")
            self._optimizer.load_state_dict(torch.load(path, map_location=self.device, weights_only=True))
        schedule = os.path.join(input_dir, f"{self.role}_scheduler.pt")
        if self._scheduler is not None and os.path.exists(schedule):
            self._scheduler.load_state_dict(torch.load(schedule, weights_only=True))

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole, HF-named weights into the (possibly sharded) model; a collective when sharded."""
        if self.backend.kind == "fsdp2":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            set_model_state_dict(self._model, state, options=StateDictOptions(full_state_dict=True, strict=False))
            return
        if self._is_deepspeed and self.backend.zero_stage == 3:
            params = dict(self._model.named_parameters())
            for name, tensor in state.items():
                param = params.get(name)
                if param is None:
                    continue
                from deepspeed.runtime.zero.partition_parameters import (
                    GatheredParameters,
                )

                with GatheredParameters([param], modifier_rank=0):
                    if self.dims.is_main:
                        param.data.copy_(tensor.to(param.dtype))
            return
        missing, unexpected = self._model.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"{self.role} weights have keys the model lacks: {unexpected[:5]}")


def _shard_device(dims: ParallelDims, backend: BackendSpec) -> torch.device:
    """Where FSDP2 keeps a rank's parameter shards: the CPU under parameter offload or on a CPU mesh, else the
    rank's current accelerator."""
    if backend.offload_params or dims.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(dims.device_type, torch.cuda.current_device())


@contextlib.contextmanager
def _fsdp_no_sync(model: torch.nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
