"""Generation and scoring: prompt ids in, a scored :class:`~hf_verl.data.batch.RolloutBatch` out.

Nothing here touches a trained model, so it may run on a background thread (asynchronous
rollout). Rewards are computed on decoded text with the TRL calling convention
(`f(prompts, completions, completion_ids, **columns)`, conversational completions as assistant
messages) and returned per source, `(N, num_sources)`, NaN where a source returned None.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from hf_verl.data.batch import NOT_ROUTED, RolloutBatch, pad_sequences
from hf_verl.data.prompts import is_conversational
from hf_verl.data.vision import VISION_INPUTS
from hf_verl.parallel import watchdog
from hf_verl.rewards.callables import score_reward_funcs
from hf_verl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
)
from hf_verl.rollout.tools import parse_assistant_turn
from hf_verl.rollout.vision import generate_with_images


def row_seeds(seed: int, round_index: int, dp_rank: int, dp_size: int, rows: int) -> list[int]:
    """One sampling seed per row of a data-parallel rank's part of rollout round `round_index`, from the
    row's place in the global round (ranks hold consecutive slices): the same global round samples the
    same completions on one process or split over several, in any front-end."""
    first = (round_index * dp_size + dp_rank) * rows
    return [seed * 1_000_003 + first + i for i in range(rows)]


def batch_from_output(prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Any], out: GenerationOutput,
                      tokenizer: Any, device: torch.device | str, *, version: int | None = None,
                      batch_cls: type[RolloutBatch] = RolloutBatch) -> RolloutBatch:
    """A validated batch (of `batch_cls`) of `out`'s completions; texts and ids go to `meta` (`prompts`,
    `prompt_ids`, `completions`, `completion_ids`). `version` overrides the engine's weight version."""
    batch = batch_cls.from_lists(prompt_ids, out.completion_ids, tokenizer.pad_token_id,
                                    sampling_logprobs=out.logprobs, device=device)
    batch.is_truncated = torch.tensor([r == FINISH_LENGTH for r in out.finish_reasons], device=batch.device)
    versions = out.extra.get("weight_versions") or [out.weight_version if version is None else version] * len(
        prompt_ids)
    batch.weight_version = torch.tensor(versions, dtype=torch.long, device=batch.device)
    batch.meta.update(prompts=list(prompts), prompt_ids=[list(p) for p in prompt_ids],
                      completions=tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True),
                      completion_ids=out.completion_ids)
    if out.extra.get("token_versions") is not None:  # in-flight weight updates: the version behind each token
        tagged, _ = pad_sequences(out.extra["token_versions"], 0, side="right", device=batch.device,
                                  width=batch.completion_ids.shape[1])
        batch.token_weight_version = tagged
    if out.routed_experts is not None:
        batch.prompt_routed_experts, batch.completion_routed_experts = routing_fields(
            out.routed_experts, [len(p) for p in prompt_ids], batch.prompt_ids.shape[1],
            batch.completion_ids.shape[1], batch.device)
        batch.validate()
    return batch


def routing_fields(records: Sequence[torch.Tensor], prompt_lengths: Sequence[int], prompt_width: int,
                   completion_width: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout's per-row routing records (`(prompt_len + completion_len, layers, top_k)` each) laid out as the
    batch lays out its tokens: `(B, P, layers, top_k)` left-padded and `(B, C, layers, top_k)` right-padded, -1 on
    padding."""
    first = torch.as_tensor(records[0])
    trailing, dtype = tuple(first.shape[1:]), first.dtype
    prompt = torch.full((len(records), prompt_width, *trailing), NOT_ROUTED, dtype=dtype)
    completion = torch.full((len(records), completion_width, *trailing), NOT_ROUTED, dtype=dtype)
    for i, (record, n) in enumerate(zip(records, prompt_lengths)):
        record = torch.as_tensor(record)
        if tuple(record.shape[1:]) != trailing:
            raise ValueError(f"routing record {i} has shape {tuple(record.shape)}, the first {tuple(first.shape)}: "
                             "every row must record the same layers and top-k.")
        if n:
            prompt[i, prompt_width - n :] = record[:n]
        tail = record[n : n + completion_width]
        completion[i, : tail.shape[0]] = tail
    return prompt.to(device), completion.to(device)


@watchdog.phase("generate", role="rollout")
def generate(engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Any],
             sampling: SamplingParams, tokenizer: Any, device: torch.device | str, *,
             row_seeds: Sequence[int] | None = None, version: int | None = None,
             batch_cls: type[RolloutBatch] = RolloutBatch,
             vision_inputs: Sequence[dict] | None = None) -> RolloutBatch:
    """Generate one completion per prompt on `engine` (see :meth:`RolloutEngine.generate`); with `vision_inputs`
    (each prompt's pixel inputs, :mod:`hf_verl.data.vision`) through
    :func:`~hf_verl.rollout.vision.generate_with_images`, the rows keeping them in `meta`."""
    kwargs = {} if row_seeds is None else {"row_seeds": list(row_seeds)}
    if vision_inputs is not None:  # prompts with images: their pixel inputs in the prefill, and on the rows
        out = generate_with_images(engine, prompt_ids, vision_inputs, sampling, **kwargs)
        batch = batch_from_output(prompt_ids, prompts, out, tokenizer, device, version=version, batch_cls=batch_cls)
        batch.meta[VISION_INPUTS] = list(vision_inputs)
        return batch
    out = engine.generate(prompt_ids, sampling, **kwargs)
    return batch_from_output(prompt_ids, prompts, out, tokenizer, device, version=version, batch_cls=batch_cls)


def batch_from_rollout_func(output: Any, prompts: Sequence[Any], tokenizer: Any, device: torch.device | str, *,
                            version: int = 0, batch_cls: type[RolloutBatch] = RolloutBatch
                            ) -> tuple[RolloutBatch, dict[str, list]]:
    """The batch of a TRL `rollout_func` output and the extra fields its reward functions receive.

    `output` holds `prompt_ids`, `completion_ids` and `logprobs` (per token, `None`; top-k lists keep their
    first entry, the sampled token's), one entry per prompt. An `env_mask` entry (per token: 1 on model
    tokens, 0 on environment tokens) becomes the loss mask, the tokens staying attended; every other
    entry is a reward column (a list: one value per row; anything else: the same value for every row).
    A completion is truncated unless it ends with the EOS or padding token. Conversational completions are
    parsed with the tokenizer's `response_template` when it has one (TRL), else decoded as text.
    """
    if not isinstance(output, dict):
        raise TypeError(f"rollout_func must return a dict, got {type(output).__name__}.")
    missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - set(output))
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    n = len(prompts)
    prompt_ids = [[int(t) for t in p] for p in output["prompt_ids"]]
    completion_ids = [[int(t) for t in c] for c in output["completion_ids"]]
    if len(prompt_ids) != n or len(completion_ids) != n:
        raise ValueError(f"rollout_func returned {len(prompt_ids)} prompt_ids and {len(completion_ids)} completion_ids "
                         f"for {n} prompts: return one completion per prompt received (the prompts already repeat "
                         "each dataset prompt num_generations times).")
    logprobs = output["logprobs"]
    if logprobs is not None:
        logprobs = [[float("nan") if x is None else float(x[0] if isinstance(x, (list, tuple)) else x) for x in row]
                    for row in logprobs]
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    placeholder = [[0.0] * len(c) for c in completion_ids]
    out = GenerationOutput(completion_ids, logprobs if logprobs is not None else placeholder,
                           [FINISH_STOP if c and c[-1] in ends else FINISH_LENGTH for c in completion_ids],
                           weight_version=version)
    batch = batch_from_output(prompt_ids, prompts, out, tokenizer, device, batch_cls=batch_cls)
    if logprobs is None or any(math.isnan(x) for row in logprobs for x in row):  # no importance sampling then
        batch.sampling_logprobs = None
    extra = {k: v for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs")}
    env_mask = extra.pop("env_mask", None)
    if env_mask is not None:
        if [len(m) for m in env_mask] != [len(c) for c in completion_ids]:
            raise ValueError("rollout_func's env_mask must have one entry per completion token.")
        mask, _ = pad_sequences(env_mask, 1, side="right", device=batch.device, width=batch.completion_ids.shape[1])
        batch.completion_attention_mask = batch.completion_mask
        batch.completion_mask = batch.completion_mask * (mask != 0).long()
    if prompts and is_conversational(prompts[0]) and getattr(tokenizer, "response_template", None) is not None:
        batch.meta["completions"] = [[parse_assistant_turn(tokenizer, c, prefix_ids=p).message]
                                     for p, c in zip(prompt_ids, completion_ids)]
    columns = {k: list(v) if isinstance(v, list) else [v] * n for k, v in extra.items()}
    return batch.validate(), columns


@watchdog.phase("score", role="reward")
def score_texts(reward_funcs: Sequence[Any], prompts: Sequence[Any], completions: Sequence[Any],
                completion_ids: Sequence[Sequence[int]], columns: dict[str, list]) -> torch.Tensor:
    """`(N, num_sources)` scores of decoded completions (NaN where a source returned None). For conversational
    prompts a completion text becomes one assistant message; a completion that is already a message list (a
    multi-turn, tool-calling rollout) is passed as it is."""
    if prompts and is_conversational(prompts[0]):  # conversational: completions are assistant messages
        completions = [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions]
    return score_reward_funcs(reward_funcs, prompts=list(prompts), completions=list(completions),
                              completion_ids=list(completion_ids), columns=columns)


def score(reward_funcs: Sequence[Any], batch: RolloutBatch, columns: dict[str, list]) -> torch.Tensor:
    """:func:`score_texts` of a generated batch, on the batch's device."""
    return score_texts(reward_funcs, batch.meta["prompts"], batch.meta["completions"],
                       batch.meta["completion_ids"], columns).to(batch.device)


def row_columns(rows: Sequence[dict], exclude: Sequence[str] = ("prompt", "input_ids")) -> dict[str, list]:
    """The dataset columns of `rows` that reward functions receive as keyword arguments."""
    return {k: [r.get(k) for r in rows] for k in rows[0] if k not in exclude} if rows else {}


def generate_scoring_as_done(engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], prompts: Sequence[Any],
                             sampling: SamplingParams, tokenizer: Any, device: torch.device | str,
                             reward_funcs: Sequence[Any], columns: dict[str, list],
                             group_size: int) -> tuple[RolloutBatch, torch.Tensor, float]:
    """Generate through `engine.generate_stream` (a server) and score each request's rows as soon as
    it returns, while later requests still generate. Requests hold whole groups, so every reward
    call sees complete groups. Returns the batch, the scores and the seconds spent scoring."""
    chunk = max(group_size, engine.prompts_per_request // group_size * group_size)
    parts, scores, reward_s = {}, {}, 0.0
    for offset, out in engine.generate_stream(prompt_ids, sampling, chunk_rows=chunk):
        t0 = time.perf_counter()
        end = offset + len(out.completion_ids)
        texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        part_columns = {k: v[offset:end] for k, v in columns.items()}
        scores[offset] = score_texts(reward_funcs, prompts[offset:end], texts, out.completion_ids, part_columns)
        reward_s += time.perf_counter() - t0
        parts[offset] = out
    order = sorted(parts)
    batch = batch_from_output(prompt_ids, prompts, GenerationOutput.concat([parts[o] for o in order]), tokenizer,
                              device)
    return batch, torch.cat([scores[o] for o in order]).to(batch.device), reward_s
