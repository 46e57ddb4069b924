"""Per-role placement: what each role may be declared as, and the checks at construction, for every front-end.

`placement={...}` (the facade's `Trainer(placement=...)`, the trainer configs' `placement` field) declares, per role
(docs/placement.md):

- `"reference"`: `"colocated"` (default: the launch's layout, beside the actor) or a backend name (`"ddp"`,
  `"fsdp2"`, `"zero1"`, `"zero2"`, `"zero3"`): its own layout over the launch's processes (on one process
  `"ddp"` is the plain layout; Megatron is chosen for the whole launch, with `backend="megatron"`); or the URL of
  a server that serves it (`hf-verl serve`, `vllm serve`), read through `/v1/completions` prompt log-probs
  (:class:`~hf_verl.engine.remote_reference.RemoteReference`; then no reference model is given, and the served
  model's tokenizer when it is not the actor's);
- `"critic"`: the same choices (e.g. an FSDP2 critic beside a DDP actor);
- `"teacher"` (distillation, GKDTrainer only): the reference's choices, a backend or a server URL;
- `"generator"`: `"colocated"` (default: a rollout engine on the actor's weights) or the URL of any
  `/v1/completions` server (`hf-verl serve`, `vllm serve`): a :class:`~hf_verl.rollout.remote.RemoteEngine`,
  whose weight updates carry the `HF_VERL_SERVE_TOKEN` token; or a list of `hf-verl serve` URLs: a
  :class:`~hf_verl.rollout.fleet.FleetEngine` over them (a one-URL list is that URL);
- the reward model is declared by the reward argument itself: a callable, a local model (id, path or object), or
  a URL (:class:`~hf_verl.rewards.remote.RemoteRewardModel`).

A declaration that cannot run fails in :func:`check_placement`, at construction, naming the role and what to
change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_verl.parallel.backend import BackendSpec
from hf_verl.rewards.remote import is_url

__all__ = ["BACKENDS", "COLOCATED", "MODEL_ROLES", "check_placement", "is_url"]

BACKENDS = {"ddp": BackendSpec("ddp"), "fsdp2": BackendSpec("fsdp2"), "zero1": BackendSpec("deepspeed", 1),
            "zero2": BackendSpec("deepspeed", 2), "zero3": BackendSpec("deepspeed", 3)}
MODEL_ROLES = ("reference", "critic")
COLOCATED = "colocated"


FACADE_ARGUMENTS = {"reference": "reference_model=", "critic": "critic_model=", "reward": "reward_model="}
"""The facade's argument for each role, named in messages (the trainers pass TRL's: `ref_model=`, ...)."""


def check_placement(placement: Mapping[str, Any] | None, *, has_reference: bool | None, has_critic: bool | None,
                    world_size: int, engines: tuple[str, ...], roles: tuple[str, ...] = ("reference", "critic",
                                                                                         "generator"),
                    arguments: Mapping[str, str] = FACADE_ARGUMENTS, owner: str = "placement") -> dict[str, str]:
    """The validated placement (every declarable role filled in, "colocated" by default; a generator fleet as a
    tuple of URLs).

    Args:
        placement: `{role: choice}` as the module docstring lists.
        has_reference / has_critic (`bool`, *optional*): whether those roles have a model (given, or made by the
            front-end); None: not known yet (a config, checked again by its trainer), those checks are skipped.
        world_size (`int`): processes of the launch.
        engines (`tuple[str, ...]`): registered engine names (:data:`hf_verl.engine.registry.ENGINES`).
        roles (`tuple[str, ...]`): the roles this front-end runs (DPO: the reference only).
        arguments (`Mapping[str, str]`): the front-end's argument for each role, named in messages.
        owner (`str`): how messages name the setting (`placement`, `GRPOConfig.placement`).

    Raises:
        ValueError: naming the role and what to change.
    """
    out = {"reference": COLOCATED, "critic": COLOCATED, "generator": COLOCATED}
    if "teacher" in roles:  # distillation's teacher: placed as a reference is (a backend, or a server URL)
        out["teacher"] = COLOCATED
    if placement is not None and not isinstance(placement, Mapping):
        raise ValueError(f"{owner} must be a dict {{role: choice}}, got {type(placement).__name__}.")
    for role, choice in dict(placement or {}).items():
        if role == "reward":
            raise ValueError(f"{owner}['reward']: a reward model is placed by what {arguments['reward']} is: a "
                             "callable, a local model (id, path or object) or a server URL; drop it from placement.")
        if role == "actor":
            raise ValueError(f"{owner}['actor']: the actor runs on the launch's layout (accelerate launch / torchrun "
                             "and its config); drop it from placement.")
        if role not in out:
            raise ValueError(f"{owner} has unknown role {role!r}; roles are {sorted(out)} (and "
                             f"{arguments['reward']}).")
        if role not in roles and choice != COLOCATED:
            raise ValueError(f"{owner}[{role!r}]: this trainer has no {role} role to place (it places "
                             f"{', '.join(roles)}); drop {role!r} from placement.")
        if role == "generator" and isinstance(choice, (list, tuple)):
            out[role] = _fleet(choice, owner)
            continue
        if not isinstance(choice, str):
            raise ValueError(f"{owner}[{role!r}] must be a string, got {type(choice).__name__}.")
        if role == "generator":
            if choice != COLOCATED and not is_url(choice):
                raise ValueError(f"{owner}['generator'] = {choice!r}: use 'colocated' or the URL of a "
                                 "/v1/completions server, e.g. 'http://127.0.0.1:8000' (or a list of them).")
        elif role in ("reference", "teacher") and is_url(choice):
            if role == "reference" and has_reference is True:
                raise ValueError(f"{owner}['reference'] = {choice!r} is a server, so the reference is the model it "
                                 f"serves: drop {arguments['reference']} (and pass the served model's tokenizer if "
                                 "it is not the actor's).")
        else:
            given = has_critic if role == "critic" else has_reference if role == "reference" else None
            if given is False:
                raise ValueError(f"{owner}[{role!r}] = {choice!r} but no {role} model was given: pass "
                                 f"{arguments[role]}, or drop {role!r} from placement.")
            if choice != COLOCATED:
                if choice not in BACKENDS and choice != "megatron":
                    url = " or a server URL (http://host:port/v1)" if role in ("reference", "teacher") else ""
                    raise ValueError(f"{owner}[{role!r}] = {choice!r}: choose 'colocated'{url} or one of "
                                     f"{sorted(BACKENDS) + ['megatron']}.")
                if choice == "megatron":
                    hint = "" if "megatron" in engines else " (it needs megatron-core: pip install 'hf_verl[megatron]')"
                    raise ValueError(f"{owner}[{role!r}] = 'megatron': a Megatron layout is the whole launch's; set "
                                     f"config backend='megatron' to run every role on it{hint}, or pick one of "
                                     f"{sorted(BACKENDS)}.")
                if world_size < 2 and choice != "ddp":
                    raise ValueError(f"{owner}[{role!r}] = {choice!r} shards over processes but this launch has "
                                     "one: launch 2 or more processes (accelerate launch / torchrun), or use "
                                     "'colocated'.")
                if choice.startswith("zero"):
                    import importlib.util

                    if importlib.util.find_spec("deepspeed") is None:
                        raise ValueError(f"{owner}[{role!r}] = {choice!r} needs deepspeed: pip install deepspeed, "
                                         "or use 'fsdp2'.")
        out[role] = choice
    generators = out["generator"] if isinstance(out["generator"], tuple) else (out["generator"],)
    if is_url(out["reference"]) and any(is_url(g) and _server(out["reference"]) == _server(g) for g in generators):
        raise ValueError(f"{owner}['reference'] = {out['reference']!r} is the generator's server, which takes the "
                         "actor's weights after every step, so it cannot serve the frozen reference: serve the "
                         "reference on its own port (hf-verl serve <reference model> --port ...).")
    return out


def _fleet(urls: list | tuple, owner: str) -> str | tuple[str, ...]:
    """A generator list checked: non-empty, URLs only, no server twice; one URL is that URL."""
    if not urls:
        raise ValueError(f"{owner}['generator'] is an empty list: give one or more server URLs, or 'colocated'.")
    bad = [u for u in urls if not (isinstance(u, str) and is_url(u))]
    if bad:
        raise ValueError(f"{owner}['generator']: a generator fleet is a list of server URLs "
                         f"(e.g. ['http://127.0.0.1:8000', 'http://127.0.0.1:8001']); not URLs: {bad!r}.")
    servers = [_server(u) for u in urls]
    twice = sorted({s for s in servers if servers.count(s) > 1})
    if twice:
        raise ValueError(f"{owner}['generator'] lists the server(s) {twice} more than once.")
    return urls[0] if len(urls) == 1 else tuple(urls)


def _server(url: str) -> str:
    """`scheme://host:port` of a URL (a server is the same whatever route or trailing `/v1` is named)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()
