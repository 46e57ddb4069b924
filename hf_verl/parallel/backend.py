"""Which training backend a run asked for, and a loud failure when the machine cannot give it.

A run asks through the `accelerate launch` config it was started with (accelerate exports the
config as environment variables into every process: `ACCELERATE_USE_FSDP` + `FSDP_VERSION`,
`ACCELERATE_USE_DEEPSPEED` + `ACCELERATE_DEEPSPEED_ZERO_STAGE`, ...), or without a config through
`torchrun` / a plain `python` start. :func:`resolve_backend` turns that into a
:class:`BackendSpec`: "plain" (one process), "ddp", "fsdp2" or "deepspeed" (ZeRO 1-3).

hf_verl applies FSDP2 and DeepSpeed itself, in the training engine, on every device type:
accelerate's own FSDP plugin does not engage without CUDA devices, and its DeepSpeed state on a CPU
machine does not form a process group, so a config that asks for either is honoured by the engine
over the process group accelerate (or torchrun) set up. What cannot work fails here, in seconds,
with the config field to change: FSDP version 1, a backend package that is not installed, several
launched processes that never joined a process group.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

KINDS = ("plain", "ddp", "fsdp2", "deepspeed")


def _env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class BackendSpec:
    """The training backend of a run.

    Args:
        kind (`str`): "plain", "ddp", "fsdp2" or "deepspeed".
        zero_stage (`int`): DeepSpeed ZeRO stage (0-3); 0 for other kinds.
        reshard_after_forward (`bool`): FSDP2: free the gathered parameters of a layer after its forward.
        offload_params (`bool`): FSDP2 CPU offload of parameters / DeepSpeed parameter offload.
        offload_optimizer (`bool`): DeepSpeed optimizer-state offload to the CPU.
        config_file (`str`, *optional*): a DeepSpeed JSON config given to `accelerate launch`.
        source (`str`): where the request came from, quoted in messages.
    """

    kind: str = "plain"
    zero_stage: int = 0
    reshard_after_forward: bool = True
    offload_params: bool = False
    offload_optimizer: bool = False
    config_file: str | None = None
    source: str = "no accelerate config (plain python or torchrun)"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"backend kind must be one of {KINDS}, got {self.kind!r}.")
        if self.kind == "deepspeed" and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"DeepSpeed zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}.")

    @property
    def shards(self) -> bool:
        """Whether the data-parallel ranks hold shards (FSDP2, ZeRO) rather than replicas (DDP)."""
        return self.kind in ("fsdp2", "deepspeed")

    @property
    def partitions_parameters(self) -> bool:
        """Whether a rank holds only part of each parameter between forwards (FSDP2, ZeRO-3)."""
        return self.kind == "fsdp2" or (self.kind == "deepspeed" and self.zero_stage == 3)

    @property
    def label(self) -> str:
        return f"deepspeed ZeRO-{self.zero_stage}" if self.kind == "deepspeed" else self.kind


def requested_backend(world_size: int) -> BackendSpec:
    """The backend the launch environment asks for (not yet checked against the machine)."""
    if _env_bool("ACCELERATE_USE_FSDP"):
        version = os.environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise ValueError(
                f"the accelerate config asks for FSDP version {version} (`fsdp_config.fsdp_version`); hf_verl "
                "trains with FSDP2 only: set `fsdp_version: 2` (see configs/accelerate/fsdp2.yaml)."
            )
        return BackendSpec(
            "fsdp2", reshard_after_forward=_env_bool("FSDP_RESHARD_AFTER_FORWARD", True),
            offload_params=_env_bool("FSDP_OFFLOAD_PARAMS"),
            source="accelerate config `distributed_type: FSDP` (fsdp_version: 2)")
    if _env_bool("ACCELERATE_USE_DEEPSPEED"):
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2") or 2)
        config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
        if config_file and config_file.lower() != "none":
            import json

            with open(config_file) as f:
                stage = int(json.load(f).get("zero_optimization", {}).get("stage", stage))
        else:
            config_file = None
        return BackendSpec(
            "deepspeed", zero_stage=stage,
            offload_params=os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") not in ("none", ""),
            offload_optimizer=os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none") not in ("none", ""),
            config_file=config_file, source=f"accelerate config `distributed_type: DEEPSPEED` (zero_stage: {stage})")
    if world_size > 1:
        return BackendSpec("ddp", source="a multi-process launch without FSDP or DeepSpeed (DDP)")
    return BackendSpec()


# accelerate's `parallelism_config` axes that hf_verl lays out itself, and the hf_verl setting to use instead
_ACCELERATE_AXES = {
    "SP_SIZE": ("sp_size", "DeepSpeed's own Ulysses (ALST)", "sequence_parallel_size={n} in the trainer config"),
    "CP_SIZE": ("cp_size", "torch's ring-attention context parallelism",
                "sequence_parallel_size={n} in the trainer config (Ulysses over the same processes)"),
    "TP_SIZE": ("tp_size", "transformers' tensor-parallel plan",
                ("nothing in its place: hf_verl's training engines do not split tensors; to fit a model that one "
                 "device cannot hold, shard it with configs/accelerate/fsdp2.yaml or zero3.yaml")),
}


def check_accelerate_parallelism(environ: dict | None = None) -> None:
    """Refuse an `accelerate launch` whose `parallelism_config` splits sequences or tensors itself.

    accelerate exports a config's `parallelism_config` section (or `--use_parallelism_config`) as
    `PARALLELISM_CONFIG_*` variables, and its Accelerator then builds sequence / context / tensor
    parallel groups of its own beside the ones hf_verl's :class:`~hf_verl.parallel.dims.ParallelDims`
    lays out. hf_verl takes these degrees from its own settings, so a launch that asks accelerate for
    them fails here, before any model is touched, naming the setting to use. Data-parallel sizes
    (`dp_replicate_size`, `dp_shard_size`) are left alone: they agree with what the engine does.

    Raises:
        `ValueError`: naming the accelerate field and the hf_verl setting to use instead.
    """
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    for suffix, (field, meaning, instead) in _ACCELERATE_AXES.items():
        raw = env.get(f"PARALLELISM_CONFIG_{suffix}", "1")
        n = int(raw) if raw.strip().isdigit() else raw
        if n != 1:
            raise ValueError(
                f"the accelerate launch sets parallelism_config {field}={n}, which asks accelerate for {meaning}; "
                f"hf_verl lays out its own groups and does not run that. Remove parallelism_config_{field} from the "
                f"accelerate config (or --parallelism_config_{field} from the command) and set "
                f"{instead.format(n=n)}. See docs/parallel.md.")


def resolve_backend(world_size: int, process_group_ready: bool) -> BackendSpec:
    """:func:`requested_backend`, checked against what this machine and launch can give.

    Args:
        world_size (`int`): the processes the launcher started (`WORLD_SIZE`).
        process_group_ready (`bool`): whether those processes joined one `torch.distributed` group.

    Raises:
        `RuntimeError` / `ImportError`: naming the config field or package to change.
    """
    spec = requested_backend(world_size)
    if world_size > 1 and not process_group_ready:
        raise RuntimeError(
            f"{world_size} processes were launched ({spec.source}) but they did not join a process group: "
            "accelerate engages FSDP, DeepSpeed and multi-GPU launches only on CUDA devices, so on this machine "
            "each process would train alone. On a machine without GPUs set `use_cpu: true` in the accelerate "
            "config and ACCELERATE_USE_CPU=1 in the environment (or use_cpu=True in the training config); "
            "hf_verl then applies FSDP2 / DeepSpeed itself over gloo. See docs/parallel.md."
        )
    if spec.kind == "deepspeed":
        try:
            importlib.import_module("deepspeed")
        except Exception as err:  # missing, or installed for another accelerator / CUDA
            raise ImportError(
                f"the launch asks for DeepSpeed ({spec.source}) but deepspeed does not import ({type(err).__name__}: "
                f"{err}): `pip install hf_verl[deepspeed]` (DS_ACCELERATOR=cpu on a CPU machine), or launch with "
                "a DDP / FSDP2 config."
            ) from err
    if spec.kind in ("fsdp2", "deepspeed") and world_size == 1:
        logger.info("%s requested with a single process: nothing to shard over, training without it", spec.label)
        return BackendSpec(source=f"{spec.source}, one process")
    return spec
