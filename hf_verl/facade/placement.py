"""The facade's placement report: one line per role with its backend, where it runs, its layout and the planner's
memory estimate (`trainer.placement()`).

What a role may be declared as, and the checks at construction, are every front-end's
(:mod:`hf_verl.pipeline.placement`); :func:`memory_estimate` is the planner's per-device estimate of a model role
(`hf_verl.planner.estimate_memory(model, config, layout, role=...)`).
"""

from __future__ import annotations

from typing import Any

from hf_verl.engine.base import TrainingEngine
from hf_verl.pipeline.placement import COLOCATED
from hf_verl.rewards.callables import reward_func_name
from hf_verl.rewards.remote import RemoteRewardModel
from hf_verl.rewards.reward_model import RewardModelScorer


def placement_report(roles: Any, reward_funcs: list, generator: Any) -> list[str]:
    """The lines of `trainer.placement()`: the model roles (laid out, and so loaded, here), each reward source and
    the generator.

    Args:
        roles ([`FacadeRoles`]): the facade's roles.
        reward_funcs (`list`): the resolved reward sources.
        generator ([`RolloutEngine`]): the rollout engine.
    """
    layout = roles.launch()[0]
    ranks = f"ranks 0-{layout.dims.world_size - 1}" if layout.dims.world_size > 1 else "rank 0"
    lines = []
    for name in ("actor", "reference", "critic"):
        if name == "reference" and roles.remote_reference is not None:
            layout_ = "remote (cross-tokenizer)" if roles.cross() else "remote"
            lines.append(placement_line(name, "server", roles.remote_reference.url, layout_, "n/a (remote)"))
            continue
        engine = roles.engine(name)
        if engine is None:
            continue
        choice = roles.placement.get(name, COLOCATED)
        axes = " ".join(f"{a}={getattr(engine.dims, a)}" for a in engine.dims.enabled) or "one process"
        extra = " cross-tokenizer" if name == "reference" and roles.cross() else ""
        where = f"{ranks} ({'colocated' if choice == COLOCATED else 'own layout'}{extra})"
        memory = memory_estimate(engine, roles.layout(name), roles.config, name)
        lines.append(placement_line(name, engine.backend.label, where, axes, memory))
    for func in reward_funcs:
        label = f"reward[{reward_func_name(func)}]"
        if isinstance(func, RemoteRewardModel):
            lines.append(placement_line(label, "server", func.url, "remote", "n/a (remote)"))
        elif isinstance(func, RewardModelScorer):
            lines.append(placement_line(label, "local model", ranks, "replica on every rank" if not
                                        roles.sharded_rewards else "sharded with the actor", "n/a"))
        else:
            lines.append(placement_line(label, "callable", ranks, "python", "n/a"))
    url = ", ".join(getattr(generator, "urls", ())) or getattr(generator, "base_url", None)
    lines.append(placement_line("generator", type(generator).__name__, url or ranks,
                                "remote" if url else "colocated", "n/a" if url else "shares the actor's"))
    return lines


def memory_estimate(model: Any, layout: Any, config: Any = None, role: str = "actor") -> str:
    """The planner's per-device memory estimate of one model role on its layout, as `"0.45 GiB"`:
    `hf_verl.planner.estimate_memory(model, config, layout, role=role).peak_bytes` (the role's weights, gradients
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

    from hf_verl.planner import estimate_memory
    from hf_verl.planner.architectures import resolve_architecture

    if config is None:
        return "n/a (no trainer config to size the step)"
    if isinstance(model, TrainingEngine):
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
