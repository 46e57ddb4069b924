"""The settings schema of hf_verl: every RL setting declared once, with one default, checked by one mechanism.

Each :class:`Setting` holds a default, the accepted types, a range check and the words describing it.
:func:`check_setting` is the one validation mechanism: an accepted value (an int where a float is asked is
widened), or a `TypeError` / `ValueError` that names the owner and the setting and states what is valid. Every
front-end reads the schema:

- the TRL-style configs (`GRPOConfig`, `PPOConfig`, `DPOConfig`) declare the fields that carry a schema setting
  with :func:`setting_field` (the default and the help come from here) and run :func:`check_settings` on them
  (:attr:`Setting.trainers`) before their own cross-field rules (TRL's, kept with TRL's messages);
- the facade's :class:`~hf_verl.facade.config.TrainerConfig` *is* the schema: its attributes are
  :data:`SETTINGS`, checked on every assignment.

A setting means one thing with one default wherever it is written. Where a front-end keeps TRL's own default or
name, the schema says so per front-end (:data:`FRONT_ENDS`): :attr:`Setting.defaults` (PPOConfig samples at
`temperature=0.7`, the facade rolls out asynchronously), with the reason in :data:`DEPARTURES`, and
:attr:`Setting.names` (TRL PPO's `cliprange` is the schema's `epsilon`; DPO's `beta` is another concept).
`tests/test_settings_schema.py` compares every config field's default and validation with the schema. Settings
with `trainers=False` are validated by the facade only (the trainers take them from `TrainingArguments`, or check
them their own way).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hf_verl.algorithms.advantages import SCALE_REWARDS
from hf_verl.algorithms.importance import IS_MODES
from hf_verl.algorithms.kl import KL_ESTIMATORS
from hf_verl.algorithms.policy_loss import LOSS_TYPES, VERL_AGGREGATIONS
from hf_verl.algorithms.policy_losses import IS_LEVELS
from hf_verl.algorithms.registry import advantage_estimator_names, resolve_policy_loss


FRONT_ENDS = ("grpo", "ppo", "rloo", "dpo", "facade")
"""The front-ends that read the schema: `GRPOConfig`, `PPOConfig`, `RLOOConfig`, `DPOConfig` and the facade's
`TrainerConfig`."""


@dataclass(frozen=True)
class Setting:
    """One setting: its default, accepted types, a range check and the words describing it.

    Attributes:
        trainers (`bool`): whether the TRL-style configs validate it too (where they carry it).
        defaults (`Mapping[str, Any]`): a front-end's own default where it keeps another (TRL's) one, by front-end
            (:data:`FRONT_ENDS`); the reason is in :data:`DEPARTURES`.
        names (`Mapping[str, str | None]`): a front-end's name for the setting where it is not the schema's (TRL PPO's
            `cliprange` for `epsilon`), or None where a front-end carries another concept under the schema's name
            (DPO's `beta` is the DPO temperature, not a KL weight).
    """

    default: Any
    types: tuple[type, ...]
    check: Callable[[Any], bool]
    valid: str
    help: str
    trainers: bool = True
    defaults: Mapping[str, Any] = field(default_factory=dict)
    names: Mapping[str, str | None] = field(default_factory=dict)

    def default_for(self, front_end: str | None) -> Any:
        """The default of `front_end` (the schema's unless it keeps its own)."""
        return self.defaults.get(front_end, self.default)

    def name_in(self, front_end: str | None, name: str) -> str | None:
        """The field that carries this setting (`name` in the schema) in `front_end`'s config; None: none does."""
        return self.names.get(front_end, name)


Field = Setting  # the facade's earlier name

_SIZE_RE = re.compile(r"^\s*\d+(\.\d+)?\s*[KMBT]?\s*$", re.IGNORECASE)


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


def _known_estimator(name: str) -> bool:
    """'auto' (the facade's: GAE with a critic, else GRPO) or a registered estimator, read at check time so that
    one a user registered before building the config is accepted."""
    return name == "auto" or name in advantage_estimator_names()

# The names and defaults are those of the TRL-style configs (GRPOConfig for what GRPO has, PPOConfig
# for the critic's knobs): one vocabulary and one default per concept across the library.
SETTINGS: dict[str, Setting] = {
    "rollout_batch_size": Setting(16, (int,), _pos_int, "an int >= 1",
                                "Prompts drawn per `rollout()` (per data-parallel rank) when it is called without a "
                                "batch.", trainers=False),
    "num_generations": Setting(8, (int,), _pos_int, "an int >= 1", "Completions generated per prompt (the group size).",
                               defaults={"ppo": 1, "rloo": 2}),
    "max_completion_length": Setting(512, (int,), _pos_int, "an int >= 1", "Maximum tokens generated per completion.",
                                     defaults={"ppo": 53}, names={"ppo": "response_length"}),
    "max_prompt_length": Setting(512, (int, _NONE), lambda v: v is None or v >= 1, "None or an int >= 1",
                               "Prompts are left-truncated to this many tokens; None keeps them whole."),
    "temperature": Setting(1.0, (float,), _nonneg, "a finite float >= 0 (0 is greedy)", "Sampling temperature.",
                           defaults={"ppo": 0.7}),
    "top_p": Setting(1.0, (float,), lambda v: 0.0 < v <= 1.0, "a float in (0, 1]", "Nucleus sampling mass."),
    "top_k": Setting(0, (int,), lambda v: v >= 0, "an int >= 0 (0 disables it)", "Top-k sampling."),
    "min_p": Setting(None, (float, _NONE), lambda v: v is None or 0.0 <= v <= 1.0, "None or a float in [0, 1]",
                   "Min-p sampling; None disables it (GRPOConfig's field)."),
    "repetition_penalty": Setting(1.0, (float,), lambda v: v > 0.0, "a float > 0",
                                "Repetition penalty; 1.0 disables it (GRPOConfig's field)."),
    "stop": Setting(None, (list, _NONE), lambda v: v is None or all(isinstance(x, str) for x in v),
                  "None or a list of strings", "Stop strings that end a completion (GRPOConfig's field)."),
    "max_tool_calling_iterations": Setting(None, (int, _NONE), lambda v: v is None or v >= 0, "None or an int >= 0",
                                         "With tools: most tool-calling rounds per completion; None: no limit but "
                                         "max_completion_length, which bounds the whole multi-turn completion."),
    "advantage_estimator": Setting("auto", (str,), _known_estimator,
                                   "'auto' or a registered estimator (hf_verl.algorithms.advantage_estimator_names(): "
                                   "gae, grpo, rloo, ..., or one registered with register_advantage_estimator)",
                                   "Advantage estimator: 'auto' is 'gae' with a critic and 'grpo' without.",
                                   trainers=False, defaults={"grpo": "grpo", "ppo": "gae", "rloo": "rloo"}),
    "scale_rewards": Setting("group", (str,), lambda v: v in SCALE_REWARDS, f"one of {SCALE_REWARDS}",
                           "GRPO: divide by the group's reward std ('group'), the batch's, or not at all."),
    "gamma": Setting(1.0, (float,), _unit, "a float in [0, 1]", "Discount factor (GAE, REINFORCE++)."),
    "lam": Setting(0.95, (float,), _unit, "a float in [0, 1]", "GAE lambda."),
    "whiten_advantages": Setting(True, (bool,), lambda v: True, "True or False",
                               "Whiten GAE advantages over the rollout's tokens (as TRL and verl do)."),
    "epsilon": Setting(0.2, (float,), _pos, "a finite float > 0", "PPO ratio clip range (lower, and upper by default).",
                       names={"ppo": "cliprange"}),
    "epsilon_high": Setting(None, (float, _NONE), lambda v: v is None or _pos(v), "None or a finite float > 0",
                          "Upper clip range (clip-higher); None: epsilon.", names={"ppo": "cliprange_high"}),
    "cliprange_value": Setting(0.2, (float,), _pos, "a finite float > 0",
                             "Clip range of the value loss around the rollout's values."),
    "beta": Setting(0.0, (float,), _nonneg, "a finite float >= 0",
                  "Weight of the KL to the reference (a loss term; PPOTrainer: a reward penalty unless use_kl_loss); 0 "
                  "disables it.", defaults={"ppo": 0.05, "rloo": 0.05}, names={"ppo": "kl_coef", "dpo": None}),
    "kl_estimator": Setting("k3", (str,), lambda v: v in KL_ESTIMATORS, f"one of {KL_ESTIMATORS}",
                            "Estimator of the KL loss term (PPOTrainer: kl_loss_estimator; its kl_estimator is TRL's "
                            "reward-penalty estimator).", names={"ppo": "kl_loss_estimator"}),
    "entropy_coef": Setting(0.0, (float,), _nonneg, "a finite float >= 0", "Weight of the entropy bonus."),
    "vf_coef": Setting(0.1, (float,), _nonneg, "a finite float >= 0", "Weight of the value loss."),
    "loss_type": Setting("dapo", (str,), lambda v: v in LOSS_TYPES or v in VERL_AGGREGATIONS,
                       f"one of {LOSS_TYPES} or verl's {tuple(VERL_AGGREGATIONS)}",
                       "TRL's loss type: the aggregation of per-token losses and, for cispo / sapo / vespo, the loss "
                       "form (see hf_verl.algorithms.policy_loss); verl's loss_agg_mode names also work.",
                       defaults={"ppo": "token-mean", "rloo": "grpo"}, names={"ppo": "loss_agg_mode", "dpo": None}),
    "policy_loss": Setting(None, (str, _NONE), lambda v: v is None or _known_policy_loss(v),
                         "None or a registered policy loss (hf_verl.algorithms.POLICY_LOSSES: clip, vanilla, gspo, "
                         "cispo, sapo, ..., or one registered with register_policy_loss)",
                         "The loss form by verl's name (vanilla, gspo, cispo, sapo, ...); None: loss_type's.",
                         defaults={"rloo": "sequence_clip"}),
    "importance_sampling_level": Setting("token", (str,), lambda v: v in IS_LEVELS, f"one of {IS_LEVELS}",
                                       "'sequence': one ratio per sequence (GSPO)."),
    "delta": Setting(None, (float, _NONE), lambda v: v is None or v > 1.0, "None or a float > 1",
                   "Two-sided clipping: cap the ratio at delta in the unclipped branch."),
    "sapo_temperature_pos": Setting(1.0, (float,), _pos, "a finite float > 0", "SAPO gate temperature, A > 0."),
    "sapo_temperature_neg": Setting(1.05, (float,), _pos, "a finite float > 0", "SAPO gate temperature, A <= 0."),
    "off_policy_mask_threshold": Setting(None, (float, _NONE), lambda v: v is None or math.isfinite(v),
                                       "None or a finite float",
                                       "Drop negative-advantage sequences whose mean sampling/current log-ratio "
                                       "exceeds it (off-policy sequence masking)."),
    "use_bias_correction_kl": Setting(True, (bool,), lambda v: True, "True or False",
                                    "Multiply the KL term by the importance ratio current/old (TRL's default).",
                                    defaults={"ppo": False}),
    "top_entropy_quantile": Setting(1.0, (float,), _unit, "a float in [0, 1]",
                                  "Train only on the top fraction of tokens by entropy (1.0: all)."),
    "learning_rate": Setting(1e-6, (float,), _pos, "a finite float > 0", "Actor AdamW learning rate.", trainers=False,
                             defaults={"ppo": 3e-6}),
    "critic_learning_rate": Setting(None, (float, _NONE), lambda v: v is None or _pos(v), "None or a finite float > 0",
                                  "Critic AdamW learning rate; None: learning_rate."),
    "weight_decay": Setting(0.0, (float,), _nonneg, "a finite float >= 0", "AdamW weight decay (both roles).", trainers=False),
    "max_grad_norm": Setting(1.0, (float, _NONE), lambda v: v is None or _pos(v), "None or a finite float > 0",
                           "Gradient-norm clip per role; None disables clipping.", trainers=False),
    "logprob_chunk_size": Setting(1024, (int,), _pos_int, "an int >= 1",
                                "Positions per log-prob chunk, at most: fewer above a 64k vocabulary, where a "
                                "chunk's fp32 logits stay within 256 MiB."),
    "device": Setting(None, (str, _NONE), lambda v: True, "None or a device string such as 'cpu' or 'cuda:0'",
                    "Where roles loaded from a Hub id / path go; None: this rank's CUDA device if any, else CPU.", trainers=False),
    "dtype": Setting("auto", (str,), lambda v: v in ("auto", "float32", "bfloat16", "float16"),
                   "'auto', 'float32', 'bfloat16' or 'float16'", "dtype of roles loaded from a Hub id / path.", trainers=False),
    "model_size": Setting(None, (int, str, _NONE), _size,
                        "None, an int number of parameters, or a string like '7B' / '500M'",
                        "Actor size, read by the parallel-layout planner; None: counted once loaded.", trainers=False),
    "host_memory_gib": Setting(None, (int, float, _NONE), lambda v: v is None or v > 0, "None or a number > 0",
                               "Host RAM per node, read by the layout planner (parallel='auto') to decide whether "
                               "optimizer states can be offloaded to the CPU; None: this machine's RAM on a GPU "
                               "machine, no offload on a CPU one (docs/planner.md)."),
    "debug_path": Setting(None, (str, _NONE), lambda v: True, "None or a file path",
                        "JSONL file of debug-mode records; None: `hf_verl_debug.jsonl` in the cwd.", trainers=False),
    "sequence_parallel_size": Setting(1, (int,), lambda v: v >= 1, "an int >= 1",
                                    "Ulysses sequence-parallel degree: each rollout row's sequence is split over this "
                                    "many processes of the launch (read when the roles are first laid out)."),
    "backend": Setting(None, (str, _NONE), lambda v: v in (None, "auto", "megatron"), "None, 'auto' or 'megatron'",
                       "The training engine: None / 'auto' takes the launch's (DDP, FSDP2, ZeRO, or Megatron from an "
                       "accelerate MEGATRON_LM config); 'megatron' runs every model role on Megatron-Core tensor / "
                       "pipeline parallelism through hf_verl's bridge (read when the roles are first laid out)."),
    "tensor_model_parallel_size": Setting(1, (int,), _pos_int, "an int >= 1",
                                          "Megatron tensor-parallel degree (backend='megatron')."),
    "pipeline_model_parallel_size": Setting(1, (int,), _pos_int, "an int >= 1",
                                            "Megatron pipeline stages (backend='megatron')."),
    "expert_model_parallel_size": Setting(1, (int,), _pos_int, "an int >= 1",
                                          "Megatron expert-parallel degree (backend='megatron', a Mixture-of-Experts "
                                          "model): the routed experts split over this many data-parallel ranks; "
                                          "must divide the experts and the data-parallel size."),
    "parallel": Setting(None, (str, _NONE), lambda v: v in (None, "manual", "auto"), "None, 'manual' or 'auto'",
                        "'auto': the planner chooses the layout from model_size (or the actor's config) for the "
                        "launch's processes, before anything is loaded; None: the same when model_size is set, else "
                        "the launch's layout; 'manual': always the launch's. An explicit layout wins."),
    "seed": Setting(42, (int,), lambda v: True, "an int", "The run's seed: the dataset draw order and per-row seeds.", trainers=False),
    "ddp_timeout": Setting(1800, (int,), _pos_int, "an int >= 1 (seconds)",
                           "TrainingArguments' name: the process group's timeout, and the longest a rank waits for its "
                           "peers in a collective before every rank reports the hang (role, phase, collective, the rank "
                           "that never arrived) and the job exits (docs/watchdog.md). Read when the roles are first "
                           "laid out; a later change sets the watchdog's timeout.", trainers=False),
    "per_row_sampling_seed": Setting(False, (bool,), lambda v: True, "True or False",
                                   "Sample each completion from its own stream seeded by (seed, rollout, row): "
                                   "rollouts then do not depend on how rows are batched or split over ranks."),
    "weight_sync": Setting("auto", (str,), lambda v: v in ("auto", "full", "delta", "adapter"),
                           "'auto', 'full', 'delta' or 'adapter'",
                           "How the rollout engine gets new weights: 'delta' sends per tensor nothing, the changed "
                           "elements or the whole tensor, whichever is smallest, at the engine's dtype (exact; the "
                           "sending rank keeps one copy of the weights at that dtype in host memory); 'full' streams "
                           "every weight; 'adapter' (a PEFT LoRA actor, hf-verl serve) sends the base weights once "
                           "and then only the adapters; 'auto' is 'delta' where bytes cross a wire (hf-verl serve) "
                           "and 'full' in-process (docs/rollout.md)."),
    "in_flight_weight_updates": Setting(False, (bool,), lambda v: True, "True or False",
                                        "With use_async_rollout: each optimizer step's weights are streamed into the "
                                        "running background generation and land between two decode steps "
                                        "(partial rollouts): unfinished completions continue under the new weights, "
                                        "every token carries its policy version (RolloutBatch.token_weight_version), "
                                        "the importance weights correct each token, and a token older than "
                                        "max_staleness is masked out of the loss (docs/rollout.md). The transformers "
                                        "rollout engine only."),
    "async_rollout_depth": Setting(1, (int,), lambda v: v >= 1, "an int >= 1",
                                   "With use_async_rollout: rounds generated ahead in the background. Above 1 they "
                                   "decode in one shared loop (continuous batching on the transformers engine's "
                                   "copy of the actor), so the long tail of one round runs in the same forwards as "
                                   "the next rounds' (partial rollouts); needs in_flight_weight_updates=True and "
                                   "max_staleness >= async_rollout_depth (docs/rollout.md)."),
    "router_replay": Setting(False, (bool,), lambda v: True, "True or False",
                             "Rollout routing replay for a Mixture-of-Experts actor: the rollout engine records the "
                             "experts each token was routed to, and the actor's training forwards route every token "
                             "to those experts (gate weights recomputed over them), so the policy ratio compares the "
                             "same computation (docs/moe.md). A dense actor is refused. Read when the roles are "
                             "first laid out."),
    "use_async_rollout": Setting(False, (bool,), lambda v: True, "True or False",
                                 "Generate and score the next round in a background thread while the current one "
                                 "trains (the facade: `rollout()` without a batch, and `rollouts(...)`; an explicit "
                                 "`rollout(batch)` is always synchronous). The facade's default is True.",
                                 defaults={"facade": True}),
    "max_staleness": Setting(1, (int,), lambda v: v >= 0, "an int >= 0",
                           "Most policy versions a rollout's weights may lag behind the actor when it is "
                           "handed out (the facade: optimizer steps; the trainers: rounds); 0 makes async rollout "
                           "synchronous."),
    "vllm_importance_sampling_correction": Setting(
        True, (bool,), lambda v: True, "True or False",
        "Weight the policy loss of off-policy rollouts (stale, or sampled by an engine with its own weights) by "
        "truncated / masked importance sampling."),
    "vllm_importance_sampling_mode": Setting("sequence_mask", (str,), lambda v: v in IS_MODES, f"one of {IS_MODES}",
                                           "How the behaviour/actor ratio is bounded (hf_verl.algorithms.importance)."),
    "vllm_importance_sampling_clip_min": Setting(None, (float, _NONE), lambda v: v is None or _nonneg(v),
                                               "None or a finite float >= 0", "Lower ratio bound; None: unbounded."),
    "vllm_importance_sampling_clip_max": Setting(3.0, (float, _NONE), lambda v: v is None or _pos(v),
                                               "None or a finite float > 0", "Upper ratio bound (the cap)."),
    "generation_kwargs": Setting(None, (dict, _NONE), lambda v: v is None or all(isinstance(k, str) for k in v),
                                 "None or a dict of sampling / transformers GenerationConfig settings",
                                 "Sampling settings that override the fields above (TRL's precedence); other "
                                 "GenerationConfig fields reach the transformers engine only."),
    "chat_template_kwargs": Setting(None, (dict, _NONE), lambda v: v is None or all(isinstance(k, str) for k in v),
                                    "None or a dict", "Extra keyword arguments of the chat template (enable_thinking, "
                                    "...)."),
    "dual_clip": Setting(None, (float, _NONE), lambda v: v is None or (math.isfinite(v) and v > 1.0),
                         "None or a finite float > 1", "Dual-clip constant c for negative advantages; None disables."),
    "vespo_k_pos": Setting(2.0, (float,), _pos, "a finite float > 0", "VESPO gamma-weight power, A >= 0."),
    "vespo_lambda_pos": Setting(3.0, (float,), _pos, "a finite float > 0", "VESPO gamma-weight rate, A >= 0."),
    "vespo_k_neg": Setting(3.0, (float,), _pos, "a finite float > 0", "VESPO gamma-weight power, A < 0."),
    "vespo_lambda_neg": Setting(2.0, (float,), _pos, "a finite float > 0", "VESPO gamma-weight rate, A < 0."),
}

DEPARTURES: dict[tuple[str, str], str] = {
    ("use_async_rollout", "facade"): "the seed article's key default; the TRL-style trainers keep TRL's False",
    ("num_generations", "ppo"): "TRL's PPO samples one completion per prompt (GAE needs no group)",
    ("max_completion_length", "ppo"): "TRL's PPO names it response_length, default 53",
    ("temperature", "ppo"): "TRL's PPOConfig samples at 0.7",
    ("beta", "ppo"): "TRL's PPO names it kl_coef, default 0.05 (a reward penalty unless use_kl_loss)",
    ("loss_type", "ppo"): "PPO aggregates by verl's loss_agg_mode, default token-mean",
    ("use_bias_correction_kl", "ppo"): "PPO's KL is a reward penalty by default; the correction is GRPO's (TRL)",
    ("learning_rate", "ppo"): "TRL's PPOConfig default",
    ("advantage_estimator", "grpo"): "GRPOTrainer is the critic-free family: GRPO",
    ("advantage_estimator", "ppo"): "PPOTrainer is PPO with a critic: GAE",
    ("advantage_estimator", "rloo"): "RLOOTrainer is REINFORCE leave-one-out",
    ("num_generations", "rloo"): "TRL's RLOOConfig default (the smallest leave-one-out group)",
    ("beta", "rloo"): "TRL's RLOO: a sequence-level k1 reward penalty, on by default",
    ("loss_type", "rloo"): "TRL's RLOO averages its per-sequence loss over sequences (grpo aggregation)",
    ("policy_loss", "rloo"): "TRL's RLOO clips the sequence's ratio (the product of its token ratios)",
}
"""Why a front-end keeps its own default, per (setting, front-end): every entry of a :attr:`Setting.defaults`."""

FACADE_DEFAULTS: dict[str, Any] = {name: s.defaults["facade"] for name, s in SETTINGS.items() if "facade" in s.defaults}
"""The facade's departures from the trainers' defaults."""


def setting_field(name: str, front_end: str, help: str | None = None) -> Any:
    """A config dataclass field carrying schema setting `name` for `front_end`: its default is the schema's (the
    front-end's own where :attr:`Setting.defaults` says so), its help the schema's unless `help` is given."""
    spec = SETTINGS[name]
    return field(default=spec.default_for(front_end), metadata={"help": help or spec.help})


def check_setting(owner: str, name: str, value: Any, spelled: str | None = None) -> Any:
    """The one validation of a setting: `value` as accepted (an int widened where a float is asked), else an error
    naming `owner.name` (`spelled`, when the user wrote an alias) and what is valid.

    Raises:
        `TypeError`: the value's type is not accepted; `ValueError`: it is out of range.
    """
    f = SETTINGS[name]
    label = name if spelled in (None, name) else f"{spelled} ({name})"
    if float in f.types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # 1 is a fine learning-rate-like float
    if list in f.types and isinstance(value, tuple):
        value = list(value)
    bad_bool = isinstance(value, bool) and bool not in f.types
    if bad_bool or not isinstance(value, f.types):
        raise TypeError(f"{owner}.{label} must be {f.valid}, got {type(value).__name__} {value!r}.")
    if not f.check(value):
        raise ValueError(f"{owner}.{label} must be {f.valid}, got {value!r}.")
    return value


def check_settings(config: Any, names: Iterable[str] | None = None) -> None:
    """Check every schema setting `config` carries (those marked `trainers`, or `names`) with
    :func:`check_setting`, under the config's own name for it (its `_front_end`'s, :attr:`Setting.names`), writing
    back the accepted (widened) values."""
    owner, front_end = type(config).__name__, getattr(config, "_front_end", None)
    for name in names if names is not None else (n for n, s in SETTINGS.items() if s.trainers):
        attr = SETTINGS[name].name_in(front_end, name)
        if attr is not None and hasattr(config, attr):
            setattr(config, attr, check_setting(owner, name, getattr(config, attr), spelled=attr))
