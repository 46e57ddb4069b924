"""`TrainerConfig`: the facade's attribute-style, validated settings.

Every setting is declared once in :data:`FIELDS` (default, accepted types, valid range, help).
Assignment checks the name (an unknown name raises `AttributeError` listing the closest valid
names), the type (`TypeError`) and the range (`ValueError`), each message stating what is valid.
Listeners registered with :meth:`TrainerConfig.add_listener` hear every accepted change, which
is how the :class:`~hf_verl.facade.trainer.Trainer` applies, say, a new `actor_lr` to its
optimizer's param groups at once; settings that are read per call (sampling, loss coefficients,
batch sizes) take effect at the next `rollout` / `compute_loss` / `step` without any rebuild.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_verl.algorithms.advantages import SCALE_REWARDS
from hf_verl.algorithms.estimators import CRITIC_FREE_ESTIMATORS
from hf_verl.algorithms.importance import IS_MODES
from hf_verl.algorithms.kl import KL_ESTIMATORS
from hf_verl.algorithms.policy_loss import LOSS_TYPES, VERL_AGGREGATIONS
from hf_verl.algorithms.policy_losses import (
    IS_LEVELS,
    resolve_policy_loss,
)

_SIZE_RE = re.compile(r"^\s*\d+(\.\d+)?\s*[KMBT]?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Field:
    """One setting: its default, accepted types, a range check and the words describing it."""

    default: Any
    types: tuple[type, ...]
    check: Callable[[Any], bool]
    valid: str
    help: str


def _pos_int(v) -> bool:
    return v >= 1


def _nonneg(v) -> bool:
    return math.isfinite(v) and v >= 0


def _pos(v) -> bool:
    return math.isfinite(v) and v > 0


def _unit(v) -> bool:
    return 0.0 <= v <= 1.0


def _size(v) -> bool:
    return v is None or (isinstance(v, int) and v > 0) or (isinstance(v, str) and bool(_SIZE_RE.match(v)))


_NONE = type(None)


def _known_policy_loss(name: str) -> bool:
    try:
        resolve_policy_loss(name)
    except ValueError:
        return False
    return True
# the critic-free estimators the facade runs (ReMax's greedy baseline and the optimal-token baselines' sampling
# statistics are the trainers' only)
CRITIC_FREE_CHOICES = tuple(e for e in CRITIC_FREE_ESTIMATORS if e != "remax" and "optimal_token_baseline" not in e)
_ESTIMATORS = ("auto", "gae", *CRITIC_FREE_CHOICES)

# The names and defaults are those of the TRL-style configs (GRPOConfig for what GRPO has, PPOConfig
# for the critic's knobs): one vocabulary and one default per concept across the library.
FIELDS: dict[str, Field] = {
    "rollout_batch_size": Field(16, (int,), _pos_int, "an int >= 1",
                                "Prompts drawn per `rollout()` (per data-parallel rank) when it is called without a "
                                "batch."),
    "num_generations": Field(8, (int,), _pos_int, "an int >= 1", "Completions generated per prompt (the group size)."),
    "max_completion_length": Field(512, (int,), _pos_int, "an int >= 1", "Maximum tokens generated per completion."),
    "max_prompt_length": Field(512, (int, _NONE), lambda v: v is None or v >= 1, "None or an int >= 1",
                               "Prompts are left-truncated to this many tokens; None keeps them whole."),
    "temperature": Field(1.0, (float,), _nonneg, "a finite float >= 0 (0 is greedy)", "Sampling temperature."),
    "top_p": Field(1.0, (float,), lambda v: 0.0 < v <= 1.0, "a float in (0, 1]", "Nucleus sampling mass."),
    "top_k": Field(0, (int,), lambda v: v >= 0, "an int >= 0 (0 disables it)", "Top-k sampling."),
    "min_p": Field(None, (float, _NONE), lambda v: v is None or 0.0 <= v <= 1.0, "None or a float in [0, 1]",
                   "Min-p sampling; None disables it (GRPOConfig's field)."),
    "repetition_penalty": Field(1.0, (float,), lambda v: v > 0.0, "a float > 0",
                                "Repetition penalty; 1.0 disables it (GRPOConfig's field)."),
    "stop": Field(None, (list, _NONE), lambda v: v is None or all(isinstance(x, str) for x in v),
                  "None or a list of strings", "Stop strings that end a completion (GRPOConfig's field)."),
    "max_tool_calling_iterations": Field(None, (int, _NONE), lambda v: v is None or v >= 0, "None or an int >= 0",
                                         "With tools: most tool-calling rounds per completion; None: no limit but "
                                         "max_completion_length, which bounds the whole multi-turn completion."),
    "advantage_estimator": Field("auto", (str,), lambda v: v in _ESTIMATORS, f"one of {_ESTIMATORS}",
                                 "Advantage estimator: 'auto' is 'gae' with a critic and 'grpo' without."),
    "scale_rewards": Field("group", (str,), lambda v: v in SCALE_REWARDS, f"one of {SCALE_REWARDS}",
                           "GRPO: divide by the group's reward std ('group'), the batch's, or not at all."),
    "gamma": Field(1.0, (float,), _unit, "a float in [0, 1]", "Discount factor (GAE, REINFORCE++)."),
    "lam": Field(0.95, (float,), _unit, "a float in [0, 1]", "GAE lambda."),
    "whiten_advantages": Field(True, (bool,), lambda v: True, "True or False",
                               "Whiten GAE advantages over the rollout's tokens (as TRL and verl do)."),
    "epsilon": Field(0.2, (float,), _pos, "a finite float > 0", "PPO ratio clip range (lower, and upper by default)."),
    "epsilon_high": Field(None, (float, _NONE), lambda v: v is None or _pos(v), "None or a finite float > 0",
                          "Upper clip range (clip-higher); None: epsilon."),
    "cliprange_value": Field(0.2, (float,), _pos, "a finite float > 0",
                             "Clip range of the value loss around the rollout's values."),
    "beta": Field(0.0, (float,), _nonneg, "a finite float >= 0",
                  "Weight of the KL-to-reference loss term; 0 disables it."),
    "kl_estimator": Field("k3", (str,), lambda v: v in KL_ESTIMATORS, f"one of {KL_ESTIMATORS}", "KL estimator."),
    "entropy_coef": Field(0.0, (float,), _nonneg, "a finite float >= 0", "Weight of the entropy bonus."),
    "vf_coef": Field(0.1, (float,), _nonneg, "a finite float >= 0", "Weight of the value loss."),
    "loss_type": Field("dapo", (str,), lambda v: v in LOSS_TYPES or v in VERL_AGGREGATIONS,
                       f"one of {LOSS_TYPES} or verl's {tuple(VERL_AGGREGATIONS)}",
                       "TRL's loss type: the aggregation of per-token losses and, for cispo / sapo / vespo, the loss "
                       "form (see hf_verl.algorithms.policy_loss); verl's loss_agg_mode names also work."),
    "policy_loss": Field(None, (str, _NONE), lambda v: v is None or _known_policy_loss(v),
                         "None or a policy loss name (hf_verl.algorithms.policy_losses)",
                         "The loss form by verl's name (vanilla, gspo, cispo, sapo, ...); None: loss_type's."),
    "importance_sampling_level": Field("token", (str,), lambda v: v in IS_LEVELS, f"one of {IS_LEVELS}",
                                       "'sequence': one ratio per sequence (GSPO)."),
    "delta": Field(None, (float, _NONE), lambda v: v is None or v > 1.0, "None or a float > 1",
                   "Two-sided clipping: cap the ratio at delta in the unclipped branch."),
    "sapo_temperature_pos": Field(1.0, (float,), _pos, "a finite float > 0", "SAPO gate temperature, A > 0."),
    "sapo_temperature_neg": Field(1.05, (float,), _pos, "a finite float > 0", "SAPO gate temperature, A <= 0."),
    "off_policy_mask_threshold": Field(None, (float, _NONE), lambda v: v is None or math.isfinite(v),
                                       "None or a finite float",
                                       "Drop negative-advantage sequences whose mean sampling/current log-ratio "
                                       "exceeds it (off-policy sequence masking)."),
    "use_bias_correction_kl": Field(True, (bool,), lambda v: True, "True or False",
                                    "Multiply the KL term by the importance ratio current/old (TRL's default)."),
    "top_entropy_quantile": Field(1.0, (float,), _unit, "a float in [0, 1]",
                                  "Train only on the top fraction of tokens by entropy (1.0: all)."),
    "learning_rate": Field(1e-6, (float,), _pos, "a finite float > 0", "Actor AdamW learning rate."),
    "critic_learning_rate": Field(None, (float, _NONE), lambda v: v is None or _pos(v), "None or a finite float > 0",
                                  "Critic AdamW learning rate; None: learning_rate."),
    "weight_decay": Field(0.0, (float,), _nonneg, "a finite float >= 0", "AdamW weight decay (both roles)."),
    "max_grad_norm": Field(1.0, (float, _NONE), lambda v: v is None or _pos(v), "None or a finite float > 0",
                           "Gradient-norm clip per role; None disables clipping."),
    "logprob_chunk_size": Field(1024, (int,), _pos_int, "an int >= 1",
                                "Positions per log-prob chunk, at most: fewer above a 64k vocabulary, where a "
                                "chunk's fp32 logits stay within 256 MiB."),
    "device": Field(None, (str, _NONE), lambda v: True, "None or a device string such as 'cpu' or 'cuda:0'",
                    "Where roles loaded from a Hub id / path go; None: this rank's CUDA device if any, else CPU."),
    "dtype": Field("auto", (str,), lambda v: v in ("auto", "float32", "bfloat16", "float16"),
                   "'auto', 'float32', 'bfloat16' or 'float16'", "dtype of roles loaded from a Hub id / path."),
    "model_size": Field(None, (int, str, _NONE), _size,
                        "None, an int number of parameters, or a string like '7B' / '500M'",
                        "Actor size, read by the parallel-layout planner; None: counted once loaded."),
    "debug_path": Field(None, (str, _NONE), lambda v: True, "None or a file path",
                        "JSONL file of debug-mode records; None: `hf_verl_debug.jsonl` in the cwd."),
    "sequence_parallel_size": Field(1, (int,), lambda v: v >= 1, "an int >= 1",
                                    "Ulysses sequence-parallel degree: each rollout row's sequence is split over this "
                                    "many processes of the launch (read when the roles are first laid out)."),
    "seed": Field(42, (int,), lambda v: True, "an int", "The run's seed: the dataset draw order and per-row seeds."),
    "per_row_sampling_seed": Field(False, (bool,), lambda v: True, "True or False",
                                   "Sample each completion from its own stream seeded by (seed, rollout, row): "
                                   "rollouts then do not depend on how rows are batched or split over ranks."),
    "use_async_rollout": Field(True, (bool,), lambda v: True, "True or False",
                               "Generate and score the next dataset rollout in a background thread while the "
                               "current one trains (`rollout()` without a batch, and `rollouts(...)`); the seed "
                               "article's key default. An explicit batch (`rollout(batch)`) is always synchronous."),
    "max_staleness": Field(1, (int,), lambda v: v >= 0, "an int >= 0",
                           "Most optimizer steps a rollout's weights may lag behind the actor when it is handed "
                           "out; 0 makes async rollout synchronous."),
    "vllm_importance_sampling_correction": Field(
        True, (bool,), lambda v: True, "True or False",
        "Weight the policy loss of off-policy rollouts (stale, or sampled by an engine with its own weights) by "
        "truncated / masked importance sampling."),
    "vllm_importance_sampling_mode": Field("sequence_mask", (str,), lambda v: v in IS_MODES, f"one of {IS_MODES}",
                                           "How the behaviour/actor ratio is bounded (hf_verl.algorithms.importance)."),
    "vllm_importance_sampling_clip_min": Field(None, (float, _NONE), lambda v: v is None or _nonneg(v),
                                               "None or a finite float >= 0", "Lower ratio bound; None: unbounded."),
    "vllm_importance_sampling_clip_max": Field(3.0, (float, _NONE), lambda v: v is None or _pos(v),
                                               "None or a finite float > 0", "Upper ratio bound (the cap)."),
}

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
    f = FIELDS[name]
    label = name if spelled in (None, name) else f"{spelled} ({name})"
    if float in f.types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # 1 is a fine learning-rate-like float
    bad_bool = isinstance(value, bool) and bool not in f.types
    if bad_bool or not isinstance(value, f.types):
        raise TypeError(f"TrainerConfig.{label} must be {f.valid}, got {type(value).__name__} {value!r}.")
    if not f.check(value):
        raise ValueError(f"TrainerConfig.{label} must be {f.valid}, got {value!r}.")
    return value
