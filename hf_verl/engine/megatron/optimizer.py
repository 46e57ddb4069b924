"""`MegatronOptimization`: the optimizer half of the Megatron engine's step part.

Megatron's distributed optimizer (Adam with decoupled weight decay; optimizer states sharded over the
data-parallel ranks) built from the run's :class:`~hf_verl.engine.step.OptimizerSpec`, its global gradient norm
(tensor-parallel duplicates counted once, every stage and shard included) and clipping. The LR schedule is
transformers' (:class:`~hf_verl.engine.step.SchedulerSpec`): it steps a one-parameter shadow SGD whose learning
rates are copied into Megatron's param groups after each step, and a learning rate set on `param_groups` from
outside (the facade's live `config.learning_rate`) rescales the schedule's base. The state of both is saved per
rank, resumable on the layout that wrote it.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_verl.engine.parts.stepping import StepEngine
from hf_verl.engine.step import OptimizerSpec, SchedulerSpec
from hf_verl.parallel.megatron.compat import cpu_compat
from hf_verl.parallel.megatron.model import import_megatron


class MegatronOptimization(StepEngine):
    """The optimizer and LR schedule on Megatron-Core (see the module docstring); mixed into
    :class:`~hf_verl.engine.megatron.engine.MegatronEngine`, which sets what it reads: `_ddp` (Megatron's
    `DistributedDataParallel` over the stage), `_dtype`, and `_optimizer`, `_schedule`, `_shadow`, `_spec` (None
    until :meth:`configure_optimizer`)."""

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
