"""Per-role placement in the facade: what each role may be declared as, checks at construction, one line per role.

`Trainer(..., placement={...})` declares, per role (docs/placement.md):

- `"reference"`: `"colocated"` (default: the launch's layout, beside the actor) or a backend name (`"ddp"`,
  `"fsdp2"`, `"zero1"`, `"zero2"`, `"zero3"`): its own layout over the launch's processes (on one process
  `"ddp"` is the plain layout; Megatron is chosen for the whole launch, with `backend="megatron"`); or the URL of
  a server that serves it (`hf-verl serve`, `vllm serve`), read through `/v1/completions` prompt log-probs
  (:class:`~hf_verl.engine.remote_reference.RemoteReference`; then no `reference_model=`, and
  `reference_tokenizer=` when the served model has another tokenizer than the actor's);
- `"critic"`: the same choices (e.g. an FSDP2 critic beside a DDP actor);
- `"generator"`: `"colocated"` (default: a `TransformersEngine` on the actor's weights) or the URL of any
  `/v1/completions` server (`hf-verl serve`, `vllm serve`): a :class:`~hf_verl.rollout.remote.RemoteEngine`;
- the reward model is declared by `reward_model=` itself: a callable, a local model (id, path or object), or a URL
  (:class:`~hf_verl.rewards.remote.RemoteRewardModel`).

A declaration that cannot run fails in :func:`check_placement`, at construction, naming the role and what to
change. :func:`memory_estimate` is the planner's per-device estimate of a model role
(`hf_verl.parallel.estimate_memory(model, config, layout, role=...)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_verl.parallel.backend import BackendSpec
from hf_verl.rewards.remote import is_url

BACKENDS = {"ddp": BackendSpec("ddp"), "fsdp2": BackendSpec("fsdp2"), "zero1": BackendSpec("deepspeed", 1),
            "zero2": BackendSpec("deepspeed", 2), "zero3": BackendSpec("deepspeed", 3)}
MODEL_ROLES = ("reference", "critic")
COLOCATED = "colocated"


def check_placement(placement: Mapping[str, Any] | None, *, has_reference: bool, has_critic: bool,
                    world_size: int, engines: tuple[str, ...]) -> dict[str, str]:
    """The validated placement (every declarable role filled in, "colocated" by default).

    Args:
        placement: `{role: choice}` as the module docstring lists.
        has_reference / has_critic (`bool`): whether those roles were given a model.
        world_size (`int`): processes of the launch.
        engines (`tuple[str, ...]`): registered engine names (:data:`hf_verl.engine.registry.ENGINES`).

    Raises:
        ValueError: naming the role and what to change.
    """
    out = {"reference": COLOCATED, "critic": COLOCATED, "generator": COLOCATED}
    for role, choice in dict(placement or {}).items():
        if role == "reward":
            raise ValueError("placement['reward']: a reward model is placed by what reward_model= is: a callable, a "
                             "local model (id, path or object) or a server URL; drop it from placement.")
        if role == "actor":
            raise ValueError("placement['actor']: the actor runs on the launch's layout (accelerate launch / torchrun "
                             "and its config); drop it from placement.")
        if role not in out:
            raise ValueError(f"placement has unknown role {role!r}; roles are {sorted(out)} (and reward_model=).")
        if not isinstance(choice, str):
            raise ValueError(f"placement[{role!r}] must be a string, got {type(choice).__name__}.")
        if role == "generator":
            if choice != COLOCATED and not is_url(choice):
                raise ValueError(f"placement['generator'] = {choice!r}: use 'colocated' or the URL of a "
                                 "/v1/completions server, e.g. 'http://127.0.0.1:8000'.")
        elif role == "reference" and is_url(choice):
            if has_reference:
                raise ValueError(f"placement['reference'] = {choice!r} is a server, so the reference is the model it "
                                 "serves: drop reference_model= (pass reference_tokenizer= if that model's tokenizer "
                                 "is not the actor's).")
        else:
            given = has_reference if role == "reference" else has_critic
            if not given:
                raise ValueError(f"placement[{role!r}] = {choice!r} but no {role} model was given: pass "
                                 f"{role}_model=, or drop {role!r} from placement.")
            if choice != COLOCATED:
                if choice not in BACKENDS and choice != "megatron":
                    url = " or a server URL (http://host:port/v1)" if role == "reference" else ""
                    raise ValueError(f"placement[{role!r}] = {choice!r}: choose 'colocated'{url} or one of "
                                     f"{sorted(BACKENDS) + ['megatron']}.")
                if choice == "megatron":
                    hint = "" if "megatron" in engines else " (it needs megatron-core: pip install 'hf_verl[megatron]')"
                    raise ValueError(f"placement[{role!r}] = 'megatron': a Megatron layout is the whole launch's; set "
                                     f"config backend='megatron' to run every role on it{hint}, or pick one of "
                                     f"{sorted(BACKENDS)}.")
                if world_size < 2 and choice != "ddp":
                    raise ValueError(f"placement[{role!r}] = {choice!r} shards over processes but this launch has "
                                     "one: launch 2 or more processes (accelerate launch / torchrun), or use "
                                     "'colocated'.")
                if choice.startswith("zero"):
                    import importlib.util

                    if importlib.util.find_spec("deepspeed") is None:
                        raise ValueError(f"placement[{role!r}] = {choice!r} needs deepspeed: pip install deepspeed, "
                                         "or use 'fsdp2'.")
        out[role] = choice
    if is_url(out["reference"]) and is_url(out["generator"]) and _server(out["reference"]) == _server(out["generator"]):
        raise ValueError(f"placement['reference'] = {out['reference']!r} is the generator's server, which takes the "
                         "actor's weights after every step, so it cannot serve the frozen reference: serve the "
                         "reference on its own port (hf-verl serve <reference model> --port ...).")
    return out


def _server(url: str) -> str:
    """`scheme://host:port` of a URL (a server is the same whatever route or trailing `/v1` is named)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def memory_estimate(model: Any, layout: Any, config: Any = None, role: str = "actor") -> str:
    """The planner's per-device memory estimate of one model role on its layout, as `"0.45 GiB"`:
    `hf_verl.parallel.estimate_memory(model, config, layout, role=role).peak_bytes` (the role's weights, gradients
    and optimizer states as `layout` splits them, the step's activations and logits for `config`'s rows and lengths,
    the process's own baseline), on the layout's device type. "n/a (why)" where the role cannot be estimated.

    Args:
        model: the role's model (`nn.Module`, `PeftModel`), or its training engine (a Megatron engine's model is a
            Megatron stage: its HF config is estimated instead).
        layout ([`RoleLayout`]): where the role runs (its backend and `ParallelDims`).
        config: the facade's `TrainerConfig` (or a GRPO / PPO / DPO config): what one step holds.
        role (`str`): "actor" or "critic" (trained: gradients and optimizer states) or "reference" (frozen).
    """
    from transformers import PretrainedConfig

    from hf_verl.parallel import estimate_memory
    from hf_verl.parallel.planner.architectures import resolve_architecture

    if config is None:
        return "n/a (no trainer config to size the step)"
    if model is not None and hasattr(model, "backend") and hasattr(model, "model"):  # a training engine
        engine, model = model, model.model
        if not isinstance(getattr(model, "config", None), PretrainedConfig):  # a Megatron stage
            model = getattr(engine, "config", None)
    if model is None:
        return "n/a (no local model)"
    if not isinstance(getattr(model, "config", model), PretrainedConfig):
        return f"n/a (a {type(model).__name__}, not a transformers model: pass its engine or its config)"
    try:
        resolve_architecture(model)
    except ValueError as err:  # a model without a decoder's shape fields
        return f"n/a (the planner cannot read its shape: {err})"
    device = getattr(getattr(layout, "dims", None), "device_type", None)
    estimate = estimate_memory(model, config, layout, device=device, role=role)
    return f"{estimate.peak_bytes / 2**30:.2f} GiB"


def placement_line(role: str, backend: str, where: str, layout: str, memory: str) -> str:
    """One role's line: `role: backend=... where=... layout=... memory=...`."""
    return f"{role}: backend={backend} where={where} layout={layout} memory={memory}"
