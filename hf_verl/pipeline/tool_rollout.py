"""Tool-calling rollouts for every front-end: one setup, one code path.

:class:`ToolRollout` holds what TRL's `GRPOTrainer` takes for multi-turn rollouts (`tools`,
`environment_factory`, `max_tool_calling_iterations`), checks it against the tokenizer and the
prompts before anything trains, and turns rows into a generated and scored
:class:`~hf_verl.data.batch.RolloutBatch` through
:func:`~hf_verl.pipeline.multi_turn.generate_with_tools`. The GRPO trainer (`_collect`) and the
role facade (`Trainer.rollout`) both call :meth:`ToolRollout.generate_and_score`; any
:class:`~hf_verl.rollout.base.RolloutEngine` generates the turns (transformers, in-process vLLM, a
server).

Environments (TRL's `environment_factory`): a callable returning a new environment, or a dict of
them selected per row by the row's `environment` column. One instance per row, drawn from a pool
(instances are made once and reset for every rollout), reset with the row's columns
(`reset(**row)`; a returned string is appended to the prompt's last message); its public methods
other than `reset` and `get_reward` are that row's tools, besides the shared `tools`. An environment
class with a `get_reward()` method is an extra reward source, named after the class, weight 1,
scoring only rows of that exact class. Reward functions receive the row's instances as
`environments=`.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_verl.data.batch import RolloutBatch
from hf_verl.data.prompts import is_conversational, tokenize_prompts
from hf_verl.pipeline.generation import score
from hf_verl.pipeline.multi_turn import (
    generate_with_tools,
    observation_ids,
    reset_environments,
    rollout_chat_template_kwargs,
)
from hf_verl.rollout.base import RolloutEngine, SamplingParams
from hf_verl.rollout.tools import (
    DEFAULT_TOOL_TIMEOUT_S,
    environment_tools,
    supports_tool_calling,
    tool_name,
    tool_schemas,
)

ENVIRONMENT_COLUMN = "environment"  # the row column that picks an environment when environment_factory is a dict
_OWN = object()  # `generate_and_score(max_iterations=...)` not given: the ToolRollout's own


def _environment_reward(env_type: type) -> Callable:
    """A reward function scoring the rows whose environment is exactly `env_type` by its `get_reward()`."""
    if inspect.iscoroutinefunction(env_type.get_reward):
        async def reward(environments=None, **_):
            return [await e.get_reward() if type(e) is env_type else None for e in environments]
    else:
        def reward(environments=None, **_):
            return [e.get_reward() if type(e) is env_type else None for e in environments]
    reward.__name__ = reward.__qualname__ = env_type.__name__
    return reward


@dataclass
class ToolRolloutResult:
    """A scored tool-calling rollout: the batch, `(N, num_reward_funcs)` scores, prompts truncated, seconds."""

    batch: RolloutBatch
    rewards_per_func: torch.Tensor
    num_truncated: int
    generate_s: float
    reward_s: float


class ToolRollout:
    """Tools and environments of tool-calling rollouts (see the module docstring).

    Args:
        tools (`Sequence[Callable]`, *optional*): functions (sync or async) with type hints and a
            Google-style docstring; every row may call them.
        environment_factory (`Callable` or `dict[str, Callable]`, *optional*): makes one environment.
            Each factory is called once here, to check the environment (a `reset` method, tools with
            schemas) and to seed the pool.
        max_iterations (`int`, *optional*): most tool-calling rounds per row; `None`: no limit but
            the completion budget.
        tool_timeout_s (`float`, defaults to `30.0`): seconds each tool call may take.
    """

    def __init__(self, tools: Sequence[Callable] | None = None,
                 environment_factory: Callable | Mapping[str, Callable] | None = None,
                 max_iterations: int | None = None, tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S) -> None:
        self.tools = list(tools or [])
        for tool in self.tools:
            if not callable(tool):
                raise TypeError(f"tools must be callables (functions with type hints and a docstring), got {tool!r}.")
        self.max_iterations = max_iterations
        self.tool_timeout_s = tool_timeout_s
        if environment_factory is None:
            factories = None
        elif isinstance(environment_factory, Mapping):
            factories = dict(environment_factory)
            if not factories:
                raise ValueError("environment_factory is an empty dict; give at least one factory.")
        else:
            factories = {None: environment_factory}
        self.factories = factories
        self.multi_environment = isinstance(environment_factory, Mapping)
        self.reset_excludes: tuple[str, ...] = ()  # row columns the environments' `reset` does not receive
        self._lock = threading.Lock()
        self._pool: dict[Any, list] = {}
        self._schemas: dict[Any, list[dict] | None] = {None: tool_schemas(self.tools) or None}
        self.environment_types: list[type] = []  # classes with get_reward, one reward source each
        for name, factory in (factories or {}).items():
            if not callable(factory):
                raise TypeError(f"environment_factory[{name!r}] must be a callable returning an environment.")
            instance = factory()
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(f"the environment made by environment_factory{'' if name is None else f'[{name!r}]'} "
                                 f"({type(instance).__name__}) must define a callable `reset` method.")
            methods = environment_tools(instance)
            # raises on a method without a schema, or one named like a shared tool
            self._schemas[name] = tool_schemas(self.tools + methods) or None
            self._pool[name] = [instance]
            if callable(getattr(type(instance), "get_reward", None)) and type(instance) not in self.environment_types:
                self.environment_types.append(type(instance))

    @property
    def tool_names(self) -> list[str]:
        return [tool_name(t) for t in self.tools]

    def reward_funcs(self) -> list[Callable]:
        """The environments' `get_reward` as reward functions (TRL: one per class, named after it, weight 1)."""
        return [_environment_reward(t) for t in self.environment_types]

    # ------------------------------------------------------------------ checks
    def check_tokenizer(self, tokenizer: Any, chat_template_kwargs: dict | None = None) -> None:
        """Raise unless `tokenizer`'s chat template renders a tool exchange and keeps earlier turns as they are.

        Qwen3's template, which does not keep them, passes: the rollouts render with hf_verl's Qwen3 training
        template instead (:func:`~hf_verl.pipeline.multi_turn.rollout_chat_template_kwargs`, logged once);
        the tokenizer is not modified. Any other template that rewrites earlier turns is refused.
        """
        if not supports_tool_calling(tokenizer):
            raise ValueError(
                "the tokenizer's chat template cannot render tool calls (a user turn, an assistant turn with "
                "`tool_calls`, a `tool` message): tools and environment_factory need a tool-calling template. Use a "
                "tokenizer whose chat template supports tools (Qwen2.5 / Qwen3, Llama 3.1+, Hermes-style), or set "
                "`tokenizer.chat_template` to one, or drop tools / environment_factory.")
        call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        try:
            observation_ids(tokenizer, [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "", "tool_calls": [call]}],
                            [{"role": "tool", "name": "f", "content": "2"}],
                            chat_template_kwargs=rollout_chat_template_kwargs(tokenizer, chat_template_kwargs))
        except ValueError as err:
            raise ValueError(f"tool-calling rollouts cannot use this tokenizer's chat template: {err}") from None

    @staticmethod
    def check_prompts(prompts: Sequence[Any]) -> None:
        """Raise unless every prompt is conversational (a list of `{"role", "content"}` messages)."""
        for i, prompt in enumerate(prompts):
            if not is_conversational(prompt):
                raise ValueError(
                    f"tool-calling rollouts need conversational prompts (lists of {{'role', 'content'}} messages), "
                    f"but prompt {i} is {type(prompt).__name__} {str(prompt)[:60]!r}: give the dataset's `prompt` "
                    "column as messages, or drop tools / environment_factory.")

    # ------------------------------------------------------------------ environments
    def _environment_name(self, row: Mapping) -> Any:
        if not self.multi_environment:
            return None
        name = row.get(ENVIRONMENT_COLUMN)
        if name not in self.factories:
            raise ValueError(f"a row has {ENVIRONMENT_COLUMN}={name!r}, which is not among the environments of "
                             f"environment_factory: {sorted(map(str, self.factories))}.")
        return name

    def take_environments(self, rows: Sequence[Mapping]) -> list | None:
        """One environment per row from the pool (more are made when the pool runs short); `None` without
        environments. Give them back with :meth:`release` and the same rows."""
        if self.factories is None:
            return None
        names = [self._environment_name(r) for r in rows]
        with self._lock:
            taken = [self._pool[name].pop() if self._pool[name] else None for name in names]
        return [env if env is not None else self.factories[name]() for env, name in zip(taken, names)]

    def release(self, environments: Sequence[Any] | None, rows: Sequence[Mapping]) -> None:
        """Return the environments :meth:`take_environments` gave for `rows` to the pool, for later rollouts
        to reset and reuse."""
        if not environments:
            return
        with self._lock:
            for env, row in zip(environments, rows):
                self._pool[self._environment_name(row)].append(env)

    # ------------------------------------------------------------------ rollout
    def generate_and_score(self, engine: RolloutEngine, rows: Sequence[Mapping[str, Any]], tokenizer: Any,
                           sampling: SamplingParams, reward_funcs: Sequence[Any], columns: dict[str, list], *,
                           device: torch.device | str, row_seeds: Sequence[int] | None = None,
                           chat_template_kwargs: dict | None = None, max_prompt_length: int | None = None,
                           max_context_length: int | None = None, version: int | None = None,
                           batch_cls: type[RolloutBatch] = RolloutBatch, max_iterations: Any = _OWN
                           ) -> ToolRolloutResult:
        """Reset one environment per row, render each prompt with its row's tools (left-truncated to
        `max_prompt_length`), generate the multi-turn completions and score them.

        Args:
            engine ([`RolloutEngine`]): generates every turn.
            rows (`Sequence[dict]`): the rows, each with a conversational `prompt`; every column is an
                argument of the environment's `reset`.
            tokenizer: the policy's tokenizer (see :meth:`check_tokenizer`).
            sampling ([`SamplingParams`]): `max_new_tokens` bounds the whole multi-turn completion.
            reward_funcs / columns: the reward sources and the columns they receive (TRL's convention); the
                completions are message lists, and `environments=` holds the rows' environments.
            device, row_seeds, chat_template_kwargs, max_context_length, version, batch_cls: as for
                :func:`~hf_verl.pipeline.multi_turn.generate_with_tools`.
            max_prompt_length (`int`, *optional*): prompts are left-truncated to this many tokens.
            max_iterations (`int` or `None`, *optional*): overrides the limit of tool-calling rounds given at
                construction (a front-end whose setting may change between rollouts).
        """
        t0 = time.perf_counter()
        prompts = [r["prompt"] for r in rows]
        self.check_prompts(prompts)
        # the prompts, observations and generation prompts all render with one template (Qwen3's is swapped)
        chat_template_kwargs = rollout_chat_template_kwargs(tokenizer, chat_template_kwargs)
        environments = self.take_environments(rows)
        try:
            if environments is not None:
                skip = set(self.reset_excludes) | ({ENVIRONMENT_COLUMN} if self.multi_environment else set())
                reset_rows = [{k: v for k, v in r.items() if k not in skip} for r in rows]
                prompts = reset_environments(environments, prompts, reset_rows)
            prompt_ids, num_truncated = [], 0
            for row, prompt in zip(rows, prompts):  # each row's prompt carries its own tools' schemas
                schemas = self._schemas[self._environment_name(row)]
                tok = tokenize_prompts([prompt], tokenizer, max_prompt_length,
                                       {**chat_template_kwargs, "tools": schemas})
                prompt_ids.append(tok.ids[0])
                num_truncated += tok.num_truncated
            batch = generate_with_tools(
                engine, prompts, tokenizer, sampling, self.tools,
                self.max_iterations if max_iterations is _OWN else max_iterations, device,
                environments=environments, row_seeds=row_seeds, tool_timeout_s=self.tool_timeout_s,
                prompt_ids=prompt_ids, chat_template_kwargs=chat_template_kwargs,
                max_context_length=max_context_length, version=version, batch_cls=batch_cls)
            t1 = time.perf_counter()
            reward_columns = dict(columns)
            if environments is not None:
                reward_columns["environments"] = environments
            rewards_per_func = score(reward_funcs, batch, reward_columns)
            return ToolRolloutResult(batch, rewards_per_func, num_truncated, t1 - t0, time.perf_counter() - t1)
        finally:
            self.release(environments, rows)


def tool_metrics(batch: RolloutBatch) -> torch.Tensor | None:
    """`[tool calls, failed calls, rows]` of a tool-calling rollout (float64), `None` for any other batch;
    TRL's `tools/call_frequency` is calls / rows and `tools/failure_frequency` failures / calls (0 without
    calls), taken after summing over ranks."""
    if "tool_calls" not in batch.meta:
        return None
    return torch.tensor([float(sum(batch.meta["tool_calls"])), float(sum(batch.meta["tool_failures"])),
                         float(batch.batch_size)], dtype=torch.float64)


def tool_frequencies(counts: torch.Tensor) -> dict[str, float]:
    """TRL's tool metrics from summed :func:`tool_metrics` counts."""
    calls, failures, rows = counts.tolist()
    return {"tools/call_frequency": calls / max(rows, 1.0),
            "tools/failure_frequency": failures / calls if calls > 0 else 0.0}
