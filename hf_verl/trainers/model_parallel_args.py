"""`ModelParallelArguments`: the Megatron fields the three trainer configs share (`backend`,
`tensor_model_parallel_size`, `pipeline_model_parallel_size`, `expert_model_parallel_size`).

Two ways to ask for Megatron-Core tensor / pipeline parallelism, the same result:

- in the training config: `backend="megatron"`, `tensor_model_parallel_size=2`, `pipeline_model_parallel_size=1`
  (under `torchrun` or any `accelerate launch` config that starts the processes);
- in the launch: an accelerate config with `distributed_type: MEGATRON_LM` and its `megatron_lm_config`
  (`megatron_lm_tp_degree`, `megatron_lm_pp_degree`; `configs/accelerate/megatron_tp2*.yaml`), which accelerate
  exports as `ACCELERATE_USE_MEGATRON_LM` / `MEGATRON_LM_TP_DEGREE` / `MEGATRON_LM_PP_DEGREE` (and, for a
  Mixture of Experts, `megatron_lm_expert_model_parallel_size` as `MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE`).

hf_verl's own engine (:mod:`hf_verl.parallel.megatron`) runs the layout, so the launch's request is read here and
accelerate's Megatron-LM plugin (which expects the Megatron-LM training scripts and GPUs) is switched off: the
`ACCELERATE_USE_MEGATRON_LM` variable is removed before the Trainer builds its `Accelerator`, which then starts
plain data-parallel processes. A config field that disagrees with the launch is an error naming both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hf_verl.settings import check_settings, setting_field

logger = logging.getLogger(__name__)

def _help(text: str) -> Any:
    return {"help": text}


TRL_ARGUMENTS = {"reference": "ref_model=", "critic": "value_model=", "reward": "reward_funcs= / reward_model="}
"""The trainers' argument for each role (TRL's names), as placement messages name them."""


@dataclass
class ModelParallelArguments:
    backend: str | None = setting_field("backend", None, (
        "The training engine: None / 'auto' takes the launch's (DDP, FSDP2, ZeRO from the accelerate config; Megatron"
        " from a MEGATRON_LM one); 'megatron' runs every model role on Megatron-Core tensor / pipeline parallelism "
        "through hf_verl's HF<->Megatron bridge (needs megatron-core: pip install 'hf_verl[megatron]')."))
    tensor_model_parallel_size: int = setting_field("tensor_model_parallel_size", None, (
        "Megatron tensor-parallel degree (backend='megatron'); must divide the attention and key-value heads."))
    pipeline_model_parallel_size: int = setting_field("pipeline_model_parallel_size", None, (
        "Megatron pipeline stages (backend='megatron'); must divide the layers."))
    expert_model_parallel_size: int = setting_field("expert_model_parallel_size", None, (
        "Megatron expert-parallel degree (backend='megatron', a Mixture-of-Experts model): the routed experts split "
        "over this many data-parallel ranks; must divide the experts and the data-parallel size."))
    parallel: str | None = setting_field("parallel", None, (
        "'auto': hf_verl's planner chooses the layout (tp / pp / sp, FSDP2, activation checkpointing, micro-batch) "
        "for this launch's processes from model_size, logged once; an explicit layout in this config or the launch "
        "wins (the log says so). None / 'manual': the layout is the launch's and these fields' (docs/planner.md)."))
    model_size: int | str | None = setting_field("model_size", None, (
        "What parallel='auto' / per_device_train_batch_size='auto' size: a size string ('7b', '500M'), a parameter "
        "count, or the model's local path / Hub id (its config is read offline)."))
    host_memory_gib: float | None = setting_field("host_memory_gib", None, (
        "Host RAM per node for parallel='auto': whether the planner may offload optimizer states to the CPU (None: "
        "this machine's RAM on a GPU machine)."))
    placement: dict | None = field(default=None, metadata=_help(
        "Where roles run, the facade's values (docs/placement.md): {'reference' | 'critic': 'colocated' | 'ddp' | "
        "'fsdp2' | 'zero1' | 'zero2' | 'zero3', 'reference': '<URL of a server serving it>', 'generator': "
        "'colocated' | '<URL of a /v1/completions server>'}; a URL generator's weight updates carry the "
        "HF_VERL_SERVE_TOKEN token. None: every role on the launch's layout."))

    _placement_roles = ("reference", "critic", "generator")  # the roles this config's trainer places (no annotation:
    # a class attribute, not a dataclass field)

    def _resolve_model_parallel(self) -> None:
        """Read an accelerate MEGATRON_LM launch into the fields, switch accelerate's own plugin off, and check the
        fields (call before `TrainingArguments.__post_init__`, which may build accelerate's state)."""
        from hf_verl.parallel.megatron.launch import resolve_expert_parallel_size, resolve_megatron_settings
        from hf_verl.planner.apply import apply_parallel_plan

        # checked first (before the planner and the launch read them), by the schema's one mechanism (hf_verl.settings)
        check_settings(self, ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                              "backend", "parallel", "sequence_parallel_size"))
        apply_parallel_plan(self, self.model_size, type(self).__name__)  # parallel="auto": before the layout is read
        self.backend, self.tensor_model_parallel_size, self.pipeline_model_parallel_size = resolve_megatron_settings(
            type(self).__name__, self.backend, self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
            getattr(self, "sequence_parallel_size", 1))
        self.expert_model_parallel_size = resolve_expert_parallel_size(type(self).__name__, self.backend,
                                                                       self.expert_model_parallel_size)
        self._check_placement()

    def _check_placement(self) -> None:
        """`placement` checked as the facade checks it (:func:`~hf_verl.pipeline.placement.check_placement`), for the
        roles this trainer has; a JSON string (the command line) is read first. Whether a placed role has a model is
        checked again by the trainer, which knows its roles."""
        import json
        import os

        from hf_verl.engine.registry import ENGINES
        from hf_verl.pipeline.placement import check_placement

        if isinstance(self.placement, str) and self.placement.strip().startswith("{"):
            self.placement = json.loads(self.placement)
        if self.placement is not None:
            check_placement(self.placement, has_reference=None, has_critic=None,
                            world_size=int(os.environ.get("WORLD_SIZE", "1")), engines=tuple(ENGINES),
                            roles=self._placement_roles, arguments=TRL_ARGUMENTS,
                            owner=f"{type(self).__name__}.placement")

    @property
    def uses_megatron(self) -> bool:
        return self.backend == "megatron"
