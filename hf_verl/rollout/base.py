"""The `RolloutEngine` interface: what every generation backend offers a trainer.

A trainer never knows whether generation runs in plain transformers, in-process vLLM or behind
an HTTP server. It tokenises prompts itself, hands the engine token ids plus
:class:`SamplingParams`, and gets back a :class:`GenerationOutput` of completion token ids, the
log-probability of each sampled token and a finish reason per sample. After an optimizer step
it streams the new weights with :meth:`RolloutEngine.sync_weights`.

Log-prob convention (shared by every engine so that importance ratios are comparable): the
log-probability of the sampled token under the *temperature-scaled* distribution
``log_softmax(logits / temperature)``, before top-k / top-p / min-p truncation and before the
repetition penalty. That is exactly what the trainer recomputes for the same tokens.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

FINISH_STOP = "stop"  # end-of-sequence token or a stop string was produced
FINISH_LENGTH = "length"  # max_new_tokens was reached first


GENERATION_KWARGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_tokens": "max_new_tokens",
                     "max_new_tokens": "max_new_tokens", "stop": "stop", "seed": "seed", "do_sample": None}
"""`generation_kwargs` keys every engine honours, with the :class:`SamplingParams` field each sets (`do_sample`:
False means greedy, temperature 0)."""


def check_generation_kwargs(kwargs: dict) -> None:
    """Refuse `generation_kwargs` keys no engine can honour, naming the ones it can."""
    unknown = sorted(set(kwargs) - set(GENERATION_KWARGS))
    if unknown:
        raise ValueError(f"generation_kwargs keys {unknown} are not supported by hf_verl's engines; supported: "
                         f"{sorted(GENERATION_KWARGS)}.")


def split_generation_kwargs(kwargs: dict | None) -> tuple[dict, dict]:
    """TRL's `generation_kwargs` as `(the sampling settings every engine honours, the rest)`; the rest are
    `transformers.GenerationConfig` fields (beam search, n-gram blocking, ...) that only the transformers engine
    takes, passing them to `model.generate` (the configs refuse them with vLLM)."""
    kwargs = dict(kwargs or {})
    known = {k: v for k, v in kwargs.items() if k in GENERATION_KWARGS}
    return known, {k: v for k, v in kwargs.items() if k not in known}


def apply_generation_kwargs(sampling: SamplingParams, kwargs: dict | None) -> SamplingParams:
    """`sampling` with the `generation_kwargs` overrides applied (they win over the config's fields, as in TRL)."""
    if not kwargs:
        return sampling
    check_generation_kwargs(kwargs)
    updates = {}
    for key, value in kwargs.items():
        if key == "do_sample":
            if not value:
                updates["temperature"] = 0.0
            continue
        if key == "stop":
            value = (value,) if isinstance(value, str) else tuple(value or ())
        updates[GENERATION_KWARGS[key]] = value
    return replace(sampling, **updates)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions.

    Args:
        max_new_tokens (`int`): maximum number of tokens generated per completion.
        temperature (`float`, defaults to `1.0`): softmax temperature; `0.0` means greedy.
        top_p (`float`, defaults to `1.0`): nucleus sampling mass; `1.0` disables it.
        top_k (`int`, defaults to `0`): keep only the k most likely tokens; `0` disables it.
        min_p (`float`, *optional*): drop tokens whose probability is below `min_p` times the
            most likely token's; `None` disables it.
        repetition_penalty (`float`, defaults to `1.0`): CTRL-style penalty on tokens already in
            the prompt or completion; `1.0` disables it.
        stop (`tuple[str, ...]`, defaults to `()`): strings that end a completion (the stop
            string is kept in the completion).
        seed (`int`, *optional*): seed for this call's sampling, for reproducible rollouts.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}.")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p}.")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if isinstance(self.stop, str):  # a bare string would be iterated per character
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationOutput:
    """One completion per prompt handed to :meth:`RolloutEngine.generate`, in the same order.

    Args:
        completion_ids (`list[list[int]]`): generated token ids, without the prompt and without
            padding; the end-of-sequence token is kept when it was produced.
        logprobs (`list[list[float]]`): per generated token, its log-probability under the
            temperature-scaled distribution (see the module docstring); same lengths as
            `completion_ids`. For greedy decoding the temperature is taken as 1.
        finish_reasons (`list[str]`): `"stop"` (EOS or a stop string) or `"length"`.
        weight_version (`int`): the engine's weight version the completions were generated with.
        routed_experts (`list[torch.Tensor]`, *optional*): a Mixture-of-Experts rollout asked to record its
            routing (:attr:`RolloutEngine.record_routing`): per completion, the experts every token of prompt +
            completion was routed to, `(prompt_len + completion_len, layers, top_k)` integers, -1 for a token no
            forward routed (the last sampled one).
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    weight_version: int = 0
    extra: dict = field(default_factory=dict)
    routed_experts: list | None = None

    @classmethod
    def concat(cls, parts: Sequence[GenerationOutput]) -> GenerationOutput:
        """The outputs of consecutive prompt chunks as one; `weight_version` is the oldest part's and
        `extra["weight_versions"]` holds one version per completion."""
        versions = []
        for p in parts:
            versions += p.extra.get("weight_versions") or [p.weight_version] * len(p.completion_ids)
        routed = None
        if parts and all(p.routed_experts is not None for p in parts):
            routed = [r for p in parts for r in p.routed_experts]
        extra: dict = {"weight_versions": versions}
        if parts and all("token_versions" in p.extra for p in parts):
            extra["token_versions"] = [v for p in parts for v in p.extra["token_versions"]]
        return cls(completion_ids=[c for p in parts for c in p.completion_ids],
                   logprobs=[lp for p in parts for lp in p.logprobs],
                   finish_reasons=[r for p in parts for r in p.finish_reasons],
                   weight_version=min(versions) if versions else 0, extra=extra, routed_experts=routed)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.finish_reasons) != n:
            raise ValueError(
                f"GenerationOutput fields disagree: {n} completions, {len(self.logprobs)} log-prob "
                f"lists, {len(self.finish_reasons)} finish reasons."
            )
        for i, (ids, lps) in enumerate(zip(self.completion_ids, self.logprobs)):
            if len(ids) != len(lps):
                raise ValueError(
                    f"completion {i} has {len(ids)} tokens but {len(lps)} log-probs."
                )
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(f"GenerationOutput has {n} completions but {len(self.routed_experts)} routing records.")
        bad = set(self.finish_reasons) - {FINISH_STOP, FINISH_LENGTH}
        if bad:
            raise ValueError(f"unknown finish reasons {sorted(bad)}; expected 'stop' or 'length'.")


class RolloutEngine(abc.ABC):
    """A generation backend.

    Subclasses implement :meth:`generate` and :meth:`sync_weights`. The engine owns a monotonically
    increasing :attr:`weight_version`, bumped by every successful sync, and reports it with every
    generation so that asynchronous rollout can bound staleness.
    """

    serves_every_rank: bool = False
    """Whether one engine (a server) serves every rank: weight sync then sends from the main rank only."""

    supports_in_flight_updates: bool = False
    """Whether :meth:`sync_weights` may run while :meth:`generate` runs in another thread, landing between two
    decode steps (in-flight weight updates): unfinished completions continue under the new weights."""

    tag_token_versions: bool = False
    """Set by the round orchestrator under in-flight weight updates: each generated token is tagged with the
    engine's :attr:`weight_version` of the forward that gave its logits (`GenerationOutput.extra["token_versions"]`)."""

    accepts_weight_deltas: bool = False
    """Whether :meth:`sync_weights` takes sparse deltas (`<name>#delta_index` / `<name>#delta_value` entries,
    :mod:`hf_verl.parallel.weight_delta`) besides whole tensors, and a sync of only what changed pays (bytes cross a
    wire). `weight_sync="auto"` uses delta sync for such an engine."""

    weight_sync_mode: str = "auto"
    """`"auto"`, `"full"` or `"delta"`: set from the front-end's `weight_sync` setting."""

    def weight_dtype(self):
        """The dtype the engine holds floating weights in (what a delta is computed at); None when unknown."""
        return None

    record_routing: bool = False
    """Whether :meth:`generate` records the experts a Mixture-of-Experts model routed each token to
    (`GenerationOutput.routed_experts`; routing replay). Set by the trainers when `router_replay=True`; an engine
    that cannot record refuses at :meth:`generate`."""

    def __init__(self) -> None:
        self._weight_version = 0

    @property
    def max_model_len(self) -> int | None:
        """The most tokens (prompt and completion) the engine can hold; None where it does not say (a server).
        A transformers engine answers its model's `max_position_embeddings`, vLLM its own context length."""
        model = getattr(self, "model", None)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            config = config.get_text_config()
        length = getattr(config, "max_position_embeddings", None)
        return int(length) if isinstance(length, int) and length > 0 else None

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @abc.abstractmethod
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
        row_seeds: Sequence[int] | None = None,
    ) -> GenerationOutput:
        """Generate one completion per prompt (prompts are token id lists, no padding).

        `row_seeds`, when given, holds one seed per prompt: each completion is then sampled from its
        own random stream, so a row's completion does not depend on which other rows share its call
        (the same global batch gives the same rollouts on one process or split over several). An
        engine that cannot honour it raises `NotImplementedError`.
        """

    @abc.abstractmethod
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights given as (HF parameter name, full tensor) pairs, then bump the version.

        Engines that share the trainer's model object may treat this as a version bump only.
        """

    def _bump_version(self) -> None:
        self._weight_version += 1

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources (processes, servers, memory). Safe to call twice."""
