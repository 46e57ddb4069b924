"""Multi-turn rollouts with tools: generate, run the tool calls, append their results, generate again.

:func:`generate_with_tools` is :func:`~hf_verl.pipeline.generation.generate` for conversational prompts
whose model may call tools (TRL's `tools` / `environment_factory` / `max_tool_calling_iterations`).
Each row's completion is the concatenation of its assistant turns and of the *observation* spans
between them: the tokens the chat template adds for the tool messages and the next assistant
header. The model's tokens are never re-tokenised: a turn continues from the exact ids generated so
far plus the observation ids, so sampling log-probs stay aligned with what the trainer recomputes. This
needs a prefix-preserving chat template; Qwen3's is not, and is replaced for the rollout (not on the
tokenizer) by hf_verl's Qwen3 training template (:mod:`hf_verl.data.chat_templates`).

The returned batch has the layout of :func:`~hf_verl.pipeline.generation.generate` (prompts
left-padded, completions right-padded) with:

- `completion_mask` 1 on model-generated tokens and 0 on observation tokens (and padding), and
  `completion_attention_mask` 1 on every real token (observations are attended and positioned);
- `sampling_logprobs` 0.0 on observation tokens;
- `is_truncated` for rows cut by the completion budget (`sampling.max_new_tokens` counts the whole
  multi-turn completion, observations included);
- `meta["completions"]`: per row the list of messages after the prompt (assistant turns with their
  parsed `tool_calls`, then tool messages, ...), TRL's conversational completions for tool rollouts;
  `meta["tool_calls"]`, `meta["tool_failures"]`, `meta["tool_parse_errors"]`: counts per row.

Departures from TRL's GRPOTrainer loop: calls of different rows run concurrently, each with a timeout;
a row whose tool results would not fit the budget drops them (as TRL does) and is marked truncated
(TRL leaves it untruncated because its last token is an end of turn); each turn of a seeded row samples
with its own derived seed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_verl.data.batch import RolloutBatch, pad_sequences
from hf_verl.data.chat_templates import training_chat_template
from hf_verl.data.prompts import is_conversational, render_prompt
from hf_verl.rollout.base import FINISH_LENGTH, RolloutEngine, SamplingParams
from hf_verl.rollout.tools import (
    DEFAULT_TOOL_TIMEOUT_S,
    environment_tools,
    parse_assistant_turn,
    run_tool_calls,
    tool_name,
    tool_schemas,
)

logger = logging.getLogger(__name__)

_MAX_TOOL_THREADS = 32
_announced: set[int] = set()  # hashes of the tokenizer templates whose substitution was logged


def rollout_chat_template_kwargs(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> dict:
    """The `apply_chat_template` arguments to render a tool-calling rollout with.

    `chat_template_kwargs` as given, plus `chat_template=` hf_verl's prefix-preserving Qwen3 training template
    (:func:`~hf_verl.data.chat_templates.training_chat_template`) when the tokenizer carries Qwen3's template
    and no `chat_template` is given; the tokenizer itself is not modified. The substitution is logged once
    per template at INFO.
    """
    kwargs = dict(chat_template_kwargs or {})
    if kwargs.get("chat_template") is not None:
        return kwargs
    template = training_chat_template(tokenizer)
    if template is not None:
        kwargs["chat_template"] = template
        key = hash(tokenizer.chat_template)
        if key not in _announced:
            _announced.add(key)
            logger.info("the tokenizer's chat template is Qwen3's, which is not prefix-preserving (it drops the "
                        "<think> block of earlier assistant turns): tool-calling rollouts render with hf_verl's "
                        "Qwen3 training template instead, which keeps every assistant turn as Qwen3 renders the "
                        "last one (the tokenizer is left unchanged).")
    return kwargs


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn `turn` of a row seeded with `seed`: `seed` itself for the first turn (so a
    rollout without tool calls samples exactly as :func:`~hf_verl.pipeline.generation.generate`), a hash of
    `(seed, turn)` for later turns."""
    if seed is None or turn == 0:
        return seed
    digest = hashlib.blake2b(f"{int(seed)}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64


def observation_ids(tokenizer: Any, conversation: Sequence[Mapping], tool_messages: Sequence[Mapping], *,
                    tools: Sequence[Mapping] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
    """The token ids the chat template puts between an assistant turn and the next generated one.

    The conversation (ending with the assistant turn that called the tools) is rendered without and
    with `tool_messages` (the latter with the generation prompt); the ids that the second rendering adds
    are the observation. The first rendering is cut after its last end-of-sequence token, because the
    generated turn ends there (templates write text such as a newline after it).

    Args:
        tokenizer (`PreTrainedTokenizerBase`): tokenizer with a chat template that renders tool messages.
        conversation (`Sequence[dict]`): the messages so far, ending with the assistant tool-calling turn.
        tool_messages (`Sequence[dict]`): the `{"role": "tool", ...}` messages answering that turn.
        tools (`Sequence[dict]`, *optional*): the tool schemas the prompt was rendered with.
        chat_template_kwargs (`dict`, *optional*): extra arguments for `apply_chat_template`.

    Returns:
        `list[int]`: the observation token ids.
    """
    kwargs = {**(chat_template_kwargs or {}), "tools": list(tools) if tools else None, "tokenize": False}
    before = tokenizer.apply_chat_template(list(conversation), add_generation_prompt=False, **kwargs)
    after = tokenizer.apply_chat_template(list(conversation) + list(tool_messages), add_generation_prompt=True,
                                          **kwargs)
    before_ids = tokenizer(before, add_special_tokens=False)["input_ids"]
    after_ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is not None and eos in before_ids:
        before_ids = before_ids[: len(before_ids) - before_ids[::-1].index(eos)]
    if after_ids[: len(before_ids)] == before_ids:
        return list(after_ids[len(before_ids) :])
    # token boundaries moved at the seam: fall back to the text difference, tokenised on its own
    eos_text = tokenizer.eos_token
    cut = before[: before.rindex(eos_text) + len(eos_text)] if eos_text and eos_text in before else before
    if not after.startswith(cut):
        raise ValueError(
            "the chat template is not prefix-preserving: rendering the tool results changed the text of the "
            "earlier messages, so observation tokens cannot be appended to the generated ones. Use a chat "
            "template that renders earlier turns identically whatever follows them."
        )
    return list(tokenizer(after[len(cut) :], add_special_tokens=False)["input_ids"])


def reset_environments(environments: Sequence[Any], prompts: Sequence[list[dict]],
                       rows: Sequence[Mapping[str, Any]]) -> list[list[dict]]:
    """Reset one environment per row and return the prompts to generate from (TRL's `environment_factory`).

    `environment.reset(**row)` gets the row's dataset columns; when it returns a string, that string is
    appended to the content of the prompt's last message (a new message list: `prompts` is left as is).

    Args:
        environments (`Sequence[Any]`): one environment instance per row.
        prompts (`Sequence[list[dict]]`): conversational prompts, one per row.
        rows (`Sequence[dict]`): the dataset rows (keyword arguments of `reset`).

    Returns:
        `list[list[dict]]`: the prompts, with each environment's initial observation appended.
    """
    if not len(environments) == len(prompts) == len(rows):
        raise ValueError(f"{len(environments)} environments, {len(prompts)} prompts and {len(rows)} rows.")
    out = []
    for environment, prompt, row in zip(environments, prompts, rows):
        observation = environment.reset(**row)
        if observation is None:
            out.append(list(prompt))
            continue
        if not isinstance(observation, str):
            raise TypeError(f"environment.reset must return a string or None, got {type(observation).__name__}.")
        last = prompt[-1]
        out.append(list(prompt[:-1]) + [{**last, "content": last["content"] + observation}])
    return out


@dataclass
class _Row:
    """The growing state of one row's rollout."""

    context: list[int]  # prompt ids + completion ids so far: what the next turn continues
    conversation: list[dict]  # prompt messages + completion messages so far
    tools: dict[str, Callable]
    schemas: list[dict] | None
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    pending: list[dict] = field(default_factory=list)  # tool calls of the last turn, to run
    tool_calls: int = 0
    tool_failures: int = 0
    parse_errors: int = 0
    truncated: bool = False


def _row_tools(tools: Sequence[Callable], environment: Any, schema_cache: dict) -> tuple[dict, list[dict] | None]:
    callables = list(tools) + (environment_tools(environment) if environment is not None else [])
    schemas = []
    for fn in callables:
        key = getattr(fn, "__func__", fn)  # bound methods of one class share a schema
        if key not in schema_cache:
            schema_cache[key] = tool_schemas([fn])[0]
        schemas.append(schema_cache[key])
    names = [tool_name(fn) for fn in callables]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique within a row, got {names}.")
    return dict(zip(names, callables)), schemas or None


def _generate_turn(engine: RolloutEngine, rows: list[_Row], active: list[int], sampling: SamplingParams,
                   budget: int, turn: int, tokenizer: Any, row_seeds: Sequence[int] | None) -> None:
    """One generation for the `active` rows; appends each turn (cut to the row's remaining budget)."""
    remaining = [budget - len(rows[i].completion_ids) for i in active]
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=max(remaining), seed=turn_seed(sampling.seed, turn))
    kwargs = {} if row_seeds is None else {"row_seeds": [turn_seed(row_seeds[i], turn) for i in active]}
    out = engine.generate([rows[i].context for i in active], turn_sampling, **kwargs)
    versions = out.extra.get("weight_versions") or [out.weight_version] * len(active)
    for j, i in enumerate(active):
        row, ids, lps = rows[i], list(out.completion_ids[j]), list(out.logprobs[j])
        row.truncated = out.finish_reasons[j] == FINISH_LENGTH or len(ids) > remaining[j]
        ids, lps = ids[: remaining[j]], lps[: remaining[j]]
        parsed = parse_assistant_turn(tokenizer, ids, prefix_ids=row.context, tools=row.schemas)
        row.context += ids
        row.completion_ids += ids
        row.mask += [1] * len(ids)
        row.logprobs += [float(lp) for lp in lps]
        row.versions.append(int(versions[j]))
        row.messages.append(parsed.message)
        row.conversation.append(parsed.message)
        row.parse_errors += len(parsed.errors)
        row.pending = parsed.tool_calls if row.tools and not row.truncated else []


def _run_pending(rows: list[_Row], active: list[int], timeout_s: float) -> dict[int, list]:
    """The results of every active row's pending calls; rows run concurrently, each row's calls in order."""
    with concurrent.futures.ThreadPoolExecutor(min(len(active), _MAX_TOOL_THREADS)) as pool:
        futures = {i: pool.submit(run_tool_calls, rows[i].pending, rows[i].tools, timeout_s=timeout_s)
                   for i in active}
        return {i: f.result() for i, f in futures.items()}


def _append_observation(row: _Row, results: list, budget: int, max_context: int | None, tokenizer: Any,
                        chat_template_kwargs: dict | None) -> bool:
    """Add the tool messages and their observation ids to `row`; False (row truncated) if they do not fit."""
    row.tool_calls += len(results)
    row.tool_failures += sum(r.failed for r in results)
    row.pending = []
    tool_messages = [r.message for r in results]
    obs = observation_ids(tokenizer, row.conversation, tool_messages, tools=row.schemas,
                          chat_template_kwargs=chat_template_kwargs)
    # no room for the results and one more generated token (in the budget, or in the model's context)
    if len(row.completion_ids) + len(obs) >= budget or (
            max_context is not None and len(row.context) + len(obs) >= max_context):
        row.truncated = True
        return False
    row.context += obs
    row.completion_ids += obs
    row.mask += [0] * len(obs)
    row.logprobs += [0.0] * len(obs)
    row.messages += tool_messages
    row.conversation += tool_messages
    return True


def generate_with_tools(
    engine: RolloutEngine,
    prompts: Sequence[list[dict]],
    tokenizer: Any,
    sampling: SamplingParams,
    tools: Sequence[Callable] = (),
    max_iterations: int | None = None,
    device: torch.device | str = "cpu",
    *,
    environments: Sequence[Any] | None = None,
    row_seeds: Sequence[int] | None = None,
    tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    chat_template_kwargs: dict | None = None,
    max_context_length: int | None = None,
    version: int | None = None,
    batch_cls: type[RolloutBatch] = RolloutBatch,
) -> RolloutBatch:
    """Generate one multi-turn, tool-calling completion per conversational prompt (see the module docstring).

    Args:
        engine ([`RolloutEngine`]): generates every turn, from token ids.
        prompts (`Sequence[list[dict]]`): conversational prompts (lists of `{"role", "content"}` messages).
        tokenizer (`PreTrainedTokenizerBase`): the policy's tokenizer; its chat template must render tools,
            assistant `tool_calls` and `tool` messages, and be prefix-preserving (Qwen3's, which is not, is
            replaced by hf_verl's training template: :func:`rollout_chat_template_kwargs`).
        sampling ([`SamplingParams`]): per-turn sampling; `max_new_tokens` bounds the *whole* completion
            (all turns and observations).
        tools (`Sequence[Callable]`, defaults to `()`): tools (sync or async functions) every row may call.
        max_iterations (`int`, *optional*): most tool-calling rounds per row (TRL's
            `max_tool_calling_iterations`); a row generates at most `max_iterations + 1` turns, and its last
            turn's calls are not run once the limit is reached. `None`: no limit but the budget.
        device (`torch.device` or `str`, defaults to `"cpu"`): device of the returned batch.
        environments (`Sequence[Any]`, *optional*): one environment instance per row (already reset, see
            :func:`reset_environments`); its public methods are that row's tools, besides `tools`.
        row_seeds (`Sequence[int]`, *optional*): one seed per row; turn `t` samples with
            `turn_seed(seed, t)`.
        tool_timeout_s (`float`, defaults to `30.0`): seconds each tool call may take.
        prompt_ids (`Sequence[Sequence[int]]`, *optional*): the prompts' token ids when already tokenised
            (with the same tools); rendered with the chat template otherwise.
        chat_template_kwargs (`dict`, *optional*): extra arguments for `apply_chat_template` (a
            `chat_template` given here is used as is).
        max_context_length (`int`, *optional*): the engine's context limit (prompt and completion); tool
            results that would reach it are dropped and the row is marked truncated, as with the budget.
        version (`int`, *optional*): weight version to record instead of the engine's.
        batch_cls (`type[RolloutBatch]`, defaults to [`RolloutBatch`]): class of the returned batch.

    Returns:
        [`RolloutBatch`]: validated; see the module docstring for masks and `meta`.
    """
    n = len(prompts)
    if n == 0:
        raise ValueError("generate_with_tools needs at least one prompt.")
    if not all(is_conversational(p) for p in prompts):
        raise ValueError("tool-calling rollouts need conversational prompts (lists of {'role', 'content'} messages).")
    if max_iterations is not None and max_iterations < 0:
        raise ValueError(f"max_iterations must be >= 0 or None, got {max_iterations}.")
    if tool_timeout_s <= 0:
        raise ValueError(f"tool_timeout_s must be > 0, got {tool_timeout_s}.")
    chat_template_kwargs = rollout_chat_template_kwargs(tokenizer, chat_template_kwargs)
    for name, seq in (("environments", environments), ("row_seeds", row_seeds), ("prompt_ids", prompt_ids)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{len(seq)} {name} for {n} prompts.")
    schema_cache: dict = {}
    rows = []
    for i, prompt in enumerate(prompts):
        row_tools, schemas = _row_tools(tools, environments[i] if environments is not None else None, schema_cache)
        if prompt_ids is None:
            text = render_prompt(prompt, tokenizer, {**(chat_template_kwargs or {}), "tools": schemas})
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = prompt_ids[i]
        rows.append(_Row(context=[int(t) for t in ids], conversation=list(prompt), tools=row_tools, schemas=schemas))
    first_ids = [list(r.context) for r in rows]

    budget, active, turn = sampling.max_new_tokens, list(range(n)), 0
    while active:
        _generate_turn(engine, rows, active, sampling, budget, turn, tokenizer, row_seeds)
        calling = [i for i in active if rows[i].pending]
        if max_iterations is not None and turn >= max_iterations:
            calling = []
        results = _run_pending(rows, calling, tool_timeout_s) if calling else {}
        active = [i for i in calling if _append_observation(rows[i], results[i], budget, max_context_length,
                                                            tokenizer, chat_template_kwargs)]
        logger.debug("tool turn %d: %d rows called tools, %d continue", turn, len(calling), len(active))
        turn += 1
    return _to_batch(rows, first_ids, prompts, tokenizer, device, version, batch_cls)


def _to_batch(rows: list[_Row], prompt_ids: list[list[int]], prompts: Sequence[Any], tokenizer: Any,
              device: torch.device | str, version: int | None, batch_cls: type[RolloutBatch]) -> RolloutBatch:
    completion_ids = [r.completion_ids for r in rows]
    batch = batch_cls.from_lists(prompt_ids, completion_ids, tokenizer.pad_token_id,
                                 sampling_logprobs=[r.logprobs for r in rows], device=device)
    batch.completion_attention_mask = batch.completion_mask  # the padding mask: observations are attended
    batch.completion_mask, _ = pad_sequences([r.mask for r in rows], 0, side="right", device=batch.device,
                                             width=batch.completion_ids.shape[1])
    batch.is_truncated = torch.tensor([r.truncated for r in rows], device=batch.device)
    versions = [min(r.versions) if version is None else version for r in rows]
    batch.weight_version = torch.tensor(versions, dtype=torch.long, device=batch.device)
    batch.meta.update(prompts=list(prompts), prompt_ids=prompt_ids, completions=[r.messages for r in rows],
                      completion_ids=completion_ids, tool_calls=[r.tool_calls for r in rows],
                      tool_failures=[r.tool_failures for r in rows],
                      tool_parse_errors=[r.parse_errors for r in rows])
    return batch.validate()
