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

Two parts of a launch config that accelerate does not honour the way hf_verl needs are read here too:
`use_cpu: true`, which accelerate's multi-process launchers do not pass on (:func:`adopt_launch_cpu` reads it
from the launching process's command line, so that the shipped `*_cpu.yaml` configs work as they are), and
`parallelism_config`, whose `sp_size` hf_verl runs as its own Ulysses sequence parallelism
(:func:`check_accelerate_parallelism`) and whose `cp_size` / `tp_size` it refuses.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

KINDS = ("plain", "ddp", "fsdp2", "deepspeed", "megatron")


def _env_bool(name: str, default: bool = False, environ=None) -> bool:
    value = (os.environ if environ is None else environ).get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class BackendSpec:
    """The training backend of a run.

    Args:
        kind (`str`): "plain", "ddp", "fsdp2", "deepspeed" or "megatron" (Megatron-Core TP / PP, its own engine).
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
        return self.kind in ("fsdp2", "megatron") or (self.kind == "deepspeed" and self.zero_stage == 3)

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


# accelerate's `parallelism_config` axes that no hf_verl engine runs yet: (field, what accelerate would run, what to do)
_REFUSED_AXES = {
    "CP_SIZE": ("cp_size", "torch's ring-attention context parallelism",
                "for sequence parallelism use parallelism_config_sp_size instead (hf_verl runs it as Ulysses over "
                "the same processes), or sequence_parallel_size in the trainer config"),
    "TP_SIZE": ("tp_size", "transformers' tensor-parallel plan",
                "for tensor parallelism use hf_verl's Megatron engine: backend='megatron' with "
                "tensor_model_parallel_size in the trainer config, or configs/accelerate/megatron_tp2.yaml (or shard "
                "the model with configs/accelerate/fsdp2.yaml or zero3.yaml)"),
}
# where hf_verl keeps the launch's sp_size once it has taken it over from accelerate (see below)
TAKEN_SP_SIZE = "HF_VERL_LAUNCH_SP_SIZE"


def _launch_size(env, name: str) -> int:
    raw = env.get(f"PARALLELISM_CONFIG_{name}", "1").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"the accelerate launch sets parallelism_config {name.lower()}={raw!r}; it must be an int "
                         ">= 1. Fix parallelism_config in the accelerate config (or the --parallelism_config_* flag).")
    return int(raw)


def check_accelerate_parallelism(environ: dict | None = None) -> int:
    """The sequence-parallel degree an `accelerate launch` asks for through its `parallelism_config`, run by hf_verl.

    accelerate exports a config's `parallelism_config` section (or the `--parallelism_config_*` flags) as
    `PARALLELISM_CONFIG_*` variables. Its `sp_size` becomes hf_verl's Ulysses sequence parallelism (the trainers'
    and the facade's `sequence_parallel_size`, with their checks: head divisibility, the process count); to
    keep accelerate and transformers from also setting up DeepSpeed-ALST over the same processes, hf_verl then
    switches accelerate's own `parallelism_config` off in this process (`ACCELERATE_USE_PARALLELISM_CONFIG=false`)
    and keeps the degree in `HF_VERL_LAUNCH_SP_SIZE`, so that later calls give the same answer. accelerate's
    ALST knobs (`sp_backend`, `sp_seq_length`, `sp_attn_implementation`) are not needed: hf_verl packs variable
    lengths and registers its own attention. `cp_size` and `tp_size` are refused until an engine provides them;
    data-parallel sizes are left alone (the processes not taken by sequence parallelism are data-parallel ranks).

    Args:
        environ (`dict`, *optional*): the environment to read and update (default `os.environ`).

    Returns:
        `int`: the launch's sequence-parallel degree (1 without a `parallelism_config` sp_size).

    Raises:
        `ValueError`: a `cp_size` / `tp_size` above 1 or a malformed size, naming the field and what to do.
    """
    env = os.environ if environ is None else environ
    if not _env_bool("ACCELERATE_USE_PARALLELISM_CONFIG", environ=env):
        return int(env.get(TAKEN_SP_SIZE, "1") or 1)
    for suffix, (field, meaning, instead) in _REFUSED_AXES.items():
        n = _launch_size(env, suffix)
        if n != 1:
            raise ValueError(
                f"the accelerate launch sets parallelism_config {field}={n}, which asks accelerate for {meaning}; no "
                f"hf_verl engine runs that yet. Remove parallelism_config_{field} from the accelerate config (or "
                f"--parallelism_config_{field} from the command): {instead}. See docs/parallel.md.")
    sp = _launch_size(env, "SP_SIZE")
    if sp > 1:
        env[TAKEN_SP_SIZE] = str(sp)
        env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
        logger.info("accelerate parallelism_config sp_size=%d runs as hf_verl's Ulysses sequence parallelism "
                    "(accelerate's own parallelism_config is switched off in this process)", sp)
    return sp


def resolve_sequence_parallel_size(configured: int, environ: dict | None = None) -> int:
    """The run's sequence-parallel degree from a training config's `sequence_parallel_size` and the launch's
    `parallelism_config` sp_size (:func:`check_accelerate_parallelism`): the config's when the launch sets
    none, the launch's when the config leaves it at 1.

    Raises:
        `ValueError`: both set, to different degrees; or what :func:`check_accelerate_parallelism` refuses.
    """
    launch = check_accelerate_parallelism(environ)
    if launch in (1, configured):
        return configured
    if configured == 1:
        return launch
    raise ValueError(
        f"sequence_parallel_size={configured} in the training config, but the accelerate launch's parallelism_config "
        f"sets sp_size={launch}: set the degree in one place (or the same in both), e.g. remove "
        "sequence_parallel_size from the training config to take the launch's.")


# ------------------------------------------------------------ `use_cpu`, which accelerate's launchers do not pass on
def launch_config_file() -> str | None:
    """The accelerate config file of the multi-process `accelerate launch` that started this process.

    accelerate's multi-process launchers (DDP, FSDP, DeepSpeed: torchrun inside `accelerate launch`) export most
    of a config to the processes they start, but neither its `use_cpu` nor its path. Those processes are children
    of the `accelerate launch` process, so the path is read from its command line with accelerate's own argument
    parser (`--config_file`, else accelerate's default config file, as the launcher chose).

    Returns:
        `str` or `None`: the path; `None` when this process was not started that way (plain python, torchrun
        alone, accelerate's single-process launcher, which does export `ACCELERATE_USE_CPU`) or it cannot be told.
    """
    if "LOCAL_RANK" not in os.environ or "ACCELERATE_MIXED_PRECISION" not in os.environ:
        return None  # accelerate's launchers export ACCELERATE_MIXED_PRECISION; torchrun sets LOCAL_RANK
    try:
        import psutil  # an accelerate dependency

        parent = psutil.Process().parent()
        argv, cwd = parent.cmdline(), parent.cwd()
    except Exception as err:  # psutil missing, the parent gone or not ours to read
        logger.debug("cannot read the launching process's command line: %s", err)
        return None
    rest = _launch_arguments(argv)
    if rest is None:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:
        args, _ = launch_command_parser().parse_known_args(rest)
    except (SystemExit, Exception):  # argparse exits on what it cannot parse
        return None
    if args.config_file:
        return os.path.join(cwd, args.config_file)
    from accelerate.commands.config import default_config_file

    return default_config_file if os.path.isfile(default_config_file) else None


def _launch_arguments(argv: list[str]) -> list[str] | None:
    """The arguments after `accelerate launch` / `accelerate-launch` / `-m accelerate.commands.launch` in `argv`."""
    for i, arg in enumerate(argv):
        name = os.path.basename(arg)
        if name == "accelerate" and argv[i + 1 : i + 2] == ["launch"]:
            return argv[i + 2 :]
        if name == "accelerate-launch" or arg == "accelerate.commands.launch":
            return argv[i + 1 :]
    return None


def launch_asks_for_cpu() -> bool:
    """Whether this process is to train on the CPU by its launch: `ACCELERATE_USE_CPU` when it is set, else the
    `use_cpu` field of the multi-process `accelerate launch` config that started it (:func:`launch_config_file`)."""
    if "ACCELERATE_USE_CPU" in os.environ:
        return _env_bool("ACCELERATE_USE_CPU")
    path = launch_config_file()
    if path is None:
        return False
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        return bool(getattr(load_config_from_file(path), "use_cpu", False))
    except Exception as err:  # the launcher read it a moment ago; a file changed since is not ours to judge
        logger.debug("cannot read the accelerate config %s: %s", path, err)
        return False


def adopt_launch_cpu() -> bool:
    """Make an accelerate config's `use_cpu: true` hold in this process, on a machine without CUDA devices.

    accelerate's multi-process launchers do not pass `use_cpu` on, so without this the processes of
    `accelerate launch --config_file configs/accelerate/ddp_cpu.yaml` come up as separate single-process runs.
    Where the launch's config asks for the CPU (:func:`launch_asks_for_cpu`) and no CUDA device is visible, this
    sets `ACCELERATE_USE_CPU=true`, which accelerate and transformers read when they set up the process group
    (gloo). A config that does not ask for the CPU is left to fail in :func:`resolve_backend`, naming the field;
    on a machine with GPUs accelerate runs a multi-process launch on them whatever `use_cpu` says, and so does
    hf_verl.

    Returns:
        `bool`: whether it set `ACCELERATE_USE_CPU` (the caller then sets its devices up again).
    """
    if "ACCELERATE_USE_CPU" in os.environ or not launch_asks_for_cpu():
        return False
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["ACCELERATE_USE_CPU"] = "true"
    logger.info("the accelerate config asks for use_cpu: true, which its multi-process launcher does not pass on: "
                "ACCELERATE_USE_CPU=true set in this process (gloo)")
    return True


def join_launch_process_group() -> bool:
    """Join the process group of the launch that started this process, where nothing (an `Accelerator`, a
    trainer config, the script) has formed it yet: what a script that lays roles out by hand
    (:func:`~hf_verl.engine.registry.launch_role_layout` before any `Accelerator`) needs under `accelerate launch`
    or `torchrun`.

    Only a process of a multi-process launch with a rendezvous set (`WORLD_SIZE` > 1, `MASTER_ADDR`) joins.
    An accelerate config's `use_cpu: true` is adopted first (:func:`adopt_launch_cpu`); the group is gloo on the
    CPU (no CUDA device, or `ACCELERATE_USE_CPU`), else NCCL on the device `LOCAL_RANK` names. An accelerate
    config that does not ask for the CPU, on a machine without CUDA, is not joined: :func:`resolve_backend` then
    names the field to set, as it does for the trainers.

    Returns:
        `bool`: whether it formed the group.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or "MASTER_ADDR" not in os.environ:
        return False
    adopt_launch_cpu()
    cuda = torch.cuda.is_available() and not _env_bool("ACCELERATE_USE_CPU")
    if not cuda and not _env_bool("ACCELERATE_USE_CPU") and launch_config_file() is not None:
        return False  # a GPU accelerate config on a machine without one
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")  # the launcher's env:// rendezvous
    logger.info("joined the launch's process group (%s, %d processes)", "nccl" if cuda else "gloo",
                dist.get_world_size())
    return True


def resolve_backend(world_size: int, process_group_ready: bool) -> BackendSpec:
    """:func:`requested_backend`, checked against what this machine and launch can give.

    Args:
        world_size (`int`): the processes the launcher started (`WORLD_SIZE`).
        process_group_ready (`bool`): whether those processes joined one `torch.distributed` group.

    Raises:
        `RuntimeError` / `ImportError`: naming the config field or package to change.
    """
    spec = requested_backend(world_size)
    if world_size > 1 and not process_group_ready and launch_asks_for_cpu():
        raise RuntimeError(
            f"{world_size} processes were launched ({spec.source}) with `use_cpu: true`, but they did not join a "
            "process group: accelerate's multi-process launcher does not pass `use_cpu` on, so an `Accelerator()` "
            "built before hf_verl read the launch runs each process alone. Build it as `Accelerator(cpu=True)`, or "
            "lay the roles out first (`launch_role_layout()` joins the launch's gloo group), or call "
            "`torch.distributed.init_process_group('gloo')` before. See docs/loading.md."
        )
    if world_size > 1 and not process_group_ready:
        raise RuntimeError(
            f"{world_size} processes were launched ({spec.source}) but they did not join a process group: "
            "accelerate engages FSDP, DeepSpeed and multi-GPU launches only on CUDA devices, so on this machine "
            "each process would train alone. On a machine without GPUs launch with a config that sets `use_cpu: "
            "true` (the shipped configs/accelerate/*_cpu.yaml), or set use_cpu=True in the training config; hf_verl "
            "then applies DDP / FSDP2 / DeepSpeed itself over gloo. See docs/parallel.md."
        )
    if spec.kind == "deepspeed":
        try:
            importlib.import_module("deepspeed")
        except Exception as err:  # missing, or installed for another accelerator / CUDA
            raise ImportError(
                f"the launch asks for DeepSpeed ({spec.source}) but deepspeed does not import ({type(err).__name__}: "
                f"{err}): `pip install hf_verl[deepspeed]`, or launch with "
                "a DDP / FSDP2 config."
            ) from err
    if spec.kind in ("fsdp2", "deepspeed") and world_size == 1:
        logger.info("%s requested with a single process: nothing to shard over, training without it", spec.label)
        return BackendSpec(source=f"{spec.source}, one process")
    return spec
