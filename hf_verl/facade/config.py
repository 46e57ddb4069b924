"""`TrainerConfig`: the facade's attribute-style, validated settings.

Every setting is declared once, in the library's schema (:data:`hf_verl.settings.SETTINGS`: default, accepted
types, valid range, help), which the TRL-style configs validate through the same mechanism
(:func:`hf_verl.settings.check_setting`); :data:`FIELDS` is that schema with the facade's defaults.
Assignment checks the name (an unknown name raises `AttributeError` listing the closest valid
names), the type (`TypeError`) and the range (`ValueError`), each message stating what is valid.
Listeners registered with :meth:`TrainerConfig.add_listener` hear every accepted change, which
is how the :class:`~hf_verl.facade.trainer.Trainer` applies, say, a new `actor_lr` to its
optimizer's param groups at once; settings that are read per call (sampling, loss coefficients,
batch sizes) take effect at the next `rollout` / `compute_loss` / `step` without any rebuild.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from hf_verl.settings import SETTINGS, Setting, check_setting

# the facade's settings: the schema's, with the facade's few defaults of its own
FIELDS: dict[str, Setting] = {name: dataclasses.replace(f, default=f.default_for("facade"))
                              for name, f in SETTINGS.items()}
Field = Setting  # the earlier name of a setting's declaration

__all__ = ["ALIASES", "FIELDS", "TrainerConfig"]

# the facade's earlier names, kept as aliases of the shared vocabulary (reading or writing either works)
ALIASES: dict[str, str] = {
    "group_size": "num_generations", "max_new_tokens": "max_completion_length", "estimator": "advantage_estimator",
    "gae_lambda": "lam", "clip_range": "epsilon", "value_clip_range": "cliprange_value", "kl_coef": "beta",
    "actor_lr": "learning_rate", "critic_lr": "critic_learning_rate",
    "importance_sampling_correction": "vllm_importance_sampling_correction",
    "importance_sampling_mode": "vllm_importance_sampling_mode",
    "importance_sampling_clip_min": "vllm_importance_sampling_clip_min",
    "importance_sampling_clip_max": "vllm_importance_sampling_clip_max",
}


class TrainerConfig:
    """Settings of the role-level :class:`~hf_verl.facade.trainer.Trainer`, validated on assignment.

    Every name in :data:`FIELDS` is an attribute, with the names and defaults of the TRL-style
    configs (`GRPOConfig`; `PPOConfig` for the critic): `rollout_batch_size=16` prompts per rollout,
    `num_generations=8` completions per prompt, `max_completion_length=512`, `max_prompt_length=512`,
    `temperature=1.0`, `advantage_estimator="auto"` (GAE with a critic, GRPO without), `gamma=1.0`,
    `lam=0.95`, `epsilon=0.2`, `cliprange_value=0.2`, `beta=0.0` (KL), `vf_coef=0.1`,
    `loss_type="dapo"`, `learning_rate=1e-6`, `critic_learning_rate=None` (= learning_rate),
    `max_grad_norm=1.0`, `seed=42`, `use_async_rollout=True` (the seed's default), `max_staleness=1`,
    `vllm_importance_sampling_mode="sequence_mask"` with a cap of 3.0. The facade's earlier names
    (:data:`ALIASES`: `group_size`, `max_new_tokens`, `clip_range`, `kl_coef`, `actor_lr`, ...)
    read and write the same settings.

    Args:
        **overrides: initial values; each is validated as an assignment would be.

    Example:
        ```python
        config = TrainerConfig(num_generations=4)
        config.learning_rate = 5e-4     # applied to the optimizer at once
        config.group_size               # 4: an alias of num_generations
        config.temprature = 0.7         # AttributeError: ... did you mean 'temperature'?
        ```
    """

    def __init__(self, **overrides: Any) -> None:
        object.__setattr__(self, "_values", {name: f.default for name, f in FIELDS.items()})
        object.__setattr__(self, "_listeners", [])
        for name, value in overrides.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        name = ALIASES.get(name, name)
        if name in values:
            return values[name]
        raise AttributeError(_unknown(name))

    def __setattr__(self, name: str, value: Any) -> None:
        spelled, name = name, ALIASES.get(name, name)
        if name not in FIELDS:
            raise AttributeError(_unknown(name))
        value = _validate(name, value, spelled)
        old = self._values[name]
        self._values[name] = value
        if old != value:
            for listener in list(self._listeners):
                listener(name, old, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(FIELDS) | set(ALIASES))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"TrainerConfig({body})"

    def add_listener(self, listener: Callable[[str, Any, Any], None]) -> None:
        """Call `listener(name, old, new)` after every accepted change."""
        self._listeners.append(listener)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def update(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            setattr(self, name, value)


def _unknown(name: str) -> str:
    close = difflib.get_close_matches(name, list(FIELDS) + list(ALIASES), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"TrainerConfig has no setting {name!r}.{hint} Valid settings: {', '.join(FIELDS)}."


def _validate(name: str, value: Any, spelled: str | None = None) -> Any:
    return check_setting("TrainerConfig", name, value, spelled)
